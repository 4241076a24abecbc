"""Tests for importing docker-save / OCI images into the layer store (most need root: chown, mknod, mounts).

The archives are built here with tarfile, so every whiteout, opaque dir and escape attempt is explicit.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gzip
import hashlib
import io
import json
import os
import platform
import posixpath
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sandfleet import Client, InvalidArgumentError
from sandfleet.images import ImageManifest, ImageNotFoundError, InvalidRefError, LayerStore, oci_import
from sandfleet.images.builders import mounted_layers
from sandfleet.images.models import LayerRef
from sandfleet.images.oci_errors import OciImportError, OciRefError
from sandfleet.images.oci_import import import_image
from sandfleet.images.oci_manifest import normalise_ref

from conftest import Daemon, destroy_daemon, make_daemon

UID_BASE = 100000
MTIME = 1_600_000_000
KIB = 1024

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown, mknod, mount)")

MANIFEST_V1 = "application/vnd.oci.image.manifest.v1+json"
INDEX_V1 = "application/vnd.oci.image.index.v1+json"
CONFIG_V1 = "application/vnd.oci.image.config.v1+json"
LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
HOST_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())


# --------------------------------------------------------------------------- layer tars

Member = tuple[tarfile.TarInfo, bytes]


def _info(name: str, kind: bytes, mode: int, uid: int = 0, gid: int = 0, mtime: int = MTIME) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.uid, info.gid, info.mtime = kind, mode, uid, gid, mtime
    return info


def file_(
    name: str, data: str | bytes = b"", *, mode: int = 0o644, uid: int = 0, mtime: int = MTIME, **xattrs: str
) -> Member:
    info = _info(name, tarfile.REGTYPE, mode, uid, uid, mtime)
    info.pax_headers = {f"SCHILY.xattr.{k.replace('_', '.')}": v for k, v in xattrs.items()}
    body = data.encode() if isinstance(data, str) else data
    info.size = len(body)
    return info, body


def dir_(name: str, *, mode: int = 0o755, mtime: int = MTIME, **xattrs: str) -> Member:
    info = _info(name, tarfile.DIRTYPE, mode, mtime=mtime)
    info.pax_headers = {f"SCHILY.xattr.{k.replace('_', '.')}": v for k, v in xattrs.items()}
    return info, b""


def link(name: str, target: str) -> Member:
    info = _info(name, tarfile.SYMTYPE, 0o777)
    info.linkname = target
    return info, b""


def hardlink(name: str, target: str) -> Member:
    info = _info(name, tarfile.LNKTYPE, 0o644)
    info.linkname = target
    return info, b""


def special(name: str, kind: bytes) -> Member:
    return _info(name, kind, 0o644), b""


def whiteout(path: str) -> Member:
    parent, base = posixpath.split(path)
    return file_(posixpath.join(parent, ".wh." + base))


def opaque(path: str) -> Member:
    return file_(f"{path}/.wh..wh..opq")


def layer_tar(*members: Member) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, body in members:
            tar.addfile(info, io.BytesIO(body) if info.isreg() else None)
    return buf.getvalue()


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def stack_layers() -> list[bytes]:
    """Four layers exercising overlay semantics. The first is > 32 KiB, the others well below, so
    ``merge_below=32 KiB`` keeps the first alone and merges the rest (whiteouts and opaque dirs
    in the merged group must still act on the first layer)."""
    base = layer_tar(
        dir_("etc"),
        file_("etc/passwd", "root:x:0:0\n"),
        file_("etc/remove-me", "bye"),
        file_("etc/keep", "keep"),
        dir_("usr", mtime=MTIME - 5),
        dir_("usr/bin"),
        file_("usr/bin/tool", "#!/bin/sh\n", mode=0o4755),
        hardlink("usr/bin/tool-link", "usr/bin/tool"),
        link("bin", "usr/bin"),
        dir_("opt"),
        dir_("opt/old"),
        file_("opt/old/a", "a"),
        file_("opt/old/b", "b"),
        file_("data", "I am a file"),
        dir_("var"),
        dir_("var/keep"),
        file_("var/keep/x", "x"),
        dir_("srv"),
        dir_("srv/site"),
        file_("srv/site/old.html", "old"),
        dir_("cache"),
        file_("cache/l1", "1"),
        dir_("lib"),
        file_("lib/libc.so", "libc"),
        link("lib64", "lib"),
        file_("home-file", "mine", mode=0o600, uid=1000, mtime=MTIME + 7, user_test="hello"),
        special("run.fifo", tarfile.FIFOTYPE),
        special("dev-null", tarfile.CHRTYPE),  # device nodes are skipped: the runtime provides /dev
        file_("doomed", "x"),
        *(m for d in ("conf", "conf2", "conf3") for m in (dir_(d), file_(f"{d}/old", "old"))),
        file_("big", os.urandom(64 * KIB)),
    )
    second = layer_tar(
        dir_("etc"),
        whiteout("etc/remove-me"),
        dir_("opt"),
        opaque("opt"),
        file_("opt/new", "new"),
        dir_("data"),  # a dir replacing a file of a lower layer
        file_("data/inner", "inside"),
        file_("scratch", "temporary"),
        file_("srv/site", "site is a file now"),
        file_("cache/l2", "2"),
        file_("lib/libm.so", "libm"),
        dir_("tmpdir"),
        file_("tmpdir/x", "x"),
        # A whiteout and a dir of the same name in one layer: the dir is new, lower content hidden.
        whiteout("conf"),
        dir_("conf"),
        file_("conf/new", "new"),
        dir_("conf2"),
        file_("conf2/new", "new"),
        whiteout("conf2"),
        whiteout("conf3"),
        file_("conf3/new", "new"),  # its parent dir is implied
    )
    third = layer_tar(
        dir_("etc"),
        file_("etc/passwd", "root:x:0:0\nuser:x:1000:1000\n"),  # the upper layer wins
        link("etc/link", "/etc/passwd"),
        dir_("var"),
        file_("var/keep", "now a file"),  # a file replacing a lower dir
        whiteout("scratch"),  # removes a file of the same merge group
        dir_("srv/site"),  # a dir again, over the file of the layer below
        file_("srv/site/new.html", "new"),
        opaque("cache"),
        file_("cache/l3", "3"),
        dir_("lib64"),  # a dir replacing a lower symlink
        file_("lib64/ld.so", "ld"),
    )
    fourth = layer_tar(
        dir_("usr"),
        dir_("usr/bin"),
        file_("usr/bin/new-tool", "#!/bin/sh\necho new\n", mode=0o755),
        whiteout("tmpdir"),
        whiteout("doomed"),  # hides a file below the merge group: must survive the merge
        file_("lib/libm.so", "libm v2"),
    )
    return [base, second, third, fourth]


def check_stack(tree: dict[str, Entry]) -> None:
    """What stack_layers() must look like, mounted."""
    assert tree["etc/passwd"].data == b"root:x:0:0\nuser:x:1000:1000\n"
    assert "etc/remove-me" not in tree and tree["etc/keep"].data == b"keep"
    assert [p for p in tree if p.startswith("opt/")] == ["opt/new"]
    assert tree["data"].kind == stat.S_IFDIR and tree["data/inner"].data == b"inside"
    assert tree["var/keep"].data == b"now a file" and "var/keep/x" not in tree
    assert "scratch" not in tree and "tmpdir" not in tree and "doomed" not in tree
    for d in ("conf", "conf2", "conf3"):
        assert sorted(p for p in tree if p.startswith(f"{d}/")) == [f"{d}/new"], d
    assert sorted(p for p in tree if p.startswith("srv/site/")) == ["srv/site/new.html"]
    assert sorted(p for p in tree if p.startswith("cache/")) == ["cache/l3"]
    assert tree["lib/libc.so"].data == b"libc" and tree["lib/libm.so"].data == b"libm v2"
    assert tree["lib64"].kind == stat.S_IFDIR and sorted(p for p in tree if p.startswith("lib64/")) == ["lib64/ld.so"]
    assert tree["bin"].kind == stat.S_IFLNK and tree["bin"].data == b"usr/bin"
    assert tree["etc/link"].data == b"/etc/passwd"
    tool = tree["usr/bin/tool"]
    assert (tool.mode, tool.uid, tool.gid) == (0o4755, UID_BASE, UID_BASE)
    assert tree["usr/bin/tool-link"].ino == tool.ino, "hard link not kept"
    assert tree["usr/bin/new-tool"].mode == 0o755
    home = tree["home-file"]
    assert (home.uid, home.gid, home.mode, home.mtime) == (UID_BASE + 1000, UID_BASE + 1000, 0o600, MTIME + 7)
    assert home.xattrs == {"user.test": b"hello"}
    assert tree["run.fifo"].kind == stat.S_IFIFO
    assert "dev-null" not in tree
    assert not any(e.kind == stat.S_IFCHR for e in tree.values()), "a whiteout is visible"


def image_config(layers: Sequence[bytes], **run: Any) -> bytes:
    return json.dumps(
        {
            "architecture": HOST_ARCH,
            "os": "linux",
            "config": run,
            "rootfs": {"type": "layers", "diff_ids": [sha(layer) for layer in layers]},
        }
    ).encode()


# --------------------------------------------------------------------------- archives


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o444
    tar.addfile(info, io.BytesIO(data))


@dataclass
class DockerImage:
    tags: list[str] | None
    layers: list[bytes]  # uncompressed tars
    config: bytes = b""
    gzip_layers: set[int] = field(default_factory=set)  # indexes stored gzip'd (not docker's own habit)

    def __post_init__(self) -> None:
        self.config = self.config or image_config(self.layers)


def docker_save(path: Path, images: Sequence[DockerImage], *, blobs: bool = False) -> Path:
    """A ``docker save`` tar: the legacy layout (``<id>/layer.tar``, ``<config-hex>.json``), or with
    ``blobs`` Docker >= 25's (``blobs/sha256/<hex>`` for config and layers)."""
    entries = []
    with tarfile.open(path, "w") as tar:
        for image in images:
            cfg_hex = sha(image.config).removeprefix("sha256:")
            cfg_name = f"blobs/sha256/{cfg_hex}" if blobs else f"{cfg_hex}.json"
            _add(tar, cfg_name, image.config)
            names = []
            for i, layer in enumerate(image.layers):
                blob = gzip.compress(layer, mtime=0) if i in image.gzip_layers else layer
                blob_hex = sha(blob).removeprefix("sha256:")
                name = f"blobs/sha256/{blob_hex}" if blobs else f"{sha(blob + cfg_name.encode())[7:]}/layer.tar"
                _add(tar, name, blob)
                names.append(name)
            entries.append({"Config": cfg_name, "RepoTags": image.tags, "Layers": names})
        _add(tar, "manifest.json", json.dumps(entries).encode())
    return path


