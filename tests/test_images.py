"""Tests for the local EROFS layer store and built-in images (need root + erofs/overlay)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from sandfleet import Client
from sandfleet.images import (
    BUILTIN_IMAGES,
    BuildContext,
    Builder,
    ImageBuildError,
    ImageManifest,
    ImageNotFoundError,
    InvalidRefError,
    LayerCorruptError,
    LayerRef,
    LayerStore,
    diff_trees,
    parse_ref,
    shift_ownership,
)
from sandfleet.images.builders import alias, build_busybox, stage_busybox
from wheels import pure_wheel

UID_BASE = 100000

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown, mount)")


@contextlib.contextmanager
def mounted(*argv: str, target: Path) -> Iterator[Path]:
    """``mount <argv> <target>``; always unmounted on exit."""
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", *argv, str(target)], check=True)
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=True)


def mount_erofs(image: Path, target: Path) -> contextlib.AbstractContextManager[Path]:
    return mounted("-t", "erofs", "-o", "ro", str(image), target=target)


def mount_overlay(lowers_top_first: list[Path], target: Path) -> contextlib.AbstractContextManager[Path]:
    lowerdir = ":".join(str(p) for p in lowers_top_first)
    return mounted("-t", "overlay", "overlay", "-o", f"ro,lowerdir={lowerdir}", target=target)


# --------------------------------------------------------------------------- refs


def test_parse_ref() -> None:
    assert parse_ref("busybox") == ("busybox", "latest")
    assert parse_ref("python:3.11") == ("python", "3.11")
    assert parse_ref("base/debian:bookworm") == ("base/debian", "bookworm")
    for bad in ("", "Debian", "a:", "a:b:c", "/abs", "a//b", "../x", "x/../y", "a b"):
        with pytest.raises(InvalidRefError):
            parse_ref(bad)


async def test_unknown_ref(tmp_path: Path) -> None:
    store = LayerStore(tmp_path, uid_base=UID_BASE)
    with pytest.raises(ImageNotFoundError):
        store.resolve("nope")
    with pytest.raises(ImageNotFoundError):
        await store.ensure("nope:1.0")
    with pytest.raises(LookupError):  # ImageNotFoundError is a LookupError
        store.remove_image("nope")
    assert store.list_images() == []


# --------------------------------------------------------------------------- busybox


def test_busybox_build_resolve_mount(tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)
    stages: list[tuple[str, float]] = []
    m = asyncio.run(store.ensure("busybox", lambda s, f: stages.append((s, f))))
    assert (m.name, m.tag) == ("busybox", "latest")
    assert store.resolve("busybox:latest") == m
    assert store.resolve("busybox") == m
    assert [i.ref for i in store.list_images()] == ["busybox:latest"]
    assert stages[-1][1] == 1.0 and all(0.0 <= f <= 1.0 for _, f in stages)
    assert [f for _, f in stages] == sorted(f for _, f in stages)

    (layer,) = m.layers
    assert layer.kind == "base"
    path = store.layer_path(layer.digest)
    assert path.is_file() and path.stat().st_size == layer.size
    assert path.name == "sha256-" + layer.digest.split(":")[1] + ".erofs"
    assert not list((tmp_path / "store" / "tmp").iterdir()), "build scratch dir left behind"

    with mount_erofs(path, tmp_path / "mnt") as mnt:
        sh = mnt / "bin/sh"
        assert sh.is_symlink() and os.readlink(sh) == "/bin/busybox"
        assert os.lstat(sh).st_uid == UID_BASE and os.lstat(sh).st_gid == UID_BASE
        bb = os.stat(mnt / "bin/busybox")
        assert bb.st_uid == UID_BASE and bb.st_mode & 0o111
        assert stat.S_IMODE(os.stat(mnt / "tmp").st_mode) == 0o1777
        assert (mnt / "usr/bin/awk").is_symlink()
        for d in ("etc", "root", "proc", "sys", "dev", "home", "var", "usr/bin", "task"):
            assert (mnt / d).is_dir(), d
        assert (mnt / "etc/passwd").read_text().startswith("root:x:0:0:root:/root:/bin/sh\n")
        assert "nobody:x:65534:" in (mnt / "etc/passwd").read_text()
        assert (mnt / "etc/group").is_file() and (mnt / "etc/hostname").is_file()
        # The image actually runs.
        out = subprocess.run(
            ["chroot", str(mnt), "/bin/sh", "-c", "echo hello | tr a-z A-Z"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        assert out == "HELLO\n"

    # Idempotent: a second ensure returns the stored manifest without rebuilding.
    assert asyncio.run(store.ensure("busybox:latest")) == m
    store.remove_image("busybox")
    with pytest.raises(ImageNotFoundError):
        store.resolve("busybox")
    assert path.exists(), "layers are shared and must survive manifest removal"


def _counting_busybox(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []

    async def build(ctx: BuildContext) -> list[LayerRef]:
        calls.append(1)
        await asyncio.sleep(0.3)  # widen the race window
        return await build_busybox(ctx)

    monkeypatch.setitem(BUILTIN_IMAGES, "busybox:latest", Builder(recipe="counted", build=build))
    return calls


async def test_concurrent_ensure_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting_busybox(monkeypatch)
    store = LayerStore(tmp_path, uid_base=UID_BASE)
    results = await asyncio.gather(*(store.ensure(r) for r in ["busybox", "busybox:latest"] * 3))
    assert len(calls) == 1
    assert all(r == results[0] for r in results)


async def test_two_stores_same_root_build_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Separate LayerStore objects don't share asyncio locks: only the flock serialises them,
    # which is what two daemon processes would see.
    calls = _counting_busybox(monkeypatch)
    a = LayerStore(tmp_path, uid_base=UID_BASE)
    b = LayerStore(tmp_path, uid_base=UID_BASE)
    ma, mb = await asyncio.gather(a.ensure("busybox"), b.ensure("busybox"))
    assert len(calls) == 1
    assert ma == mb


def test_truncated_layer_is_corrupt(tmp_path: Path) -> None:
    store = LayerStore(tmp_path, uid_base=UID_BASE)
    m = asyncio.run(store.ensure("busybox"))
    digest = m.layers[0].digest
    path = store.layer_path(digest)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.truncate(m.layers[0].size // 2)
    with pytest.raises(LayerCorruptError):
        store.layer_path(digest)
    # A fresh store (no cached sizes) must notice too.
    with pytest.raises(LayerCorruptError):
        LayerStore(tmp_path, uid_base=UID_BASE).layer_path(digest)
    with pytest.raises(LayerCorruptError):
        asyncio.run(store.verify_layer(digest))
    path.unlink()
    with pytest.raises(LayerCorruptError):
        store.layer_path(digest)
    with pytest.raises(LayerCorruptError):
        store.layer_path("sha256:nothex")


def _flip_in_place(path: Path, offset: int) -> None:
    """Flip one byte of a file where it lies, then put its mode, atime and mtime back (ns exact)."""
    st = os.stat(path)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.chmod(path, stat.S_IMODE(st.st_mode))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)


async def test_verification_is_voided_by_any_change_to_the_layer_file_but_not_by_its_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sandfleet.images import store as store_module

    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)
    src = tmp_path / "src"
    src.mkdir()
    (src / "blob").write_bytes(os.urandom(300_000))
    layer = await store.add_layer_from_dir(src, "random")
    hashed: list[Path] = []
    real = store_module._hash_unchanging

    def counting(path: Path, digest: str) -> str:
        hashed.append(path)
        return real(path, digest)

    monkeypatch.setattr(store_module, "_hash_unchanging", counting)
    assert not store.is_verified(layer.digest)
    path = store.verified_layer_path(layer.digest)
    assert len(hashed) == 1 and store.is_verified(layer.digest)

    # The store's own bookkeeping (the LRU use stamp) leaves the file, its ctime included, alone.
    before = os.stat(path)
    store.touch(path)
    after = os.stat(path)
    assert (after.st_ctime_ns, after.st_mtime_ns, after.st_atime_ns) == (
        before.st_ctime_ns,
        before.st_mtime_ns,
        before.st_atime_ns,
    )
    assert (store.used_dir / layer.digest.removeprefix("sha256:")).stat().st_mtime >= before.st_mtime
    assert store.verified_layer_path(layer.digest) == path and len(hashed) == 1
    # A recently used layer outlives gc's min_age even though the file itself is old.
    os.utime(store.used_dir / layer.digest.removeprefix("sha256:"))
    old = time.time() - 7200
    stamp = store.verified_dir / layer.digest.removeprefix("sha256:")
    os.utime(path, (old, old))  # changes the ctime: the next check hashes again (intact: fine)
    assert store.gc(set(), min_age=600) == ([], 0)
    assert store.verified_layer_path(layer.digest) == path and len(hashed) == 2
    assert stamp.read_text().startswith("v2 ")

    # Bytes flipped in place, with size, inode, mode and mtime put back: hashed again, and refused.
    _flip_in_place(path, path.stat().st_size // 2)
    assert not store.is_verified(layer.digest)
    with pytest.raises(LayerCorruptError, match="corrupt"):
        store.verified_layer_path(layer.digest)
    assert len(hashed) == 3
    with pytest.raises(LayerCorruptError, match="corrupt"):  # no stamp was written for the bad content
        LayerStore(tmp_path / "store", uid_base=UID_BASE).verified_layer_path(layer.digest)


async def test_put_manifest_slash_name(tmp_path: Path) -> None:
    store = LayerStore(tmp_path, uid_base=UID_BASE)
    src = tmp_path / "src"
    src.mkdir()
    (src / "hello").write_text("hi\n")
    layer = await store.add_layer_from_dir(src, "hello", kind="base")
    m = store.put_manifest("base/debian", "v1", [layer], recipe="test")
    assert (tmp_path / "images/base/debian/v1.json").is_file()
    assert store.resolve("base/debian:v1") == m
    assert [i.ref for i in store.list_images()] == ["base/debian:v1"]
    store.remove_image("base/debian:v1")
    assert not (tmp_path / "images/base").exists()


def _busybox_with(marker: str, calls: list[str]) -> Callable[[BuildContext], Awaitable[list[LayerRef]]]:
    async def build(ctx: BuildContext) -> list[LayerRef]:
        calls.append(marker)
        rootfs = ctx.workdir / "rootfs"
        await asyncio.to_thread(stage_busybox, rootfs)
        (rootfs / "etc/marker").write_text(marker)
        return [await ctx.store.add_layer_from_dir(rootfs, f"busybox {marker}", kind="base")]

    return build


async def test_an_outdated_builtin_image_is_rebuilt_and_its_old_layers_stay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    store = LayerStore(tmp_path, uid_base=UID_BASE)
    # Version 1, as recorded before builders had versions: the recipe string alone.
    monkeypatch.setitem(BUILTIN_IMAGES, "t-builtin:1", Builder(recipe="t one", build=_busybox_with("v1", calls)))
    monkeypatch.setitem(BUILTIN_IMAGES, "t-builtin:latest", alias("t-builtin:1"))
    v1 = await store.ensure("t-builtin:1")
    assert (await store.ensure("t-builtin")).layers == v1.layers
    assert calls == ["v1"] and v1.recipe == "t one"

    v2_builder = Builder(recipe="t two", build=_busybox_with("v2", calls), version=2, legacy_recipes=("t one",))
    monkeypatch.setitem(BUILTIN_IMAGES, "t-builtin:1", v2_builder)
    v2 = await store.ensure("t-builtin:1")
    assert calls == ["v1", "v2"] and v2.recipe == "t two [builder v2]" and v2.layers != v1.layers
    assert await store.ensure("t-builtin:1") == v2 and calls == ["v1", "v2"]  # current now: not again
    # The alias follows its target without building anything itself.
    assert (await store.ensure("t-builtin:latest")).layers == v2.layers and len(calls) == 2
    # The old layer stays for whatever still uses it (a running sandbox, a snapshot) until gc.
    assert store.layer_path(v1.layers[0].digest).exists()
    assert v1.layers[0].digest in store.gc(set(), min_age=0)[0]

    # A third version whose build fails: the stored image keeps serving, and the rebuild is not
    # tried on every request.
    async def broken(ctx: BuildContext) -> list[LayerRef]:
        calls.append("v3")
        raise ImageBuildError("mirror unreachable")

    monkeypatch.setitem(BUILTIN_IMAGES, "t-builtin:1", Builder(recipe="t three", build=broken, version=3))
    stages: list[str] = []
    assert await store.ensure("t-builtin:1", lambda s, f: stages.append(s)) == v2
    assert await store.ensure("t-builtin:1") == v2
    assert calls == ["v1", "v2", "v3"] and "rebuild failed" in stages[-1]

    # An image of a built-in name that its builder did not make (imported, say) is never replaced.
    monkeypatch.setitem(BUILTIN_IMAGES, "t-builtin:1", Builder(recipe="t four", build=broken, version=4))
    store.put_manifest("t-builtin", "1", v2.layers, recipe="imported from app.tar")
    assert (await store.ensure("t-builtin:1")).recipe == "imported from app.tar"
    store.put_manifest("t-builtin", "latest", v2.layers, recipe="imported")
    assert (await store.ensure("t-builtin:latest")).recipe == "imported"
    assert calls == ["v1", "v2", "v3"]


def test_python_builder_versions() -> None:
    builder = BUILTIN_IMAGES["python:3.11"]
    assert builder.version >= 2 and builder.manifest_recipe.endswith(f"[builder v{builder.version}]")
    old = "debian:bookworm + diff(mmdebstrap --include=python3)"  # what nodes built before
    manifest = ImageManifest(name="python", tag="3.11", layers=[], created=0.0, recipe=old)
    store = LayerStore.__new__(LayerStore)  # outdated() needs no store for a plain builder
    assert builder.outdated(store, manifest)
    assert not builder.outdated(store, manifest.model_copy(update={"recipe": builder.manifest_recipe}))
    for pkg in ("python3", "python-is-python3", "python3-pip", "python3-venv"):
        assert pkg in builder.recipe


def test_python_image_has_python_pip_and_venv(fleet: Client, tmp_path: Path) -> None:
    """What users of a python image expect, with no network: `python`, pip, venv, pip install."""
    wheel = pure_wheel(tmp_path, "sandfleet_wheel_test", init=b"print(__name__)\n")
    fleet.build_image("python:3.11")  # (re)built on first use: minutes with a cold cache
    with fleet.create(image="python:3.11", idle_ttl=300) as sb:
        r = sb.exec("python --version")
        assert r.exit_code == 0 and r.stdout.startswith("Python 3.11."), r.stdout + r.stderr
        r = sb.exec("python -m venv /tmp/v && /tmp/v/bin/python -m pip --version", timeout=180)
        assert r.exit_code == 0 and "/tmp/v/" in r.stdout, r.stdout + r.stderr
        r = sb.exec("pip --version")
        assert r.exit_code == 0 and "(python 3.11)" in r.stdout, r.stdout + r.stderr
        assert sb.exec("ls /usr/lib/python3*/EXTERNALLY-MANAGED").exit_code != 0
        # pip installs into the image's Python as in any python image (no PEP 668 refusal).
        sb.files.write(f"/tmp/{wheel.name}", wheel.read_bytes())
        install = f"pip install --no-index /tmp/{wheel.name}"
        r = sb.exec(f"{install} && cd / && python -c 'import sandfleet_wheel_test'", timeout=180)
        assert r.exit_code == 0 and r.stdout.endswith("sandfleet_wheel_test\n"), r.stdout + r.stderr
        r = sb.exec("/tmp/v/bin/pip install --no-index /tmp/" + wheel.name, timeout=180)
        assert r.exit_code == 0, r.stdout + r.stderr
    info = next(i for i in fleet.images() if (i.name, i.tag) == ("python", "3.11"))
    assert len(info.layers) == 2


# --------------------------------------------------------------------------- ownership / diff


def test_shift_ownership_keeps_setuid(tmp_path: Path) -> None:
    root = tmp_path / "t"
    root.mkdir()
    f = root / "suid"
    f.write_bytes(b"x")
    os.chown(f, 5, 6)
    os.chmod(f, 0o4755)
    os.link(f, root / "hardlink")  # must be shifted once, not twice
    (root / "link").symlink_to("suid")
    shift_ownership(root, UID_BASE)
    st = os.stat(f)
    assert (st.st_uid, st.st_gid) == (UID_BASE + 5, UID_BASE + 6)
    assert stat.S_IMODE(st.st_mode) == 0o4755
    assert os.lstat(root / "link").st_uid == UID_BASE
    assert os.stat(root).st_uid == UID_BASE


def _write(p: Path, text: str, mode: int = 0o644) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    os.chmod(p, mode)


def test_diff_trees(tmp_path: Path) -> None:
    lower, upper, out = tmp_path / "lower", tmp_path / "upper", tmp_path / "out"
    for root in (lower, upper):
        _write(root / "same.txt", "same")
        _write(root / "etc/keep", "keep")
        _write(root / "changed.txt", "v1" if root == lower else "v2 longer")
        _write(root / "modeonly", "m", 0o644 if root == lower else 0o755)
        (root / "link").symlink_to("same.txt" if root == lower else "changed.txt")
        (root / "samelink").symlink_to("same.txt")
    _write(lower / "deleted.txt", "bye")
    _write(lower / "olddir/sub/f", "bye")
    _write(lower / "dir2file/x", "x")
    _write(upper / "dir2file", "now a file")
    _write(upper / "etc/new.conf", "new")
    _write(upper / "newdir/a/b", "deep")
    os.mknod(upper / "fifo", stat.S_IFIFO | 0o600)
    for same in ("same.txt", "etc/keep"):  # unchanged files carry the lower's mtime (as a copy-up would)
        mtime = os.stat(lower / same).st_mtime_ns
        os.utime(upper / same, ns=(mtime, mtime))

    stats = diff_trees(lower, upper, out)

    def entries(root: Path) -> set[str]:
        return {str(p.relative_to(root)) for p in root.rglob("*")}

    assert entries(out) == {
        "changed.txt",
        "modeonly",
        "link",
        "deleted.txt",
        "olddir",
        "dir2file",
        "etc",
        "etc/new.conf",
        "newdir",
        "newdir/a",
        "newdir/a/b",
        "fifo",
    }
    assert (out / "changed.txt").read_text() == "v2 longer"
    assert stat.S_IMODE(os.stat(out / "modeonly").st_mode) == 0o755
    assert os.readlink(out / "link") == "changed.txt"
    for wh in ("deleted.txt", "olddir"):
        st = os.lstat(out / wh)
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0, wh
    assert (out / "dir2file").is_file()
    assert stats.removed == 2

    # mkfs.erofs must keep the whiteouts, and the overlay of out over lower must equal upper.
    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)
    layer = asyncio.run(store.add_layer_from_dir(out, "diff", shift_ids=False))
    with contextlib.ExitStack() as stack:
        top = stack.enter_context(mount_erofs(store.layer_path(layer.digest), tmp_path / "top"))
        merged = stack.enter_context(mount_overlay([top, lower], tmp_path / "merged"))
        assert entries(merged) == entries(upper)
        assert (merged / "changed.txt").read_text() == "v2 longer"
        assert (merged / "dir2file").read_text() == "now a file"
        assert os.readlink(merged / "link") == "changed.txt"
        assert not (merged / "deleted.txt").exists() and not (merged / "olddir").exists()


# --------------------------------------------------------------------------- debian / python


@pytest.mark.slow
def test_debian_and_python_images(tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)
    fractions: list[float] = []
    py = asyncio.run(store.ensure("python:3.11", lambda s, f: fractions.append(f)))
    deb = store.resolve("debian:bookworm")
    assert len(deb.layers) == 1 and deb.layers[0].kind == "base"
    assert len(py.layers) == 2 and py.layers[0] == deb.layers[0] and py.layers[1].kind == "layer"
    assert py.layers[1].size < deb.layers[0].size
    assert fractions == sorted(fractions) and fractions[-1] == 1.0

    deb_file, py_file = store.layer_paths(py)
    with contextlib.ExitStack() as stack:
        deb_mnt = stack.enter_context(mount_erofs(deb_file, tmp_path / "deb"))
        py_mnt = stack.enter_context(mount_erofs(py_file, tmp_path / "py"))
        assert not (deb_mnt / "usr/bin/python3").exists()
        assert not (deb_mnt / "var/lib/apt/lists").exists() or not any(
            p.is_file() for p in (deb_mnt / "var/lib/apt/lists").iterdir()
        )
        assert not list((deb_mnt / "var/cache/apt/archives").glob("*.deb"))
        # The python layer holds only the delta, not a second copy of debian.
        assert not (py_mnt / "usr/bin/bash").exists()
        merged = stack.enter_context(mount_overlay([py_mnt, deb_mnt], tmp_path / "merged"))
        assert os.path.lexists(merged / "usr/bin/python3")
        assert (merged / "bin/bash").is_file()
        assert os.stat(merged / "bin/bash").st_uid == UID_BASE
        out = subprocess.run(
            ["chroot", str(merged), "/usr/bin/python3", "-c", "import sys, ssl, sqlite3; print(sys.version)"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        assert out.startswith("3.11.")

    # Aliases resolve to the same layers without rebuilding.
    assert asyncio.run(store.ensure("python")).layers == py.layers
