"""The package's import graph: no cycles, and the layering rules of docs/architecture.md.

Read from the source with `ast` (nothing is imported). Only imports that run count: those under
`if TYPE_CHECKING:` are annotations, not dependencies. A function-level import counts like any other.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SRC = Path(__file__).resolve().parent.parent / "src"
PKG = "sandfleet"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in (SRC / PKG).rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


MODULES = _modules()


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node except what sits under `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def _imports(name: str, path: Path) -> set[str]:
    """The package's modules `name` imports (a module, or a name from a module: whichever exists)."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_pkg else name.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for target in targets:
            # `import a.b.c` depends on a.b.c; the longest prefix that is a module of ours
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                out.add(target)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _in(module: str, *areas: str) -> bool:
    """`module` is one of `areas` or inside one (the bare package name means its __init__ only)."""
    return any(module == a or (a != PKG and module.startswith(a + ".")) for a in areas)


def test_no_import_cycles() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


# (what, the modules it covers, what they may import of the package): see docs/architecture.md.
SDK = ("sandfleet.client", "sandfleet.models", "sandfleet.errors", "sandfleet.ids", "sandfleet.operations")
# What every tier's folder (backends/<tier>/) may use besides its own modules.
SHARED_BY_TIERS = (
    "sandfleet.backends.base",
    "sandfleet.backends.config",
    "sandfleet.runtime",
    "sandfleet.images",
    "sandfleet.errors",
    "sandfleet.models",
)
RULES = [
    ("the SDK needs only pydantic, httpx and httptools", (*SDK, "sandfleet"), SDK),
    ("runtime: kernel mechanisms, no API", ("sandfleet.runtime",), ("sandfleet.runtime", "sandfleet.errors")),
    (
        "images never use the SDK or the daemon",
        ("sandfleet.images",),
        ("sandfleet.images", "sandfleet.errors", "sandfleet.models"),
    ),
    (
        "backends sit under the service",
        ("sandfleet.backends",),
        ("sandfleet.backends", "sandfleet.runtime", "sandfleet.images", "sandfleet.errors", "sandfleet.models"),
    ),
    (
        "the operations are declared over the wire models only",
        ("sandfleet.operations",),
        ("sandfleet", "sandfleet.operations", "sandfleet.models", "sandfleet.errors", "sandfleet.ids"),
    ),
    (
        "loading a node's config imports no tier's code",
        ("sandfleet.backends.config",),
        ("sandfleet.backends.config", "sandfleet.runtime", "sandfleet.errors"),
    ),
    (
        "the VM tiers' folder uses no other tier's",
        ("sandfleet.backends.vm",),
        (*SHARED_BY_TIERS, "sandfleet.backends.vm"),
    ),
    (
        "the container tier's folder uses no other tier's",
        ("sandfleet.backends.container",),
        (*SHARED_BY_TIERS, "sandfleet.backends.container"),
    ),
    (
        "the fncall tier's workers are the container tier's sandboxes",
        ("sandfleet.backends.fncall",),
        (*SHARED_BY_TIERS, "sandfleet.backends.fncall", "sandfleet.backends.container"),
    ),
    (
        "the routes see the concerns' types only (as annotations), never a backend or the runtime",
        ("sandfleet.daemon.api", "sandfleet.daemon.protocol"),
        (
            "sandfleet",
            "sandfleet.operations",  # what each route is: declared there
            "sandfleet.daemon.api",
            "sandfleet.daemon.protocol",
            "sandfleet.daemon.node.metrics",
            "sandfleet.daemon.errormap",  # the boundary's one table from exceptions to wire codes
            "sandfleet.console",  # the web console's files, served beside the API
            "sandfleet.route_cache",  # which route answers a call, remembered
            *SDK,
        ),
    ),
    (
        "the console is files served to anyone: it knows nothing of the API's code",
        ("sandfleet.console",),
        ("sandfleet", "sandfleet.console"),
    ),
    (
        "the RL adapters and the example tasks are SDK users, like anyone's trainer",
        ("sandfleet.adapters", "sandfleet.rl_demo", "sandfleet.search_demo"),
        ("sandfleet", "sandfleet.adapters", "sandfleet.rl_demo", *SDK),
    ),
    (
        "a cluster gateway reaches nodes over HTTP only: never their service, a backend or the runtime",
        ("sandfleet.cluster", "sandfleet.ray"),
        (
            "sandfleet",
            "sandfleet.cluster",
            "sandfleet.operations",  # the gateway's routes are made from the operations' declarations
            "sandfleet.daemon.security.iam",  # the same projects, tokens and quotas as a node's
            "sandfleet.daemon.config",  # `sandfleet cluster up` reads the node's config
            "sandfleet.images.models",  # image references, as placement compares them
            "sandfleet.console",  # the web console's files, served beside the API
            "sandfleet.collector",  # the garbage collector's policy, as a node's
            "sandfleet.route_cache",  # which route answers a call, as a node's
            *SDK,
        ),
    ),
    (
        "security and the egress policy and proxy know nothing of the node's service",
        ("sandfleet.daemon.security", "sandfleet.daemon.net.policy", "sandfleet.daemon.net.egress"),
        (
            "sandfleet.daemon.security",
            "sandfleet.daemon.net.policy",
            "sandfleet.daemon.net.egress",
            "sandfleet.runtime",
            *SDK,
        ),
    ),
    (
        "the sandbox table is the bottom of the service",
        ("sandfleet.daemon.node.lifecycle",),
        (
            "sandfleet.daemon.node.state",
            "sandfleet.backends.base",
            "sandfleet.runtime.agent_wire",  # record types
            "sandfleet.runtime.agent_exec",
            *SDK,
        ),
    ),
]


