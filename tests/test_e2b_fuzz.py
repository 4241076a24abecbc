"""Schemathesis against the E2B layer's own OpenAPI document (src/sandfleet/e2b/openapi.json): every
route `sandfleet e2b` serves (the control plane, envd's HTTP routes and unary Connect calls, the code
interpreter's), fuzzed on its own with project A's key, over the node of tests/test_e2b.py.

What must hold, for inputs the document allows and for inputs it forbids (negative mode):
  - no 5xx, but for the edge's documented answer for a sandbox that is not there (or not the key's):
    502 `the sandbox was not found` (envd, interpreter), Connect's `unavailable` (503);
  - the status code is one the document lists, with its content type and a body matching its schema;
  - no answer names project B's sandbox, or holds its secret;
  - afterwards: B's sandbox runs on, its file, metadata and snapshots as they were; nothing of A's
    left running but what this module made; neither the layer nor the daemon logged a traceback.

Bounded: SANDFLEET_E2B_FUZZ_EXAMPLES examples per operation (default 100; the interpreter's and
those that make sandboxes get a third): about 40 s on a 2-core node. Inputs the fuzzer rarely draws
that once were bugs are sent as they are (test_edge_inputs_are_4xx). Path parameters and the
E2b-Sandbox-Id header are, half the time, A's real sandbox (made again when fuzzing kills it,
resumed when it pauses it); sandboxes the fuzzer makes are killed once 10 s old, and forks are of
at most 2.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
e2b = pytest.importorskip("e2b")

from e2b import Sandbox  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

import sandfleet.e2b  # noqa: E402
import test_e2b  # noqa: E402

pytestmark = pytest.mark.fuzz

KEYS = test_e2b.KEYS
Node = test_e2b.Node
node = test_e2b.node  # the same module-scoped fixture: a daemon of its own with projects A and B, the layer

SPEC = Path(sandfleet.e2b.__file__).with_name("openapi.json")
MAX_EXAMPLES = int(os.environ.get("SANDFLEET_E2B_FUZZ_EXAMPLES", "100"))
FEW_EXAMPLES = max(1, MAX_EXAMPLES // 3)
FUZZ_SANDBOX_AGE = 10.0  # seconds before a sandbox the fuzzer made is killed
MAX_FORK = 2
AUTH = {"X-API-Key": KEYS["a"], "X-Access-Token": KEYS["a"]}
SECRET = "b's secret, never to be read by a"
HYPOTHESIS = {
    "deadline": None,
    "database": None,  # no .hypothesis/ in the tree; a failure prints its minimal example and a curl line
    "suppress_health_check": list(HealthCheck),
}

SCHEMA = schemathesis.openapi.from_path(SPEC)
# Kernels (a python3 each) and sandboxes (creates, forks, resumes, snapshots): fewer examples.
HEAVY = r"^/execute$|^/contexts|^(/v2)?/sandboxes$|/fork$|/snapshots$|/resume$|/connect$|/pause$"


# -- checks -----------------------------------------------------------------------------------------


def _edge_not_found(response: Any, case: Any) -> bool:
    """The edge's answer for a sandbox that is not there, not the key's, or not running: 502 from
    envd's and the interpreter's routes, Connect's `unavailable` (503), `the sandbox was not found`."""
    text = response.text or ""
    if "the sandbox was not found" not in text:
        return False
    if response.status_code == 502:
        return not case.path.startswith(("/process.", "/filesystem."))
    return response.status_code == 503 and case.path.startswith(("/process.", "/filesystem."))


@schemathesis.check
def no_server_error(ctx: Any, response: Any, case: Any) -> bool | None:
    """`not_a_server_error`, but for the edge's documented not-found answer."""
    if _edge_not_found(response, case):
        return None
    return not_a_server_error(ctx, response, case)  # type: ignore[no-any-return]


@schemathesis.check
def nothing_of_project_b(ctx: Any, response: Any, case: Any) -> bool | None:
    """No answer to A's key names B's sandbox or holds what B wrote."""
    assert POOL is not None
    text = response.content.decode(errors="replace") if response.content else ""
    assert POOL.b_id not in text, f"B's sandbox {POOL.b_id} in an answer to A's key"
    assert SECRET not in text, "B's secret in an answer to A's key"
    return None


CHECKS = [
    no_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    nothing_of_project_b,
]


# -- A's real sandbox for path parameters and E2b-Sandbox-Id ----------------------------------------