def _write_blob(root: Path, data: bytes) -> dict[str, Any]:
    path = root / "blobs/sha256" / sha(data).removeprefix("sha256:")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {"digest": sha(data), "size": len(data)}


def zstd_compress(data: bytes) -> bytes:
    return subprocess.run(["zstd", "-q", "-c"], input=data, capture_output=True, check=True).stdout


def oci_manifest(
    root: Path, layers: Sequence[bytes], *, compress: str = "gzip", config: bytes = b"", layer_type: str = ""
) -> dict[str, Any]:
    """Write an image's blobs into the layout at ``root``; return the manifest descriptor."""
    descs = []
    for layer in layers:
        if compress == "gzip":
            blob, media_type = gzip.compress(layer, mtime=0), LAYER_GZIP
        elif compress == "zstd":
            blob, media_type = zstd_compress(layer), LAYER_ZSTD
        else:
            blob, media_type = layer, LAYER_TAR
        descs.append({"mediaType": layer_type or media_type, **_write_blob(root, blob)})
    cfg = {"mediaType": CONFIG_V1, **_write_blob(root, config or image_config(layers))}
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST_V1, "config": cfg, "layers": descs}
    return {"mediaType": MANIFEST_V1, **_write_blob(root, json.dumps(manifest).encode())}


