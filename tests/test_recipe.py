"""Environment recipes: parsing, host-side steps (copy, git) and their cache, and the steps that
run in build sandboxes of a real daemon (run, pip; apt is host-side but slow)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tarfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sandfleet import AsyncClient, Client
from sandfleet.images import LayerStore, recipe_tree, rootfs_probe
from sandfleet.images.builders import mounted_layers
from sandfleet.images.recipe import CopyStep, GitStep, PipStep, Recipe, RecipeError, RunStep
from sandfleet.images.recipe_build import build_recipe, prune_build_cache
from sandfleet.images.recipe_context import BuildResult, StepResult
from sandfleet.images.recipe_sandbox import BUILD_LABEL
from sandfleet.images.recipe_tree import hash_tree, stage_copy
from sandfleet.images.rootfs_probe import glibc_version_in, read_debian_info
from wheels import pure_wheel

from conftest import IMAGES, Daemon, wait_until

DATA = Path(__file__).parent / "data" / "recipes"

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="layers are chowned and mounted: needs root")


# --------------------------------------------------------------------------- helpers


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env).stdout


def _make_repo(path: Path) -> str:
    """A repo with tag v1 (README 'v1') and a later commit on the branch (README 'v2'); v1's sha."""
    path.mkdir()
    _git(path, "init", "-q")
    (path / "README").write_text("v1\n")
    _git(path, "add", ".")
    _git(path, "commit", "-qm", "one")
    _git(path, "tag", "v1")
    sha = _git(path, "rev-parse", "HEAD").strip()
    (path / "README").write_text("v2\n")
    _git(path, "commit", "-qam", "two")
    return sha


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.chmod(path, mode)


def _hits(result: BuildResult) -> list[bool]:
    return [s.cache_hit for s in result.steps[1:]]


def _sdist(where: Path, name: str, marker: Path) -> Path:
    """An sdist of ``name`` 1.0 whose in-tree build backend creates ``marker`` when anything runs it
    (no build requirements: nothing to fetch, so nothing but a refusal stops it)."""
    tree = where / f"{name}-1.0"
    _write(
        tree / "pyproject.toml",
        '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n',
    )
    _write(tree / "backend.py", f"open({str(marker)!r}, 'w').close()\n")
    path = where / f"{name}-1.0.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        tar.add(tree, arcname=tree.name)
    return path


# --------------------------------------------------------------------------- parsing


def test_parse_the_sample_recipe() -> None:
    r = Recipe.load(DATA / "example.toml")
    assert r.ref == "envs/django:1" and r.base == "debian:bookworm"
    assert [type(s).__name__ for s in r.steps] == ["AptStep", "PipStep", "CopyStep", "GitStep", "RunStep"]
    assert r.base_dir == DATA.resolve() and "make -C" in r.source
    copy, git, run = r.steps[2], r.steps[3], r.steps[4]
    assert isinstance(copy, CopyStep) and copy.name == "toolkit/harness:3.1" and copy.spec.dest == "/opt/harness"
    assert isinstance(git, GitStep) and git.git.rev == "abc123" and not git.git.keep_git
    assert isinstance(run, RunStep) and run.env == {"K": "V"} and run.cwd is None
    assert r.env == {"DJANGO_SETTINGS_MODULE": "app.settings"} and r.workdir == "/work/repo"
    assert Recipe.parse('ref = "x"\nbase = { mmdebstrap = { packages = ["jq"] } }').ref == "x:latest"