@pytest.mark.parametrize(("rule", "covers", "allowed"), RULES, ids=[r[0] for r in RULES])
def test_layering(rule: str, covers: tuple[str, ...], allowed: tuple[str, ...]) -> None:
    bad = sorted(
        f"{mod} -> {dep}" for mod, deps in GRAPH.items() if _in(mod, *covers) for dep in deps if not _in(dep, *allowed)
    )
    assert not bad, f"{rule}: {bad}"


# The node service's concerns, bottom to top: each imports only those before it (docs/architecture.md).
SERVICE_ORDER = [
    "node.lifecycle",
    "node.core",
    "node.pausing",
    "node.monitor",
    "net.sandbox_network",
    "node.image_service",
    "node.builds",
    "node.sandbox_files",
    "node.execs",
    "node.sessions",
    "node.creation",
    "node.stateless_calls",
    "node.snapshots",
    "node.standbys",
    "node.checkpoints",
    "rl.verify",
    "rl.trajectories",
    "node.reaper",
    "node.recovery",
    "node.fencing",
    "service",
]


def test_the_service_concerns_call_down_only() -> None:
    rank = {f"sandfleet.daemon.{m}": i for i, m in enumerate(SERVICE_ORDER)}
    bad = sorted(f"{mod} -> {dep}" for mod, i in rank.items() for dep in GRAPH[mod] if dep in rank and rank[dep] >= i)
    assert not bad, f"a concern imports one at or above its level: {bad}"
    assert GRAPH["sandfleet.daemon.service"] >= {d for d in rank if d != "sandfleet.daemon.service"} - {
        "sandfleet.daemon.node.lifecycle",
        "sandfleet.daemon.node.standbys",  # (the checkpoints' own)
    }


GENERATED = ("sandfleet.client.sync",)  # written by scripts/gen_sync_client.py from client/aio/


def test_no_module_is_over_600_lines() -> None:
    """Small modules, each one concern: none over 600 lines but the generated ones."""
    long = {
        name: n
        for name, path in MODULES.items()
        if not _in(name, *GENERATED) and (n := len(path.read_text().splitlines())) > 600
    }
    assert not long, long