def oci_layout(root: Path, descriptors: Sequence[dict[str, Any]]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": list(descriptors)}))
    return root


def tar_dir(root: Path, path: Path) -> Path:
    """``podman save --format oci-archive``: the layout's files at the top of a tar."""
    with tarfile.open(path, "w") as tar:
        for p in sorted(root.rglob("*")):
            tar.add(p, arcname=str(p.relative_to(root)), recursive=False)
    return path


# --------------------------------------------------------------------------- inspecting results


@dataclass(frozen=True)
class Entry:
    kind: int
    mode: int
    uid: int
    gid: int
    mtime: int | None  # not for dirs: implied parent dirs get the import time
    data: bytes | None  # file content or symlink target
    xattrs: dict[str, bytes]
    ino: int = field(compare=False)


def walk(root: Path) -> dict[str, Entry]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            kind = stat.S_IFMT(st.st_mode)
            data = None
            if kind == stat.S_IFREG:
                data = Path(path).read_bytes()
            elif kind == stat.S_IFLNK:
                data = os.readlink(path).encode()
            xattrs = {
                k: os.getxattr(path, k, follow_symlinks=False)
                for k in os.listxattr(path, follow_symlinks=False)
                if k.startswith("user.")
            }
            mtime = None if kind == stat.S_IFDIR else int(st.st_mtime)
            rel = os.path.relpath(path, root)
            out[rel] = Entry(kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, mtime, data, xattrs, st.st_ino)
    return out


async def mounted_tree(store: LayerStore, manifest: ImageManifest, mnt: Path) -> dict[str, Entry]:
    async with mounted_layers(store.layer_paths(manifest), mnt) as root:
        return walk(root)


def assert_clean(store: LayerStore) -> None:
    assert list(store.tmp_dir.iterdir()) == [], "staging left behind"


# --------------------------------------------------------------------------- refs


def test_normalise_ref() -> None:
    assert normalise_ref("docker.io/library/python:3.11") == "library/python:3.11"
    assert normalise_ref("localhost/foo:1") == "foo:1"
    assert normalise_ref("registry.example.com:5000/Team/App:V2") == "team/app:V2"
    assert normalise_ref("localhost:5000/x") == "x:latest"
    assert normalise_ref("busybox") == "busybox:latest"
    assert normalise_ref("library/alpine:3@sha256:" + "0" * 64) == "library/alpine:3"
    for bad in ("", "docker.io/", "a b:1", "x:bad tag"):
        with pytest.raises(InvalidRefError):
            normalise_ref(bad)


# --------------------------------------------------------------------------- docker save


@needs_root
async def test_docker_save_import(tmp_path: Path) -> None:
    layers = stack_layers()
    config = image_config(layers, Env=["PATH=/usr/bin:/bin", "LANG=C.UTF-8", "EMPTY="], WorkingDir="/work", User="1000")
    archive = docker_save(
        tmp_path / "save.tar",
        [DockerImage(["docker.io/library/demo:1.0"], layers, config, gzip_layers={3})],
    )
    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)
    stages: list[tuple[str, float]] = []
    m = await import_image(store, archive, merge_below=0, progress=lambda s, f: stages.append((s, f)))

    assert m.ref == "library/demo:1.0" and store.resolve("library/demo:1.0") == m
    assert [layer.kind for layer in m.layers] == ["base", "layer", "layer", "layer"]
    assert m.env == {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "EMPTY": ""}
    assert (m.workdir, m.user) == ("/work", "1000")
    blob_digests = [sha(layer) for layer in layers[:3]] + [sha(gzip.compress(layers[3], mtime=0))]
    recipe = json.loads(m.recipe)
    assert recipe == {"imported_from": str(archive), "oci_layers": blob_digests, "config_digest": sha(config)}
    for layer, digest in zip(m.layers, blob_digests, strict=True):
        assert digest in layer.description
    fractions = [f for _, f in stages]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert_clean(store)

    tree = await mounted_tree(store, m, tmp_path / "mnt")
    check_stack(tree)
    # Each layer on its own: the bottom one has no whiteouts (nothing below to hide).
    async with mounted_layers([store.layer_path(m.layers[0].digest)], tmp_path / "base") as base:
        assert (base / "etc/remove-me").read_text() == "bye"
        assert (base / "opt/old/a").is_file()
    async with mounted_layers([store.layer_path(m.layers[1].digest)], tmp_path / "second") as second:
        st = os.lstat(second / "etc/remove-me")
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0
        assert os.getxattr(second / "opt", "trusted.overlay.opaque") == b"y"
        assert os.stat(second / "etc").st_mtime == MTIME


@needs_root
async def test_merging_keeps_visible_content(tmp_path: Path) -> None:
    archive = docker_save(tmp_path / "save.tar", [DockerImage(["stack:1"], stack_layers())])
    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)
    trees = {}
    for merge_below, n_layers in ((0, 4), (32 * KIB, 2), (2**30, 1)):
        m = await import_image(store, archive, f"stack:m{merge_below}", merge_below=merge_below)
        assert len(m.layers) == n_layers, merge_below
        trees[merge_below] = await mounted_tree(store, m, tmp_path / f"mnt-{merge_below}")
        check_stack(trees[merge_below])
    assert trees[0] == trees[32 * KIB] == trees[2**30]
    merged = store.resolve("stack:m32768")
    assert merged.layers[0].kind == "base" and merged.layers[1].description.count("sha256:") == 3
    assert_clean(store)


@needs_root
async def test_ref_selection(tmp_path: Path) -> None:
    one = [layer_tar(file_("which", "one"))]
    two = [layer_tar(file_("which", "two"))]
    archive = docker_save(
        tmp_path / "two.tar",
        [DockerImage(["localhost/one:1"], one), DockerImage(["quay.io/org/two:2", "two:latest"], two)],
        blobs=True,
    )
    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)
    with pytest.raises(OciRefError, match="holds 2 images"):
        await import_image(store, archive)
    with pytest.raises(OciRefError, match="no image .* match 'three:latest'"):
        await import_image(store, archive, "three")
    m = await import_image(store, archive, "docker.io/org/two:2")
    assert m.ref == "org/two:2"
    assert (await mounted_tree(store, m, tmp_path / "mnt"))["which"].data == b"two"
    assert (await import_image(store, archive, "two")).ref == "two:latest"

    unnamed = docker_save(tmp_path / "unnamed.tar", [DockerImage(None, one)])
    with pytest.raises(OciRefError, match="pass a ref") as err:
        await import_image(store, unnamed)
    assert isinstance(err.value, InvalidRefError)
    assert (await import_image(store, unnamed, "named:1")).ref == "named:1"
    assert_clean(store)


# --------------------------------------------------------------------------- OCI layouts


@needs_root
async def test_oci_layout_dir(tmp_path: Path) -> None:
    layers = stack_layers()
    layout = tmp_path / "layout"
    desc = oci_manifest(layout, layers)
    desc["annotations"] = {"org.opencontainers.image.ref.name": "registry.example.com:5000/team/app:v2"}
    oci_layout(layout, [desc])
    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)
    m = await import_image(store, layout)  # default merge_below: all four layers are small
    assert m.ref == "team/app:v2" and len(m.layers) == 1
    manifest = json.loads((layout / "blobs/sha256" / desc["digest"][7:]).read_bytes())
    assert json.loads(m.recipe)["oci_layers"] == [d["digest"] for d in manifest["layers"]]
    check_stack(await mounted_tree(store, m, tmp_path / "mnt"))
    assert_clean(store)