class SeedPool:
    """A's sandbox the fuzzer is pointed at half the time (made again when killed, resumed when
    paused), B's the fuzzer must never reach, and the fuzzer's own sandboxes killed once
    FUZZ_SANDBOX_AGE old; checked at most once a second."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.http = httpx.Client(base_url=node.url, headers=AUTH, timeout=120)
        self.lock = threading.Lock()
        self.checked = 0.0
        self.a_id = ""
        self.made: set[str] = set()  # every sandbox of A's this module made itself
        b = Sandbox.create("base", timeout=900, metadata={"owner": "b"}, **node.opts("b"))
        b.files.write("/tmp/secret", SECRET)
        self.b_id = b.sandbox_id
        self.b_tmp = sorted(e.name for e in b.files.list("/tmp"))
        self.b_snapshots = self.snapshots("b")
        self.seed()

    def seed(self) -> None:
        sbx = Sandbox.create("base", timeout=900, metadata={"fuzz": "seed"}, **self.node.opts())
        self.a_id = sbx.sandbox_id
        self.made.add(self.a_id)

    def snapshots(self, who: str) -> list[str]:
        listed = httpx.get(f"{self.node.url}/snapshots?limit=1000", headers={"x-api-key": KEYS[who]}, timeout=60)
        assert listed.status_code == 200, listed.text
        return sorted(s["snapshotID"] for s in listed.json())

    def live(self) -> list[dict[str, Any]]:
        listed = self.http.get("/v2/sandboxes", params={"limit": 1000})
        assert listed.status_code == 200, listed.text
        return list(listed.json())

    def refresh(self) -> str:
        with self.lock:
            if time.monotonic() - self.checked < 1.0:
                return self.a_id
            self.checked = time.monotonic()
            seed = None
            for sb in self.live():
                if sb["sandboxID"] == self.a_id:
                    seed = sb
                    continue
                started = time.time() - _unix(sb["startedAt"])
                if sb["sandboxID"] not in self.made and started > FUZZ_SANDBOX_AGE:
                    self.http.delete(f"/sandboxes/{sb['sandboxID']}")
            if seed is None:
                self.seed()
            elif seed["state"] == "paused" or _unix(seed["endAt"]) - time.time() < 120:
                self.http.post(f"/sandboxes/{self.a_id}/connect", json={"timeout": 900})
            return self.a_id


def _unix(rfc3339: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


POOL: SeedPool | None = None


@SCHEMA.hook
def flatmap_path_parameters(context: Any, path_parameters: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """The generated values, or A's real sandbox for sandboxID."""
    if POOL is None or not path_parameters or "sandboxID" not in path_parameters:
        return st.just(path_parameters)
    pool = POOL

    def real(_: bool) -> dict[str, Any]:
        # Looked up when drawn: what Hypothesis draws never depends on the pool's state.
        return {**path_parameters, "sandboxID": pool.refresh()}

    return st.one_of(st.just(path_parameters), st.just(True).map(real))


@SCHEMA.hook
def flatmap_headers(context: Any, headers: dict[str, Any] | None) -> st.SearchStrategy[dict[str, Any] | None]:
    """The generated E2b-Sandbox-Id, or A's real sandbox."""
    if POOL is None or not headers or "E2b-Sandbox-Id" not in headers:
        return st.just(headers)
    pool = POOL

    def real(_: bool) -> dict[str, Any]:
        return {**headers, "E2b-Sandbox-Id": pool.refresh()}

    return st.one_of(st.just(headers), st.just(True).map(real))


def _bound(case: Any) -> None:
    """Forks of at most MAX_FORK (each a sandbox, 64 allowed)."""
    if isinstance(case.body, dict) and case.path.endswith("/fork"):
        count = case.body.get("count")
        if isinstance(count, int) and not isinstance(count, bool) and count > MAX_FORK:
            case.body["count"] = MAX_FORK


# -- the fixture ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool(node: Node) -> Iterator[SeedPool]:
    global POOL
    POOL = SeedPool(node)
    try:
        yield POOL
    finally:
        p, POOL = POOL, None
        for sb in p.live():
            p.http.delete(f"/sandboxes/{sb['sandboxID']}")
        for snap in p.snapshots("a"):
            p.http.delete(f"/templates/{snap}")
        httpx.delete(f"{node.url}/sandboxes/{p.b_id}", headers={"x-api-key": KEYS["b"]}, timeout=60)
        p.http.close()


# -- the tests --------------------------------------------------------------------------------------


def _run(case: Any, pool: SeedPool) -> None:
    _bound(case)
    response = case.call(base_url=pool.node.url, headers=AUTH, timeout=60)
    case.validate_response(response, checks=CHECKS, headers=AUTH, transport_kwargs={"base_url": pool.node.url})


@SCHEMA.exclude(path_regex=HEAVY).parametrize()
@settings(max_examples=MAX_EXAMPLES, **HYPOTHESIS)
def test_stateless(case: Any, pool: SeedPool) -> None:
    _run(case, pool)


@SCHEMA.include(path_regex=HEAVY).parametrize()
@settings(max_examples=FEW_EXAMPLES, **HYPOTHESIS)
def test_stateless_heavy(case: Any, pool: SeedPool) -> None:
    _run(case, pool)