HEAD = 'ref = "a:1"\nbase = "busybox"\n'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (HEAD + 'from = "x"\n', "unknown key 'from'"),
        (HEAD + '[[step]]\napt = ["jq"]\nrun = "ls"\n', r"step 1 has several kinds \(apt, run\)"),
        (HEAD + '[[step]]\nrun = "ls"\n[[step]]\nname = "x:1"\n', "step 2 has no kind"),
        (HEAD + '[[step]]\ncopy = { src = "x", dest = "/x" }\nenv = {}\n', r"step 1 \(copy\): unknown key 'env'"),
        (
            HEAD + '[[step]]\ngit = { url = "u", dest = "/x", branch = "m" }\n',
            r"step 1 \(git\): unknown key 'git.branch'",
        ),
        (HEAD + '[[step]]\ncopy = { src = "x", dest = "rel" }\n', r"step 1 \(copy\): copy.dest: dest must be absolute"),
        (HEAD + '[[step]]\nrun = "ls"\nname = "UPPER:1"\n', r"step 1 \(run\): name: invalid"),
        (HEAD + '[[step]]\npip = ["--index-url=http://x"]\n', "options are not allowed"),
        # Only wheels: anything pip would build (running its code on the host) is refused early.
        (HEAD + '[[step]]\npip = ["x @ https://e.invalid/x-1.0.tar.gz"]\n', r"must be an http\(s\) URL of a \.whl"),
        (HEAD + '[[step]]\npip = ["x @ file:///tmp/x-1.0-py3-none-any.whl"]\n', r"http\(s\) URL of a \.whl"),
        (HEAD + '[[step]]\npip = ["./src"]\n', "give a project name.*wheels only.*run step"),
        (HEAD + '[[step]]\npip = ["/tmp/x-1.0.tar.gz"]\n', "give a project name"),
        (HEAD + '[[step]]\npip = ["x-1.0.tar.gz"]\n', "give a project name"),
        (HEAD + '[[step]]\npip = ["git+https://e.invalid/x"]\n', "expected a version spec"),
        (HEAD + '[[step]]\npip = ["x==1 @ https://e.invalid/x.whl"]\n', "expected a version spec"),
        (HEAD + '[[step]]\npip = ["six --index-url=http://x"]\n', "expected a version spec"),
        # The daemon's own validators (sandfleet.models), so the image's defaults are usable.
        (HEAD + 'workdir = "/a\\u0000b"\n', r"workdir: path must be absolute.* no NUL byte"),
        (HEAD + 'workdir = "rel"\n', "workdir: path must be absolute"),
        (HEAD + 'user = "Bad User"\n', "user: invalid user 'Bad User'"),
        (HEAD + 'env = { "1X" = "v" }\n', "env: invalid environment variable name '1X'"),
        (HEAD + '[[step]]\nrun = "ls"\nenv = { A = "\\u0000" }\n', r"step 1 \(run\): env: .* contains a NUL byte"),
        (HEAD + '[[step]]\nrun = "ls"\ncwd = "/a\\u0000"\n', r"step 1 \(run\): cwd: path must be absolute"),
        (HEAD + '[[step]]\napt = ["jq\\n"]\n', "invalid Debian package name"),
        (HEAD + '[[step]]\napt = ["jq,evil"]\n', r"step 1 \(apt\): apt: invalid Debian package name 'jq,evil'"),
        ('ref = "Not A Ref!"\nbase = "busybox"\n', "ref: invalid image name"),
        ('ref = "a:1"\nbase = "busybox:bad tag"\n', "base: invalid image tag"),
        ('ref = "a:1"\nbase = { mmdebstrap = { pkgs = [] } }\n', "unknown key 'base.mmdebstrap.pkgs'"),
        ('ref = "a:1"\n', "base: Field required"),
        ('ref = "a:1"\nbase = [\n', "not valid TOML"),
    ],
)
def test_parse_errors_are_clear(text: str, message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        Recipe.parse(text)


def test_pip_requirements_that_resolve_to_wheels_are_accepted() -> None:
    reqs = [
        "six==1.16.0",
        " requests[socks] >= 2.0 ; python_version > '3.8'",
        "x @ https://e.invalid/wheels/x-1.0-py3-none-any.whl#sha256=00",
        "x @ https://e.invalid/x-1.0-py3-none-any.whl ; sys_platform == 'linux'",
    ]
    step = Recipe.parse(HEAD + f"[[step]]\npip = {json.dumps(reqs)}\n").steps[0]
    assert isinstance(step, PipStep) and len(step.pip) == 4


# --------------------------------------------------------------------------- host-side helpers


def _debian_root(root: Path, codename: str, packages: list[str]) -> Path:
    _write(root / "etc/os-release", f'ID=debian\nVERSION_CODENAME="{codename}"\n')
    paras = [f"Package: {p}\nStatus: install ok installed\nArchitecture: amd64\n" for p in packages]
    _write(root / "var/lib/dpkg/status", "\n".join(paras))
    return root


def test_debian_info_from_the_stack_must_be_plain_names(tmp_path: Path) -> None:
    # The stack may be an imported image: its dpkg status and os-release end up in mmdebstrap's
    # argv, where "--include=a,b" adds packages and a "suite" may be an option.
    info = read_debian_info(_debian_root(tmp_path / "ok", "bookworm", ["jq", "libc6"]), "amd64")
    assert info is not None and (info.suite, info.packages) == ("bookworm", ["jq", "libc6"])
    for n, bad in enumerate(["jq,evil", "/tmp/evil.deb", "jq=1.0", "-x", "jq\tx"]):
        with pytest.raises(RecipeError, match="dpkg/status lists an invalid package"):
            read_debian_info(_debian_root(tmp_path / f"bad{n}", "bookworm", ["jq", bad]), "amd64")
    with pytest.raises(RecipeError, match="invalid VERSION_CODENAME '--setup-hook=x'"):
        read_debian_info(_debian_root(tmp_path / "suite", "--setup-hook=x", ["jq"]), "amd64")


def test_glibc_version_is_read_inside_the_image(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _write(
        root / "usr/lib/aarch64-linux-gnu/libc.so.6",
        "\0junk GNU C Library (Debian GLIBC 2.31-13) stable release version 2.31.\n",
    )
    os.symlink("usr/lib", root / "lib")
    assert glibc_version_in(root) == (2, 31)
    # An absolute link is the image's, not the host's: nothing is found through it.
    other = tmp_path / "other"
    (other / "usr").mkdir(parents=True)
    os.symlink("/usr/lib", other / "usr/lib")
    assert glibc_version_in(other) is None
    tags = rootfs_probe._manylinux_platforms((2, 17), "x86_64")
    assert tags[:2] == ["manylinux_2_17_x86_64", "manylinux2014_x86_64"] and tags[-1] == "manylinux1_x86_64"


@needs_root
def test_copy_source_edited_while_copying_is_keyed_by_what_was_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "recipe/tree"
    _write(src / "a", "old\n")
    _write(src / "b", "b\n", 0o755)
    real_read = os.read

    def edit_after_reading(fd: int, n: int) -> bytes:
        data = real_read(fd, n)
        if data == b"old\n":
            (src / "a").write_text("new\n")  # the edit lands after the copy read the file
        return data

    monkeypatch.setattr(recipe_tree.os, "read", edit_after_reading)
    staging = tmp_path / "staging"
    n, digest = stage_copy(tmp_path / "recipe", "tree", staging, "/opt/t", [])
    monkeypatch.undo()
    assert n == 3 and (staging / "opt/t/a").read_text() == "old\n"
    assert digest == hash_tree(staging / "opt/t", []) != hash_tree(src, [])


@needs_root
def test_copy_walk_does_not_follow_a_directory_swapped_for_a_symlink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = tmp_path / "recipe"
    _write(base / "tree/sub/f", "f\n")
    _write(tmp_path / "secret/id_rsa", "key\n")
    real_open = os.open

    def swap_then_open(path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if path == "sub" and dir_fd is not None:  # after the walk saw a directory there
            os.rename(base / "tree/sub", base / "sub.old")
            os.symlink(tmp_path / "secret", base / "tree/sub")
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(recipe_tree.os, "open", swap_then_open)
    with pytest.raises(OSError, match="Not a directory"):  # O_DIRECTORY | O_NOFOLLOW on a symlink
        stage_copy(base, "tree", tmp_path / "staging", "/t", [])
    monkeypatch.undo()
    assert not (tmp_path / "staging/t/sub/id_rsa").exists()


# --------------------------------------------------------------------------- host-side steps


@needs_root
async def test_copy_and_git_layers_are_cached_independently_of_the_stack_below(tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store")
    src = tmp_path / "src"
    _write(src / "harness/bin/tool", "#!/bin/sh\necho tool v1\n", 0o755)
    _write(src / "harness/__pycache__/junk.pyc", "junk")
    os.symlink("bin/tool", src / "harness/tool")
    os.chown(src / "harness/bin/tool", 1234, 1234)  # a host user's file: root's inside the image
    _write(src / "app.conf", "debug = false\n")
    v1 = _make_repo(tmp_path / "repo")
    (src / "r.toml").write_text(
        'ref = "test-recipe/host:1"\nbase = "busybox"\n'
        '[[step]]\ncopy = { src = "harness", dest = "/opt/harness", exclude = ["__pycache__"] }\n'
        'name = "test-recipe/harness:1"\n'
        '[[step]]\ngit = { url = "../repo", rev = "v1", dest = "/work/repo" }\n'
        '[[step]]\ncopy = { src = "app.conf", dest = "/etc/app/app.conf" }\n'
    )
    recipe = Recipe.load(src / "r.toml")
    seen: list[tuple[str, float]] = []
    first = await build_recipe(recipe, store, progress=lambda stage, frac: seen.append((stage, frac)))
    assert _hits(first) == [False, False, False]
    assert [s.kind for s in first.steps] == ["base", "copy", "git", "copy"]
    assert [x.digest for x in first.manifest.layers] == [s.layer for s in first.steps]
    assert seen and seen[-1][1] == 1.0 and all(a[1] <= b[1] for a, b in zip(seen, seen[1:], strict=False))
    assert v1 in first.steps[2].description
    named = store.resolve("test-recipe/harness:1")
    assert [x.digest for x in named.layers] == [first.steps[1].layer]

    async with mounted_layers(store.layer_paths(first.manifest), tmp_path / "mnt") as root:
        assert (root / "opt/harness/bin/tool").read_text() == "#!/bin/sh\necho tool v1\n"
        st = os.lstat(root / "opt/harness/bin/tool")
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (store.uid_base, store.uid_base, 0o755)
        assert os.readlink(root / "opt/harness/tool") == "bin/tool"
        assert not (root / "opt/harness/__pycache__").exists()
        assert (root / "work/repo/README").read_text() == "v1\n"  # the tag, not the branch tip
        assert not (root / "work/repo/.git").exists()
        assert (root / "etc/app/app.conf").read_text() == "debug = false\n"
        assert (root / "bin/busybox").exists() and os.stat(root / "tmp").st_mode & 0o7777 == 0o1777

    second = await build_recipe(recipe, store)
    assert _hits(second) == [True, True, True]
    assert second.manifest.layers == first.manifest.layers

    # A change in the lower copy rebuilds it only: the git and copy layers above don't depend on it.
    _write(src / "harness/bin/tool", "#!/bin/sh\necho tool v2\n", 0o755)
    third = await build_recipe(recipe, store)
    assert _hits(third) == [False, True, True]
    assert third.manifest.layers[1] != first.manifest.layers[1]
    assert third.manifest.layers[2:] == first.manifest.layers[2:]
    assert third.steps[1].name == "test-recipe/harness:1"
    assert store.resolve("test-recipe/harness:1").layers[0].digest == third.steps[1].layer

    # A cache entry whose layer file is gone (GC'd) is a miss, and the layer is made again.
    store.layer_path(third.steps[3].layer).unlink()
    assert prune_build_cache(store) == 1
    fourth = await build_recipe(recipe, store)
    assert _hits(fourth) == [True, True, False]
    assert store.layer_path(fourth.steps[3].layer).exists()
    assert not list(store.tmp_dir.iterdir())  # scratch dirs removed


@needs_root
async def test_host_side_errors_name_the_step(tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store")

    async def fails(text: str, match: str) -> None:
        with pytest.raises(RecipeError, match=match):
            await build_recipe(Recipe.parse('ref = "test-recipe/err:1"\nbase = "busybox"\n' + text, tmp_path), store)

    await fails(
        '[[step]]\ncopy = { src = "missing", dest = "/x" }\n', r"step 1 \(copy\): source .*missing does not exist"
    )
    await fails('[[step]]\napt = ["jq"]\n', r"step 1 \(apt\): the stack below is not Debian-based")
    await fails('[[step]]\npip = ["six"]\n', r"step 1 \(pip\): no python3 in the stack below")
    await fails('[[step]]\nrun = "true"\n', r"step 1 \(run\): needs a running daemon")
    await fails('[[step]]\ngit = { url = "nope", dest = "/x" }\n', r"step 1 \(git\): git ls-remote failed")
    # Copy sources stay inside the recipe's directory, symlinks resolved.
    (tmp_path / "inside").mkdir()
    os.symlink("/root", tmp_path / "inside/home")
    os.symlink("/etc/hostname", tmp_path / "hostname")
    outside = r"step 1 \(copy\): source .* is .*, outside the recipe's directory"
    for src in ["/etc/hostname", "../..", "inside/../..", "inside/home", "inside/home/.ssh", "hostname"]:
        await fails(f'[[step]]\ncopy = {{ src = "{src}", dest = "/x" }}\n', outside)
    with pytest.raises(RecipeError, match="base: image nonexistent:1 not found"):
        await build_recipe(Recipe.parse('ref = "a:1"\nbase = "nonexistent:1"\n'), store)
    assert not store.has_image("test-recipe/err:1")


# --------------------------------------------------------------------------- with the daemon


@pytest.fixture
def store(daemon: Daemon) -> LayerStore:
    return LayerStore(IMAGES)  # the daemon's store: build sandboxes pack into it


@pytest.fixture
def factory(daemon: Daemon) -> Callable[[], AsyncClient]:
    return lambda: AsyncClient(daemon.socket)


@pytest.fixture
def cleanup_images(store: LayerStore) -> Iterator[list[str]]:
    refs: list[str] = []
    yield refs
    for ref in refs:
        if store.has_image(ref):
            store.remove_image(ref)


async def test_run_step_packs_the_build_sandbox_and_depends_on_the_stack_below(
    tmp_path: Path, store: LayerStore, fleet: Client, factory: Callable[[], AsyncClient], cleanup_images: list[str]
) -> None:
    ref, harness_ref = "test-recipe/run:1", "test-recipe/run-harness:1"
    cleanup_images += [ref, harness_ref]
    # A unique marker keeps the shared store's build cache from answering for this run.
    _write(tmp_path / "harness/install.sh", f"echo installed {uuid.uuid4().hex} > /usr/local/share/marker\n")
    (tmp_path / "r.toml").write_text(
        f'ref = "{ref}"\nbase = "busybox"\nenv = {{ STAGE = "prod" }}\n'
        f'[[step]]\ncopy = {{ src = "harness", dest = "/opt/harness" }}\nname = "{harness_ref}"\n'
        '[[step]]\nrun = "mkdir -p /usr/local/share && sh /opt/harness/install.sh && echo $STAGE-$MODE > /etc/mode'
        ' && mkdir -p /root/.cache && echo junk > /root/.cache/x"\n'
        'env = { MODE = "fast" }\nexclude = ["/root/.cache"]\n'
    )
    recipe = Recipe.load(tmp_path / "r.toml")
    first = await build_recipe(recipe, store, client_factory=factory)
    assert _hits(first) == [False, False]
    marker = (tmp_path / "harness/install.sh").read_text().split()[2]
    with fleet.create(image=ref) as sb:
        assert sb.exec("cat /usr/local/share/marker /etc/mode").stdout == f"installed {marker}\nprod-fast\n"
        assert sb.exec("test -e /root/.cache/x").exit_code == 1  # excluded from the layer
        assert sb.exec("ls -ln /etc/mode").stdout.split()[2] == "0"
        assert sb.exec("echo $STAGE").stdout == "prod\n"  # the recipe's env is the image's default
    # The named step is an image of its own: one layer, stackable over another image.
    assert [x.digest for x in store.resolve(harness_ref).layers] == [first.steps[1].layer]
    with fleet.create(image="busybox", layers=[harness_ref]) as sb:
        assert sb.exec("test -f /opt/harness/install.sh").exit_code == 0
        assert sb.exec("test -e /usr/local/share/marker").exit_code == 1
    assert not [i for i in fleet.images() if i.name.startswith("sandfleet-build/")]  # temporary pack refs

    again = await build_recipe(recipe, store, client_factory=None)  # all cached: no daemon needed
    assert _hits(again) == [True, True] and again.manifest.layers == first.manifest.layers

    # The run step sits on the copy layer: changing the copied file rebuilds both.
    changed = uuid.uuid4().hex
    _write(tmp_path / "harness/install.sh", f"echo {changed} > /usr/local/share/marker\n")
    third = await build_recipe(recipe, store, client_factory=factory)
    assert _hits(third) == [False, False]
    with fleet.create(image=ref) as sb:
        assert sb.exec("cat /usr/local/share/marker").stdout == f"{changed}\n"
    assert fleet.list(labels={BUILD_LABEL: ref}, state="running") == []


async def test_a_layer_made_twice_stays_where_it_first_is(
    tmp_path: Path, store: LayerStore, fleet: Client, factory: Callable[[], AsyncClient], cleanup_images: list[str]
) -> None:
    # The second copy makes the same layer as the first; an overlay cannot stack it twice, and the
    # daemon keeps a layer named twice at its first position, so the recipe does too.
    ref = "test-recipe/twice:1"
    cleanup_images.append(ref)
    _write(tmp_path / "f", uuid.uuid4().hex)
    recipe = Recipe.parse(
        f'ref = "{ref}"\nbase = "busybox"\n'
        '[[step]]\ncopy = { src = "f", dest = "/etc/f" }\n'
        '[[step]]\ncopy = { src = "f", dest = "/etc/f" }\n'
        '[[step]]\nrun = "cat /etc/f > /etc/g"\n',
        tmp_path,
    )
    result = await build_recipe(recipe, store, client_factory=factory)
    assert _hits(result) == [False, True, False] and result.steps[1].layer == result.steps[2].layer
    layers = [x.digest for x in result.manifest.layers]
    assert layers == [result.steps[i].layer for i in (0, 1, 3)]
    with fleet.create(image=ref) as sb:
        assert sb.exec("cat /etc/g").stdout == (tmp_path / "f").read_text()


async def test_failing_or_cancelled_run_step_leaves_no_sandbox(
    tmp_path: Path, store: LayerStore, fleet: Client, factory: Callable[[], AsyncClient]
) -> None:
    ref = "test-recipe/fail:1"
    nonce = uuid.uuid4().hex
    failing = Recipe.parse(
        f'ref = "{ref}"\nbase = "busybox"\n[[step]]\nrun = "echo {nonce}; echo it broke >&2; exit 2"\n', tmp_path
    )
    with pytest.raises(RecipeError, match=r"step 1 \(run\): command exited 2: it broke"):
        await build_recipe(failing, store, client_factory=factory)
    assert fleet.list(labels={BUILD_LABEL: ref}, state="running") == []
    assert not store.has_image(ref)

    slow = Recipe.parse(f'ref = "{ref}"\nbase = "busybox"\n[[step]]\nrun = "sleep 60 # {nonce}"\n', tmp_path)
    task = asyncio.create_task(build_recipe(slow, store, client_factory=factory))
    running = await asyncio.to_thread(wait_until, lambda: fleet.list(labels={BUILD_LABEL: ref}, state="running"), 30)
    assert running
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fleet.list(labels={BUILD_LABEL: ref}, state="running") == []
    assert not store.has_image(ref)


async def test_run_steps_may_create_the_workdir(
    tmp_path: Path, store: LayerStore, fleet: Client, factory: Callable[[], AsyncClient], cleanup_images: list[str]
) -> None:
    # The workdir is the cwd of run steps once it exists; before that they run in /, so the step
    # that makes it (a clone, a mkdir) works. Nothing is created for them.
    ref = "test-recipe/workdir:1"
    cleanup_images.append(ref)
    nonce = uuid.uuid4().hex
    recipe = Recipe.parse(
        f'ref = "{ref}"\nbase = "busybox"\nworkdir = "/work/repo"\n'
        f'[[step]]\nrun = "pwd > /first-cwd && mkdir -p /work/repo && echo {nonce} > /work/repo/made"\n'
        '[[step]]\nrun = "pwd > /second-cwd && cat made > copied"\n',
        tmp_path,
    )
    result = await build_recipe(recipe, store, client_factory=factory)
    assert _hits(result) == [False, False] and result.manifest.workdir == "/work/repo"
    with fleet.create(image=ref) as sb:
        assert sb.exec("cat /first-cwd /second-cwd /work/repo/copied").stdout == f"/\n/work/repo\n{nonce}\n"
        assert sb.exec("pwd").stdout == "/work/repo\n"  # the image's sandboxes start there
    # An explicit cwd must exist: it is the step's own choice, not a default.
    explicit = Recipe.parse(
        f'ref = "{ref}-x"\nbase = "busybox"\n[[step]]\nrun = "mkdir -p /opt/x # {nonce}"\ncwd = "/opt/x"\n', tmp_path
    )
    with pytest.raises(RecipeError, match=r"step 1 \(run\)"):
        await build_recipe(explicit, store, client_factory=factory)


async def test_build_reports_each_step_and_streams_run_output(
    tmp_path: Path, store: LayerStore, factory: Callable[[], AsyncClient], cleanup_images: list[str]
) -> None:
    ref = "test-recipe/report:1"
    cleanup_images.append(ref)
    nonce = uuid.uuid4().hex
    _write(tmp_path / "f", nonce)
    recipe = Recipe.parse(
        f'ref = "{ref}"\nbase = "busybox"\n'
        '[[step]]\ncopy = { src = "f", dest = "/etc/f" }\n'
        f"[[step]]\nrun = \"echo out-{nonce}; echo err-{nonce} >&2; echo; printf 'no newline'\"\n",
        tmp_path,
    )
    steps: list[tuple[int, str, bool, str]] = []
    output: list[tuple[int, str, str]] = []

    def on_step(r: StepResult) -> None:
        steps.append((r.index, r.kind, r.cache_hit, r.layer))

    def on_output(index: int, stream: str, line: str) -> None:
        output.append((index, stream, line))

    result = await build_recipe(recipe, store, client_factory=factory, on_step=on_step, on_output=on_output)
    assert steps == [(r.index, r.kind, r.cache_hit, r.layer) for r in result.steps]
    assert [(i, kind, hit) for i, kind, hit, _ in steps] == [(0, "base", True), (1, "copy", False), (2, "run", False)]
    assert all(layer.startswith("sha256:") for *_, layer in steps)
    assert sorted(output) == sorted(
        [(2, "stdout", f"out-{nonce}"), (2, "stderr", f"err-{nonce}"), (2, "stdout", ""), (2, "stdout", "no newline")]
    )
    assert [line for _, stream, line in output if stream == "stdout"] == [f"out-{nonce}", "", "no newline"]
    output.clear()
    steps.clear()
    again = await build_recipe(recipe, store, client_factory=factory, on_step=on_step, on_output=on_output)
    assert _hits(again) == [True, True] and [hit for _, _, hit, _ in steps] == [True, True, True]
    assert output == []  # a cached step runs nothing
    # A failing command streams what it printed and still names it in the error.
    failing = Recipe.parse(
        f'ref = "{ref}-fail"\nbase = "busybox"\n[[step]]\nrun = "echo {nonce}; echo it broke >&2; exit 3"\n',
        tmp_path,
    )
    with pytest.raises(RecipeError, match=r"step 1 \(run\): command exited 3: it broke"):
        await build_recipe(failing, store, client_factory=factory, on_output=on_output)
    assert (1, "stdout", nonce) in output and (1, "stderr", "it broke") in output


async def test_pip_step_installs_wheels_offline(
    tmp_path: Path, store: LayerStore, fleet: Client, factory: Callable[[], AsyncClient], cleanup_images: list[str]
) -> None:
    ref = "test-recipe/pip:1"
    cleanup_images.append(ref)
    _write(tmp_path / "marker", uuid.uuid4().hex)  # under the pip step: keeps its cache key fresh
    recipe = Recipe.parse(
        f'ref = "{ref}"\nbase = "python:3.11"\n'
        '[[step]]\ncopy = { src = "marker", dest = "/etc/recipe-marker" }\n'
        '[[step]]\npip = ["six==1.16.0"]\n',
        tmp_path,
    )
    result = await build_recipe(recipe, store, client_factory=factory)
    assert _hits(result) == [False, False]
    with fleet.create(image=ref) as sb:
        out = sb.exec('python3 -c "import six; print(six.__version__)"')
        assert (out.exit_code, out.stdout) == (0, "1.16.0\n"), out.stderr
        assert sb.exec("test -e /tmp/sandfleet-pip").exit_code == 1  # the wheelhouse is not in the layer
        # The host's pip that installed the wheels (run from its wheel) is not in the layer: the
        # image's pip is Debian's own.
        assert sb.exec("ls /usr/local/lib/python3.11/dist-packages/ | grep -i '^pip'").stdout == ""
        assert "/usr/lib/python3/dist-packages/pip" in sb.exec("python3 -m pip --version").stdout
    with fleet.create(image="python:3.11") as sb:
        assert sb.exec('python3 -c "import six"').exit_code != 0


async def test_pip_step_never_builds_source_on_the_host(
    tmp_path: Path, store: LayerStore, factory: Callable[[], AsyncClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Wheels only, even for the host's own Python version: building an sdist would run its
    # setup.py here, as root. A direct URL in a wheel's dependencies is built by pip even with
    # --only-binary=:all:, so the requirement strings' check is not enough on its own.
    idx = tmp_path / "index"
    idx.mkdir()
    ran = tmp_path / "setup-py-ran"
    evil = _sdist(idx, "sandfleet-test-evil", ran)
    pure_wheel(idx, "sandfleet-test-innocent", [f"sandfleet-test-evil @ {evil.as_uri()}"])
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(idx))
    for req, message in [
        ("sandfleet-test-innocent==1.0", "refusing to build sandfleet-test-evil"),
        ("sandfleet-test-evil==1.0", r"(?s)No matching distribution.*without a wheel for python 3\.11.*run step"),
    ]:
        recipe = Recipe.parse(f'ref = "test-recipe/pip-src:1"\nbase = "python:3.11"\n[[step]]\npip = ["{req}"]\n')
        with pytest.raises(RecipeError, match=message):
            await build_recipe(recipe, store, client_factory=factory)
        assert not ran.exists()


@pytest.mark.slow
async def test_apt_step_on_debian_keeps_files_of_steps_below(
    tmp_path: Path, store: LayerStore, fleet: Client, cleanup_images: list[str]
) -> None:
    ref = "test-recipe/apt:1"
    cleanup_images.append(ref)
    _write(tmp_path / "tool.conf", uuid.uuid4().hex)  # not a dpkg file: the apt layer must not delete it
    recipe = Recipe.parse(
        f'ref = "{ref}"\nbase = "debian:bookworm"\n'
        '[[step]]\ncopy = { src = "tool.conf", dest = "/etc/tool.conf" }\n'
        '[[step]]\napt = ["jq"]\n',
        tmp_path,
    )
    result = await build_recipe(recipe, store)
    assert [s.kind for s in result.steps] == ["base", "copy", "apt"]
    with fleet.create(image=ref) as sb:
        out = sb.exec("echo '{\"a\": 42}' | jq .a")
        assert (out.exit_code, out.stdout) == (0, "42\n"), out.stderr
        assert sb.exec("cat /etc/tool.conf").stdout == (tmp_path / "tool.conf").read_text()
        assert "jq" in sb.exec("dpkg-query -W -f '${Package}\\n' jq").stdout
        assert sb.exec("dpkg-query -W -f '${Package}\\n' | wc -l").stdout.strip() != "0"
    assert _hits(await build_recipe(recipe, store)) == [True, True]


@pytest.mark.slow
async def test_mmdebstrap_base_is_cached(
    tmp_path: Path, store: LayerStore, fleet: Client, cleanup_images: list[str]
) -> None:
    ref = "test-recipe/mmdebstrap:1"
    cleanup_images.append(ref)
    recipe = Recipe.parse(f'ref = "{ref}"\nbase = {{ mmdebstrap = {{ suite = "bookworm", packages = ["jq"] }} }}\n')
    first = await build_recipe(recipe, store)
    assert len(first.manifest.layers) == 1 and first.manifest.layers[0].kind == "base"
    with fleet.create(image=ref) as sb:
        assert sb.exec("echo '[1,2]' | jq length").stdout == "2\n"
    again = await build_recipe(recipe, store)
    assert again.steps[0].cache_hit and again.manifest.layers == first.manifest.layers