@needs_root
async def test_oci_archive_selects_image_and_platform(tmp_path: Path) -> None:
    layout = tmp_path / "layout"
    alpha = oci_manifest(layout, [layer_tar(file_("which", "alpha"))])
    foreign = oci_manifest(layout, [layer_tar(file_("which", "foreign platform"))])
    attestation = oci_manifest(layout, [layer_tar(file_("which", "attestation"))])
    other_arch = "s390x" if HOST_ARCH != "s390x" else "riscv64"
    index = {
        "schemaVersion": 2,
        "mediaType": INDEX_V1,
        "manifests": [
            {**foreign, "platform": {"os": "linux", "architecture": other_arch}},
            {**attestation, "platform": {"os": "unknown", "architecture": "unknown"}},
            {**alpha, "platform": {"os": "linux", "architecture": HOST_ARCH}},
        ],
    }
    alpha_index = {"mediaType": INDEX_V1, **_write_blob(layout, json.dumps(index).encode())}
    alpha_index["annotations"] = {
        "io.containerd.image.name": "docker.io/library/alpha:1",
        "org.opencontainers.image.ref.name": "1",
    }
    beta = oci_manifest(layout, [layer_tar(file_("which", "beta"))], compress="none")
    beta["annotations"] = {"org.opencontainers.image.ref.name": "beta"}  # a bare tag, as the OCI spec suggests
    archive = tar_dir(oci_layout(layout, [alpha_index, beta]), tmp_path / "oci-archive.tar")

    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)
    with pytest.raises(OciRefError, match="holds 2 images"):
        await import_image(store, archive)
    m = await import_image(store, archive, "library/alpha:1")
    assert (await mounted_tree(store, m, tmp_path / "a"))["which"].data == b"alpha"
    m = await import_image(store, archive, "mine:beta")  # matched by the bare ref.name tag
    assert m.ref == "mine:beta"
    assert (await mounted_tree(store, m, tmp_path / "b"))["which"].data == b"beta"

    only_beta = tar_dir(oci_layout(layout, [beta]), tmp_path / "beta.tar")
    with pytest.raises(OciRefError, match="no usable name"):
        await import_image(store, only_beta)
    assert_clean(store)


@needs_root
async def test_zstd_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if shutil.which("zstd") is None:
        pytest.skip("no zstd tool")
    layout = tmp_path / "layout"
    desc = oci_manifest(layout, stack_layers(), compress="zstd")
    oci_layout(layout, [desc])
    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)
    m = await import_image(store, layout, "zstd:1", merge_below=0)
    check_stack(await mounted_tree(store, m, tmp_path / "mnt"))

    monkeypatch.setitem(sys.modules, "zstandard", None)  # makes `import zstandard` fail
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)
    with pytest.raises(OciImportError, match="zstd-compressed: install"):
        await import_image(store, layout, "zstd:2")
    assert_clean(store)


# --------------------------------------------------------------------------- broken archives


def _corrupt_layer_blob(layout: Path, desc: dict[str, Any]) -> None:
    manifest = json.loads((layout / "blobs/sha256" / desc["digest"][7:]).read_bytes())
    blob = layout / "blobs/sha256" / manifest["layers"][0]["digest"][7:]
    blob.write_bytes(blob.read_bytes().replace(b"payload", b"PAYLOAD"))  # still a valid tar


def _drop_layer_blob(layout: Path, desc: dict[str, Any]) -> None:
    manifest = json.loads((layout / "blobs/sha256" / desc["digest"][7:]).read_bytes())
    (layout / "blobs/sha256" / manifest["layers"][0]["digest"][7:]).unlink()


def _corrupt_config(layout: Path, desc: dict[str, Any]) -> None:
    manifest = json.loads((layout / "blobs/sha256" / desc["digest"][7:]).read_bytes())
    config = layout / "blobs/sha256" / manifest["config"]["digest"][7:]
    config.write_bytes(config.read_bytes().replace(b"linux", b"LINUX"))


@needs_root
@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (_corrupt_layer_blob, "has digest sha256:.*the archive is corrupt"),
        (_drop_layer_blob, "is missing from"),
        (_corrupt_config, "image config sha256:.* has digest"),
    ],
)
async def test_broken_oci_layout(
    tmp_path: Path, breakage: Callable[[Path, dict[str, Any]], None], message: str
) -> None:
    layout = tmp_path / "layout"
    desc = oci_manifest(layout, [layer_tar(file_("f", "payload")), layer_tar(file_("g", "x"))], compress="none")
    oci_layout(layout, [desc])
    breakage(layout, desc)
    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)
    with pytest.raises(OciImportError, match=message):
        await import_image(store, layout, "broken:1")
    with pytest.raises(ImageNotFoundError):
        store.resolve("broken:1")
    assert_clean(store)


@needs_root
async def test_broken_archives(tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)
    layer = layer_tar(file_("f", "payload"))

    # docker save: the layer does not match the config's diff_id
    image = DockerImage(["bad:1"], [layer], image_config([layer_tar(file_("f", "other"))]))
    with pytest.raises(OciImportError, match="unpacks to sha256:.*config says"):
        await import_image(store, docker_save(tmp_path / "diffid.tar", [image]))
    # docker save (Docker >= 25): a blob that does not match its name
    path = docker_save(tmp_path / "blobs.tar", [DockerImage(["bad:2"], [layer])], blobs=True)
    data = path.read_bytes().replace(b"payload", b"PAYLOAD")
    (tmp_path / "blobs-bad.tar").write_bytes(data)
    with pytest.raises(OciImportError, match="has digest"):
        await import_image(store, tmp_path / "blobs-bad.tar")
    # a docker save whose manifest points outside the archive
    with tarfile.open(tmp_path / "escape.tar", "w") as tar:
        _add(tar, "manifest.json", json.dumps([{"Config": "../x.json", "RepoTags": None, "Layers": []}]).encode())
    with pytest.raises(OciImportError, match="leaves the archive"):
        await import_image(store, tmp_path / "escape.tar", "x:1")

    (tmp_path / "junk").write_bytes(os.urandom(4096))
    with pytest.raises(OciImportError, match="neither a tar archive"):
        await import_image(store, tmp_path / "junk", "x:1")
    (tmp_path / "empty-dir").mkdir()
    with pytest.raises(OciImportError, match="neither a docker save archive"):
        await import_image(store, tmp_path / "empty-dir", "x:1")
    with pytest.raises(OciImportError, match="no such file"):
        await import_image(store, tmp_path / "nope.tar", "x:1")

    layout = tmp_path / "layout"
    desc = oci_manifest(layout, [layer], layer_type="application/vnd.oci.image.layer.v1.tar+encrypted")
    oci_layout(layout, [desc])
    with pytest.raises(OciImportError, match="unsupported layer media type"):
        await import_image(store, layout, "x:1")
    oci_layout(layout, [{**desc, "size": desc["size"] + 1}])
    with pytest.raises(OciImportError, match="expected"):
        await import_image(store, layout, "x:1")
    oci_layout(layout, [{**desc, "digest": "sha512:" + "0" * 128}])
    with pytest.raises(OciImportError, match="unsupported digest algorithm"):
        await import_image(store, layout, "x:1")

    big_uid = layer_tar(file_("f", "x", uid=70000))
    with pytest.raises(OciImportError, match="owned by 70000"):
        await import_image(store, docker_save(tmp_path / "uid.tar", [DockerImage(["uid:1"], [big_uid])]))
    truncated = DockerImage(["cut:1"], [layer], gzip_layers={0})
    path = docker_save(tmp_path / "cut.tar", [truncated], blobs=True)
    blob = gzip.compress(layer, mtime=0)
    (tmp_path / "cut-bad.tar").write_bytes(path.read_bytes().replace(blob, blob[:-20] + bytes(20)))
    with pytest.raises(OciImportError, match="layer sha256:"):
        await import_image(store, tmp_path / "cut-bad.tar")
    assert store.list_images() == []
    assert_clean(store)