BIG = 10**400  # past a float's range
# Inputs the fuzzer rarely draws, each a 500 it found once: a typed 4xx now.
EDGE_CASES = [
    # a timeout past a float's range (`time.time() + seconds` overflowed)
    ("POST", "/sandboxes/{a}/timeout", {"json": {"timeout": BIG}}, "huge-timeout"),
    ("POST", "/sandboxes/{a}/refreshes", {"json": {"duration": BIG}}, "huge-timeout"),
    ("POST", "/sandboxes/{a}/connect", {"json": {"timeout": BIG}}, "huge-timeout"),
    # (a fork was made first, then its timeout failed: the copy was left running, its id never answered)
    ("POST", "/sandboxes/{a}/fork", {"json": {"timeout": BIG}}, "huge-timeout"),
    # a non-ASCII digit: "²".isdigit() is true, int("²") raises
    ("GET", "/sandboxes/{a}/metrics", {"params": {"start": "\u00b2"}}, "query-digits"),
    ("GET", "/v2/sandboxes", {"params": {"limit": "\u00b2"}}, "query-digits"),
    ("GET", "/snapshots", {"params": {"nextToken": "\u00b2"}}, "query-digits"),
    # the interpreter's fields of another type than a string
    ("POST", "/execute", {"json": {"code": "1", "language": [1]}}, "interpreter-types"),
    ("POST", "/execute", {"json": {"code": "1", "context_id": 5}}, "interpreter-types"),
    ("POST", "/contexts", {"json": {"language": {}}}, "interpreter-types"),
    # a Connect JSON body protobuf cannot parse (a list; a oneof's two fields)
    ("POST", "/filesystem.Filesystem/Stat", {"json": [None]}, "connect-parse"),
    ("POST", "/process.Process/SendSignal", {"json": {"process": {"pid": 1, "tag": "x"}}}, "connect-parse"),
    # a multipart body without its parts (Starlette's own text/plain 400, not envd's {code, message})
    (
        "POST",
        "/files",
        {
            "params": {"path": "x"},
            "content": b"--b\r\nx--b--\r\n",
            "headers": {"content-type": "multipart/form-data; boundary=b"},
        },
        "multipart",
    ),
]


@pytest.mark.parametrize(
    ("method", "path", "request_kw", "bug"),
    [pytest.param(*c, id=f"{c[0]} {c[1]} {c[3]}") for c in EDGE_CASES],  # fmt: skip
)
def test_edge_inputs_are_4xx(method: str, path: str, request_kw: dict[str, Any], bug: str, pool: SeedPool) -> None:
    a_id = pool.refresh()
    kw = dict(request_kw)
    headers = {**AUTH, "E2b-Sandbox-Id": a_id, **kw.pop("headers", {})}
    if "json" in kw:  # 10**400 is valid JSON, not a value httpx's encoder takes
        kw["content"] = json.dumps(kw.pop("json")).encode()
        headers["content-type"] = "application/json"
    r = httpx.request(method, pool.node.url + path.format(a=a_id), headers=headers, timeout=60, **kw)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    if path in ("/execute", "/contexts"):
        assert r.headers["content-type"].startswith("text/plain")
    elif path.startswith(("/process.", "/filesystem.")):
        assert r.json()["code"] == "invalid_argument"
    else:
        assert set(r.json()) == {"code", "message"} and r.json()["code"] == r.status_code


def test_project_b_untouched_and_nothing_left(pool: SeedPool, node: Node) -> None:
    """After the fuzzing: B's sandbox runs on as it was (file, metadata, snapshots); A's sandboxes the
    fuzzer made are killed (all but this module's own seed), and none is left running; no traceback."""
    b = Sandbox.connect(pool.b_id, **node.opts("b"))
    info = Sandbox.get_info(pool.b_id, **node.opts("b"))
    assert info.state.value == "running" and info.metadata == {"owner": "b"}
    assert b.files.read("/tmp/secret") == SECRET
    assert sorted(e.name for e in b.files.list("/tmp")) == pool.b_tmp
    assert pool.snapshots("b") == pool.b_snapshots
    assert pool.b_id not in {s["sandboxID"] for s in pool.live()}
    for sb in pool.live():
        if sb["sandboxID"] not in pool.made:
            assert Sandbox.kill(sb["sandboxID"], **node.opts())
    assert {s["sandboxID"] for s in pool.live()} <= pool.made
    for sandbox_id in pool.made:
        Sandbox.kill(sandbox_id, **node.opts())
    assert not pool.live()
    layer = node.layer_log.read_text(errors="replace")
    assert "Traceback" not in layer, layer[max(0, layer.index("Traceback") - 300) :][:3000]
    log = node.daemon.log()
    assert "Traceback" not in log, log[max(0, log.index("Traceback") - 300) :][:3000]