# Packages whose modules are named after the API's resources (sandboxes, files, terminal, ...): the
# routers, the wire models and the SDK's plumbing.
BY_RESOURCE = ("sandfleet.daemon.api", "sandfleet.models", "sandfleet.client._base", "sandfleet.client.aio", *GENERATED)
PER_PACKAGE = {"__init__", "config", "cli", "models", "core", "server"}  # each package may have its own


def test_no_two_modules_share_a_name_with_different_meanings() -> None:
    """A file name means one thing. Besides resource names and per-package roles, the tier folders
    (backends/<tier>/) share one layout: each has its `backend`, and the container and VM tiers their
    `snapshots`, which mean the same thing in each."""
    seen: dict[str, list[str]] = {}
    for name in MODULES:
        if not _in(name, *BY_RESOURCE):
            seen.setdefault(name.rpartition(".")[2], []).append(name)
    twice = {
        k: v
        for k, v in seen.items()
        if k not in PER_PACKAGE and sum(not re.match(r"sandfleet\.backends\.\w+\.", m) for m in v) > 1
    }
    assert not twice, twice


def _importers_of(areas: tuple[str, ...], allowed: tuple[str, ...]) -> list[str]:
    """Edges into `areas` from modules outside `allowed`."""
    return sorted(
        f"{mod} -> {dep}" for mod, deps in GRAPH.items() for dep in deps if _in(dep, *areas) and not _in(mod, *allowed)
    )


def test_only_tests_import_the_testing_helpers() -> None:
    bad = _importers_of(("sandfleet.testing",), ("sandfleet.testing",))
    assert not bad, bad


def test_nothing_imports_the_command_line() -> None:
    cli = ("sandfleet.cli", "sandfleet.cli_common", "sandfleet.cli_images", "sandfleet.cli_e2b")
    bad = _importers_of((*cli, "sandfleet.demo"), ("sandfleet.__main__", *cli))
    assert not bad, bad


def test_the_sdk_imports_with_only_pydantic_httpx_and_httptools() -> None:
    """An SDK-only install (`pip install sandfleet`, without the `node` extra) can use the SDK: every
    other third-party package is made unimportable and the SDK is imported and used in a subprocess."""
    blocked = ["fastapi", "starlette", "uvicorn", "typer", "click", "rich", "prometheus_client"]
    blocker = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"blocked: {{name}}", name=name)
sys.meta_path.insert(0, Block())
"""
    use = f"""
import sandfleet, sandfleet.client.sync, sandfleet.client.aio
from sandfleet import Client, AsyncClient, SandboxSpec, Resources
spec = SandboxSpec(image="busybox", resources=Resources(memory="1GiB"))
assert spec.resources.memory == 1024**3
assert not [m for m in sys.modules if m.split(".")[0] in {blocked!r}]
"""
    r = subprocess.run([sys.executable, "-c", blocker + use], capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == 0, r.stderr
    # The command line says which extra it needs instead of a traceback.
    cli = 'import runpy\nsys.argv = ["sandfleet", "--help"]\nrunpy.run_module("sandfleet", run_name="__main__")\n'
    r = subprocess.run([sys.executable, "-c", blocker + cli], capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == 1 and "pip install 'sandfleet[node]'" in r.stderr, r.stderr


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(SRC)}


def test_the_graph_is_read() -> None:
    """The scan sees real edges (a rule checked against an empty graph would pass for nothing)."""
    assert "sandfleet.daemon.protocol" in GRAPH["sandfleet.daemon.api.common"]
    assert "sandfleet.operations" in GRAPH["sandfleet.cluster.gateway"]
    assert "sandfleet.daemon.node.lifecycle" in GRAPH["sandfleet.daemon.node.core"]
    assert "sandfleet.runtime.sandboxfs.fs" in GRAPH["sandfleet.daemon.node.sandbox_files"]
    assert "sandfleet.client.aio" not in GRAPH["sandfleet.images.recipe_context"]  # under TYPE_CHECKING only
    assert "sandfleet.backends.container.backend" in GRAPH["sandfleet.backends.fncall.backend"]
    assert "sandfleet.backends.vm.qemu" in GRAPH["sandfleet.backends.vm.migration"]