@needs_root
async def test_tar_quirks(tmp_path: Path) -> None:
    """``./``-prefixed names and a root entry, aufs metadata, duplicate entries, and overlay xattrs
    in the tar (ignored: only whiteout entries make opaque dirs)."""
    base = layer_tar(dir_("./", mode=0o750), dir_("./etc"), file_("./etc/x", "x"), dir_("keep"), file_("keep/a", "a"))
    upper = layer_tar(
        dir_("keep", trusted_overlay_opaque="y", user_note="kept"),
        file_("keep/b", "b"),
        dir_(".wh..wh.plnk"),
        file_(".wh..wh.plnk/123.456", "aufs hard link store"),
        file_("dup", "first"),
        file_("dup", "second", mode=0o600),
    )
    archive = docker_save(tmp_path / "save.tar", [DockerImage(["quirks:1"], [base, upper])])
    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)
    m = await import_image(store, archive, merge_below=0)
    async with mounted_layers(store.layer_paths(m), tmp_path / "mnt") as root:
        tree = walk(root)
        root_mode = stat.S_IMODE(os.stat(root).st_mode)
    assert root_mode == 0o755, "the top layer's root (implied) wins, as in docker"
    assert tree["etc/x"].data == b"x"
    assert sorted(p for p in tree if p.startswith("keep/")) == ["keep/a", "keep/b"]
    assert tree["keep"].xattrs == {"user.note": b"kept"}
    assert not any(".wh." in p for p in tree)
    assert (tree["dup"].data, tree["dup"].mode) == (b"second", 0o600)
    async with mounted_layers(store.layer_paths(m)[:1], tmp_path / "base") as root:
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o750


@needs_root
async def test_cancel_removes_staging(tmp_path: Path) -> None:
    layers = [layer_tar(*(file_(f"d{i}/f{j}", "x") for i in range(20) for j in range(50))) for _ in range(3)]
    archive = docker_save(tmp_path / "save.tar", [DockerImage(["slow:1"], layers)])
    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)

    def cancel_in_second_layer(stage: str, fraction: float) -> None:
        if stage.startswith("layer 2/"):
            task.cancel()  # lands while layer 2 unpacks in a thread, with layer 1 maybe still packing

    task = asyncio.create_task(import_image(store, archive, merge_below=0, progress=cancel_in_second_layer))
    with pytest.raises(asyncio.CancelledError):
        await task
    assert_clean(store)
    assert store.list_images() == []


# --------------------------------------------------------------------------- unsafe layers


def _escapes(outside: Path) -> list[tuple[str, list[Member]]]:
    o = str(outside)
    return [
        ("dotdot", [file_("../escaped", "x")]),
        ("dotdot-inner", [dir_("a"), file_("a/../../escaped", "x")]),
        ("absolute", [file_(f"{o}/escaped", "x")]),
        ("file-through-symlink", [link("evil", o), file_("evil/escaped", "x")]),
        ("dir-through-symlink", [link("evil", o), dir_("evil/escaped")]),
        ("nested-through-symlink", [link("evil", o), file_("evil/sub/escaped", "x")]),
        ("whiteout-through-symlink", [link("evil", o), whiteout("evil/victim")]),
        ("opaque-through-symlink", [link("evil", o), opaque("evil")]),
        ("hardlink-dotdot", [hardlink("h", "../victim")]),
        ("hardlink-through-symlink", [link("evil", o), hardlink("h", "evil/victim")]),
        ("hardlink-absolute", [hardlink("h", f"{o}/victim")]),
    ]


@needs_root
async def test_unsafe_layers_are_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("precious")
    before = walk(outside)
    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)
    for label, members in _escapes(outside):
        good = layer_tar(file_("ok", "ok"))
        archive = docker_save(tmp_path / f"{label}.tar", [DockerImage([f"evil:{label}"], [good, layer_tar(*members)])])
        with pytest.raises(OciImportError, match="absolute|leaves the layer|refusing|not a file of this layer"):
            await import_image(store, archive, merge_below=0)
        assert walk(outside) == before, f"{label}: wrote outside the staging dir"
        assert (outside / "victim").read_text() == "precious"
        assert_clean(store)
    assert store.list_images() == []


@needs_root
async def test_entry_replacing_symlink_is_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("precious")
    layer = layer_tar(link("x", str(outside / "victim")), file_("x", "replaced"), hardlink("y", "x"))
    archive = docker_save(tmp_path / "save.tar", [DockerImage(["replace:1"], [layer])])
    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)
    m = await import_image(store, archive)
    tree = await mounted_tree(store, m, tmp_path / "mnt")
    assert tree["x"].data == b"replaced" and tree["y"].data == b"replaced"
    assert (outside / "victim").read_text() == "precious"


# --------------------------------------------------------------------------- unsafe archives


@contextlib.contextmanager
def fifo_unblocker(fifo: Path, after: float = 5.0) -> Iterator[None]:
    """Should an import open() the FIFO (the bug), that blocks until a writer comes: open the write
    end after a while, so such a test fails instead of hanging."""
    done = threading.Event()

    def unblock() -> None:
        while not done.wait(after):
            with contextlib.suppress(OSError):  # ENXIO: no reader waiting (yet)
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    thread = threading.Thread(target=unblock, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _layout_blob_names(layout: Path, desc: dict[str, Any]) -> tuple[str, list[str]]:
    manifest = json.loads((layout / "blobs/sha256" / desc["digest"][7:]).read_bytes())
    return manifest["config"]["digest"][7:], [d["digest"][7:] for d in manifest["layers"]]


def docker_save_dir(root: Path, layer_paths: list[str], config: dict[str, Any], tags: list[str]) -> Path:
    """An unpacked legacy ``docker save``: the caller puts the layer files at ``layer_paths``."""
    root.mkdir(parents=True)
    raw = json.dumps(config).encode()
    cfg_name = sha(raw)[7:] + ".json"
    (root / cfg_name).write_bytes(raw)
    (root / "manifest.json").write_text(json.dumps([{"Config": cfg_name, "RepoTags": tags, "Layers": layer_paths}]))
    return root


@needs_root
async def test_archive_dir_symlinks_and_fifos_are_refused(tmp_path: Path) -> None:
    """An OCI layout or unpacked docker save is read only beneath its directory: a member that is
    a symlink (even to a file of the right content) or a FIFO, or reached through a symlinked dir,
    is refused, so the daemon never reads host files for the caller nor blocks on a FIFO."""
    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "backup.tar").write_bytes(layer_tar(file_("shadow", "root:$6$secret")))

    # docker save without diff_ids (allowed) whose layer.tar points at a host file
    save = docker_save_dir(tmp_path / "save", ["abc/layer.tar"], {"os": "linux", "config": {}}, ["leak:1"])
    (save / "abc").mkdir()
    (save / "abc/layer.tar").symlink_to("../../secret/backup.tar")
    with pytest.raises(OciImportError, match=r"abc/layer.tar in .* is a symlink"):
        await import_image(store, save)
    # ... or through a symlinked directory
    (save / "abc/layer.tar").unlink()
    (save / "abc").rmdir()
    (save / "abc").symlink_to(secret)
    (secret / "layer.tar").write_bytes((secret / "backup.tar").read_bytes())
    with pytest.raises(OciImportError, match=r"abc in .* is a symlink, not a directory; refusing"):
        await import_image(store, save)
    # the same archive with a real layer.tar imports
    (save / "abc").unlink()
    (save / "abc").mkdir()
    (save / "abc/layer.tar").write_bytes(layer_tar(file_("f", "fine")))
    m = await import_image(store, save)
    assert (await mounted_tree(store, m, tmp_path / "mnt"))["f"].data == b"fine"

    # OCI layout: a blob that is a symlink to a host file, even one with the very digest
    layout = tmp_path / "layout"
    layer = layer_tar(file_("f", "payload"))
    desc = oci_manifest(layout, [layer], compress="none")
    oci_layout(layout, [desc])
    _, (layer_hex,) = _layout_blob_names(layout, desc)
    blob = layout / "blobs/sha256" / layer_hex
    outside = secret / "same-content"
    outside.write_bytes(layer)
    blob.unlink()
    blob.symlink_to(outside)
    with pytest.raises(OciImportError, match=r"blobs/sha256/[0-9a-f]+ in .* is a symlink"):
        await import_image(store, layout, "leak:2")
    # the metadata files too
    index = (layout / "index.json").read_bytes()
    (outside.parent / "index.json").write_bytes(index)
    (layout / "index.json").unlink()
    (layout / "index.json").symlink_to(outside.parent / "index.json")
    with pytest.raises(OciImportError, match=r"index.json in .* is a symlink"):
        await import_image(store, layout, "leak:3")
    (layout / "index.json").unlink()
    (layout / "index.json").write_bytes(index)

    # a FIFO in place of a blob: refused at once, not a thread blocked forever
    blob.unlink()
    os.mkfifo(blob)
    with fifo_unblocker(blob), pytest.raises(OciImportError, match=r"is a FIFO"):
        await asyncio.wait_for(import_image(store, layout, "fifo:1"), 60)
    assert [m.ref for m in store.list_images()] == ["leak:1"]
    assert_clean(store)


async def test_archive_source_must_be_file_or_dir(tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)
    fifo = tmp_path / "image.tar"
    os.mkfifo(fifo)
    with fifo_unblocker(fifo), pytest.raises(OciImportError, match=r"image.tar is a FIFO; an image is a tar archive"):
        await asyncio.wait_for(import_image(store, fifo, "x:1"), 60)
    # the path itself must not be a symlink: it is opened once, and that is what gets imported
    real = docker_save(tmp_path / "real.tar", [DockerImage(["x:1"], [layer_tar(file_("f", "x"))])])
    (tmp_path / "link.tar").symlink_to(real)
    with pytest.raises(OciImportError, match="link.tar is a symlink"):
        await import_image(store, tmp_path / "link.tar")
    with pytest.raises(OciImportError, match="no such file"):
        await import_image(store, tmp_path / "nope/x.tar")
    assert_clean(store)


@needs_root
async def test_import_within_dirs(tmp_path: Path) -> None:
    """``within`` is checked on the opened file: a path that resolves elsewhere is refused."""
    allowed, other = tmp_path / "allowed", tmp_path / "other"
    allowed.mkdir()
    other.mkdir()
    archive = docker_save(other / "save.tar", [DockerImage(["in:1"], [layer_tar(file_("f", "x"))])])
    (allowed / "via").symlink_to(other)  # a symlinked dir on the way: followed, then checked
    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)
    with pytest.raises(OciImportError, match="is not under any of"):
        await import_image(store, allowed / "via/save.tar", within=[allowed])
    shutil.move(archive, allowed / "save.tar")
    assert (await import_image(store, allowed / "save.tar", within=[allowed])).ref == "in:1"
    assert_clean(store)


# --------------------------------------------------------------------------- resource caps


@needs_root
async def test_caps(tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)

    def archive(name: str, *layers: bytes, gzip_layers: set[int] | None = None) -> Path:
        image = DockerImage([f"{name}:1"], list(layers), gzip_layers=gzip_layers or set())
        return docker_save(tmp_path / f"{name}.tar", [image])

    many = archive("many", layer_tar(*(file_(f"f{i}", "x") for i in range(20))))
    with pytest.raises(OciImportError, match="has more than 10 entries"):
        await import_image(store, many, max_layer_entries=10)
    await import_image(store, many, max_layer_entries=20)

    # counted uncompressed: 10 MiB of zeros gzip to ~10 KiB
    bomb = archive("bomb", layer_tar(file_("zeros", bytes(10 << 20))), gzip_layers={0})
    assert bomb.stat().st_size < 100 * KIB
    with pytest.raises(OciImportError, match=r"unpacks to more than 1048576 bytes \(max_layer_bytes\)"):
        await import_image(store, bomb, max_layer_bytes=1 << 20)

    two = archive("two", layer_tar(file_("a", os.urandom(30 * KIB))), layer_tar(file_("b", os.urandom(30 * KIB))))
    with pytest.raises(OciImportError, match=r"the image unpacks to more than 65536 bytes \(max_import_bytes\)"):
        await import_image(store, two, max_layer_bytes=64 * KIB, max_import_bytes=64 * KIB)
    await import_image(store, two, max_layer_bytes=64 * KIB, max_import_bytes=128 * KIB)

    # after the end-of-archive marker: some padding is fine, megabytes of it are not
    padded = archive("padded", layer_tar(file_("f", "x")) + bytes(64 * KIB))
    await import_image(store, padded)
    junk = archive("junk", layer_tar(file_("f", "x")) + b"\x01" * (2 << 20))
    with pytest.raises(OciImportError, match="bytes of data after the end of the tar archive"):
        await import_image(store, junk)
    assert sorted(m.ref for m in store.list_images()) == ["many:1", "padded:1", "two:1"]
    assert_clean(store)


@needs_root
async def test_tar_headers_are_bounded(tmp_path: Path) -> None:
    """tarfile reads extension headers into memory whole and sparse maps without bound: capped/refused."""
    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)
    big_xattr = layer_tar(file_("f", "x", user_big="a" * (9 << 20)))
    path = docker_save(tmp_path / "hdr.tar", [DockerImage(["hdr:1"], [big_xattr])])
    with pytest.raises(OciImportError, match="tar extension header of"):
        await import_image(store, path)
    info, body = file_("sparse", "x")
    info.pax_headers = {"GNU.sparse.map": "0,1", "GNU.sparse.size": "1", "GNU.sparse.name": "sparse"}
    path = docker_save(tmp_path / "sparse.tar", [DockerImage(["sparse:1"], [layer_tar((info, body))])])
    with pytest.raises(OciImportError, match="'sparse' is a sparse file entry"):
        await import_image(store, path)
    assert_clean(store)


@needs_root
async def test_stream_members_are_not_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a layer must not keep a TarInfo per entry (tarfile's stream mode does by default)."""
    layout = tmp_path / "layout"  # a directory: no outer tar, whose members are rightly kept
    oci_layout(layout, [oci_manifest(layout, [layer_tar(*(file_(f"f{i}", "x") for i in range(500)))])])
    kept: list[int] = []
    real_next = tarfile.TarFile.next

    def spy(self: tarfile.TarFile) -> tarfile.TarInfo | None:
        kept.append(len(self.members))  # type: ignore[attr-defined]
        return real_next(self)

    monkeypatch.setattr(tarfile.TarFile, "next", spy)
    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)
    await import_image(store, layout, "many:1")
    assert len(kept) > 500 and max(kept) <= 1


# --------------------------------------------------------------------------- host errors


@needs_root
async def test_host_errors_are_not_the_archives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk while unpacking is the host's trouble (the daemon's `internal`), not an
    OciImportError (`invalid_argument`); a name the filesystem can't hold is the archive's."""
    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)
    long_name = docker_save(tmp_path / "long.tar", [DockerImage(["long:1"], [layer_tar(file_("x" * 300, "y"))])])
    with pytest.raises(OciImportError, match="cannot unpack 'x+'"):
        await import_image(store, long_name)

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shutil, "copyfileobj", full)
    archive = docker_save(tmp_path / "ok.tar", [DockerImage(["ok:1"], [layer_tar(file_("f", "x"))])])
    with pytest.raises(OSError) as err:
        await import_image(store, archive)
    assert err.value.errno == errno.ENOSPC and not isinstance(err.value, OciImportError)
    assert store.list_images() == []
    assert_clean(store)


# --------------------------------------------------------------------------- gc during an import


@needs_root
async def test_gc_during_import_keeps_its_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers of an import in progress are named by no manifest: their fresh mtime keeps gc off.
    The first layer is made to look long stored (as when an identical layer existed before,
    whose file add_layer_from_dir keeps as it is)."""
    layers = [layer_tar(file_(f"f{i}", str(i))) for i in range(3)]
    archive = docker_save(tmp_path / "save.tar", [DockerImage(["gc:1"], layers)])
    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)
    real_add = store.add_layer_from_dir
    long_ago = time.time() - 3600

    async def add_as_if_stored_long_ago(*args: Any, **kwargs: Any) -> LayerRef:
        ref = await real_add(*args, **kwargs)
        if "base" in kwargs.values():
            os.utime(store.layer_path(ref.digest), (long_ago, long_ago))
        return ref

    removed: list[str] = []

    def gc_when_unpacking_the_last(stage: str, fraction: float) -> None:
        if stage.startswith("layer 3/3"):  # layer 1 is packed by now (layer 2's group waited for it)
            removed.extend(store.gc(set(), min_age=600)[0])

    monkeypatch.setattr(store, "add_layer_from_dir", add_as_if_stored_long_ago)
    m = await import_image(store, archive, merge_below=0, progress=gc_when_unpacking_the_last)
    assert removed == [] and len(m.layers) == 3
    assert sorted(p for p in await mounted_tree(store, m, tmp_path / "mnt")) == ["f0", "f1", "f2"]

    # An import outlasting gc's min_age: its finished layers are refreshed while it runs.
    store = LayerStore(tmp_path / "store2", uid_base=UID_BASE)
    real_add = store.add_layer_from_dir
    added: list[str] = []

    async def recording_add(*args: Any, **kwargs: Any) -> LayerRef:
        ref = await real_add(*args, **kwargs)
        added.append(ref.digest)
        return ref

    real_unpack = oci_import._unpack_blob

    def slow_last_layer(src: Any, blob: Any, dest: Path, *args: Any) -> Any:
        if dest.name == "layer-2":  # the first layer is packed by now
            os.utime(store.layer_path(added[0]), (long_ago, long_ago))  # as if the import began long ago
            time.sleep(1.0)  # meanwhile the refresher runs
            removed.extend(store.gc(set(), min_age=600)[0])
        return real_unpack(src, blob, dest, *args)

    monkeypatch.setattr(store, "add_layer_from_dir", recording_add)
    monkeypatch.setattr(oci_import, "_LAYER_REFRESH_SECONDS", 0.02)
    monkeypatch.setattr(oci_import, "_unpack_blob", slow_last_layer)
    m = await import_image(store, archive, merge_below=0)
    assert removed == [] and [layer.digest for layer in m.layers] == added
    assert_clean(store)


# --------------------------------------------------------------------------- layer count


def _many_layers(n: int) -> list[bytes]:
    """n layers each overwriting ``shared``, adding ``l<i>``, whiting out ``l<i-5>`` and adding to
    ``d``, which every 7th layer makes opaque."""
    out = []
    for i in range(n):
        members = [file_("shared", str(i)), file_(f"l{i}", str(i)), dir_("d"), file_(f"d/{i}", str(i))]
        if i >= 5:
            members.append(whiteout(f"l{i - 5}"))
        if i % 7 == 0:
            members.append(opaque("d"))
        out.append(layer_tar(*members))
    return out


@needs_root
async def test_layer_count_is_capped(tmp_path: Path) -> None:
    archive = docker_save(tmp_path / "save.tar", [DockerImage(["many:1"], _many_layers(40))])
    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)
    trees = {}
    for max_layers in (32, 3, 1):
        m = await import_image(store, archive, f"many:{max_layers}", merge_below=0, max_layers=max_layers)
        assert len(m.layers) == max_layers
        # the bottom layers stay as they are; the top ones are merged into the last
        assert [layer.description.count("sha256:") for layer in m.layers] == [1] * (max_layers - 1) + [
            40 - max_layers + 1
        ]
        trees[max_layers] = await mounted_tree(store, m, tmp_path / f"m{max_layers}")
    tree = trees[1]
    assert tree["shared"].data == b"39"
    assert sorted(p for p in tree if p.startswith("l")) == [f"l{i}" for i in range(35, 40)]
    assert sorted(p for p in tree if p.startswith("d/")) == [f"d/{i}" for i in range(35, 40)]
    assert trees[32] == trees[3] == trees[1]

    # merge_below groups count too: small layers merge first, the cap applies to what is left
    m = await import_image(store, archive, "many:small", merge_below=2**30, max_layers=32)
    assert len(m.layers) == 1
    with pytest.raises(ValueError, match="max_layers"):
        await import_image(store, archive, "many:0", max_layers=0)
    assert_clean(store)


# --------------------------------------------------------------------------- real tools


def podman_save(workdir: Path, rootfs: bytes) -> list[Path]:
    """``podman import`` a rootfs tar and ``podman save`` it in both formats, offline, in a private
    store; skips the test if podman is missing or can't run here."""
    if shutil.which("podman") is None:
        pytest.skip("no podman")
    # podman limits the runroot path to 50 characters; pytest's tmp_path is longer.
    with tempfile.TemporaryDirectory(prefix="sf-podman-") as state:
        podman = ["podman", "--root", f"{state}/root", "--runroot", f"{state}/run", "--storage-driver", "vfs"]
        podman += ["--events-backend", "none", "--cgroup-manager", "cgroupfs"]
        (workdir / "rootfs.tar").write_bytes(rootfs)
        changes = ["--change", "ENV=GREETING=hi", "--change", "WORKDIR=/etc"]
        commands = [[*podman, "import", *changes, str(workdir / "rootfs.tar"), "localhost/podman-test:7"]]
        out = [workdir / f"{fmt}.tar" for fmt in ("docker-archive", "oci-archive")]
        commands += [[*podman, "save", "--format", p.stem, "-o", str(p), "localhost/podman-test:7"] for p in out]
        for argv in commands:
            r = subprocess.run(argv, capture_output=True, text=True)
            if r.returncode != 0:
                pytest.skip(f"podman cannot run here: {r.stderr[-300:]}")
    return out


@needs_root
async def test_podman_save_archives(tmp_path: Path) -> None:
    """Archives written by a real tool: a docker-archive and an oci-archive of the same image."""
    rootfs = layer_tar(dir_("etc"), file_("etc/hello", "from podman\n"), link("hello", "etc/hello"))
    archives = await asyncio.to_thread(podman_save, tmp_path, rootfs)
    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)
    for archive in archives:
        m = await import_image(store, archive)
        assert m.ref == "podman-test:7"
        assert m.env.get("GREETING") == "hi" and m.workdir == "/etc"
        tree = await mounted_tree(store, m, tmp_path / f"mnt-{archive.stem}")
        assert tree["etc/hello"].data == b"from podman\n" and tree["hello"].kind == stat.S_IFLNK
    assert_clean(store)


# --------------------------------------------------------------------------- through the daemon


def test_import_through_the_api_and_run_a_sandbox(daemon: Daemon, fleet: Client, tmp_path: Path) -> None:
    """`fleet.import_image` of a docker-save tarball: layers, whiteouts, precedence and the config's
    env and workdir all hold in a real sandbox."""
    busybox = Path("/bin/busybox").read_bytes()
    tools = [link(f"bin/{name}", "busybox") for name in ("sh", "cat", "ls", "pwd", "test")]
    base = layer_tar(
        dir_("bin"), file_("bin/busybox", busybox, mode=0o755), *tools,
        dir_("etc"), file_("etc/motd", "base"), file_("etc/gone", "x"), dir_("srv"), dir_("srv/app"),
        file_("srv/app/old", "old"),
    )  # fmt: skip
    top = layer_tar(file_("etc/motd", "top"), whiteout("etc/gone"), opaque("srv/app"), file_("srv/app/new", "new"))
    config = image_config([base, top], Env=["GREETING=hello", "PATH=/bin"], WorkingDir="/srv/app")
    archive = docker_save(tmp_path / "app.tar", [DockerImage(["example.com/team/app:2"], [base, top], config)])
    info = fleet.import_image(str(archive))
    try:
        assert (info.name, info.tag) == ("team/app", "2")
        with fleet.create(image="team/app:2") as sb:
            assert (
                sb.exec("cat /etc/motd; echo; echo $GREETING; pwd; ls /srv/app").stdout == "top\nhello\n/srv/app\nnew\n"
            )
            assert sb.exec("test -e /etc/gone").exit_code == 1
        with pytest.raises(InvalidArgumentError):
            fleet.import_image(str(tmp_path / "missing.tar"))
        (tmp_path / "junk.tar").write_bytes(b"not a tar")
        with pytest.raises(InvalidArgumentError, match="cannot import"):
            fleet.import_image(str(tmp_path / "junk.tar"))
    finally:
        fleet.delete_image("team/app:2")


def test_import_dirs_limit_where_archives_come_from(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the container tier needs root")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    d = make_daemon("imports", f'import_dirs = ["{allowed}"]\n')
    try:
        d.start()
        layer = layer_tar(dir_("etc"), file_("etc/motd", "hi"))
        outside = docker_save(tmp_path / "outside.tar", [DockerImage(["t/imp:1"], [layer])])
        (allowed / "link.tar").symlink_to(outside)  # a way out through a symlink is no way out
        with d.client() as fleet:
            for path in (outside, allowed / "link.tar"):
                with pytest.raises(InvalidArgumentError):
                    fleet.import_image(str(path))
            inside = docker_save(allowed / "inside.tar", [DockerImage(["t/imp:1"], [layer])])
            info = fleet.import_image(str(inside))
            assert (info.name, info.tag) == ("t/imp", "1")
            fleet.delete_image("t/imp:1")
    finally:
        destroy_daemon(d)


@needs_root
async def test_deep_paths_link_loops_and_bad_config_values(tmp_path: Path) -> None:
    """Trees deeper than MAX_PATH_DEPTH and archives whose links loop are refused cleanly; config
    values no sandbox spec accepts are dropped from the defaults instead of poisoning the image."""
    store = LayerStore(tmp_path / "store", uid_base=UID_BASE)
    deep = "/".join(["d"] * 300)
    archive = docker_save(tmp_path / "deep.tar", [DockerImage(["deep:1"], [layer_tar(file_(f"{deep}/f", "x"))])])
    with pytest.raises(OciImportError, match="deeper than"):
        await import_image(store, archive)
    loop = tmp_path / "loop.tar"
    with tarfile.open(loop, "w") as tar:
        for name, target in (("manifest.json", "x"), ("x", "manifest.json")):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    with pytest.raises(OciImportError):
        await import_image(store, loop, "loop:1")
    assert_clean(store)
    layer = layer_tar(dir_("etc"), file_("etc/motd", "hi"))
    config = image_config([layer], Env=["java.home=/opt/jdk", "OK=1"], WorkingDir="relative", User="not a user")
    m = await import_image(store, docker_save(tmp_path / "cfg.tar", [DockerImage(["cfg:1"], [layer], config)]))
    assert (m.env, m.workdir, m.user) == ({"OK": "1"}, None, None)
