"""Environments stacked from layers at create time, on-demand layers from a shared store, corrupt layers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandfleet import Client, DataLossError, ImageNotFoundError, InvalidArgumentError
from sandfleet.images import ImageNotFoundError as StoreImageNotFound
from sandfleet.images import LayerRef, LayerStore

from conftest import EXPECT, IMAGES, Daemon, destroy_daemon, make_daemon, wait_until
from leakcheck import residue


def _layer_of(fleet: Client, script: str, ref: str) -> str:
    """A one-off layer on busybox: what `script` changes, packed; returns the new layer's digest."""
    with fleet.create(image="busybox", labels={EXPECT: "system_binaries"}) as sb:  # scripts may replace /bin files
        res = sb.exec(script)
        assert res.exit_code == 0, res.stderr
        info = sb.pack(ref)
    LayerStore(IMAGES).remove_image(ref)  # the layer stays; only the digest is used below
    return info.layers[-1]


@pytest.fixture(scope="module")
def two_layers(daemon: Daemon) -> tuple[str, str]:
    with daemon.client() as fleet:
        low = _layer_of(fleet, "echo low > /etc/which && echo a > /only-low && rm /bin/vi", "t/low:1")
        high = _layer_of(fleet, "echo high > /etc/which && mkdir /high && echo b > /high/f", "t/high:1")
    return low, high


def test_layer_order_decides_precedence(fleet: Client, two_layers: tuple[str, str]) -> None:
    low, high = two_layers
    with fleet.create(image="busybox", layers=[low, high]) as sb:
        assert sb.exec("cat /etc/which /only-low /high/f").stdout == "high\na\nb\n"
        assert sb.exec("test -e /bin/vi").exit_code == 1  # low's whiteout still hides busybox's file
        assert sb.info.spec.environment() == f"busybox+{low}+{high}"
    with fleet.create(image="busybox", layers=[high, low]) as sb:
        assert sb.exec("cat /etc/which").stdout == "low\n"
    # The same layer twice keeps its first, lowest position (a base shared by two stacked images
    # stays under both): the stack is busybox, low, high.
    with fleet.create(image="busybox", layers=[low, high, low]) as sb:
        assert sb.exec("cat /etc/which").stdout == "high\n"
    # An image whose manifest repeats a layer (a recipe's no-op step, say) starts the same way.
    store = LayerStore(IMAGES)
    base = store.resolve("busybox").layers
    lo, hi = (LayerRef(digest=d, size=store.layer_path(d).stat().st_size, kind="layer") for d in (low, high))
    store.put_manifest("t/dup", "1", [*base, lo, *base, hi, lo])
    try:
        with fleet.create(image="t/dup:1") as sb:
            assert sb.exec("cat /etc/which").stdout == "high\n"
    finally:
        store.remove_image("t/dup:1")
    # More than 32 layers is refused up front.
    with pytest.raises(InvalidArgumentError, match="at most 32"):
        fleet.create(image="busybox", layers=[low, high] + [f"sha256:{i:064x}" for i in range(40)])


def test_layers_without_an_image_and_unknown_layers(fleet: Client, two_layers: tuple[str, str]) -> None:
    low, _ = two_layers
    busybox = next(i for i in fleet.images() if (i.name, i.tag) == ("busybox", "latest"))
    with fleet.create(layers=["busybox", low]) as sb:
        assert sb.info.spec.image is None
        assert sb.exec("cat /etc/which").stdout == "low\n"
    with fleet.create(layers=[*busybox.layers]) as sb:  # digests only
        assert sb.exec("test -e /etc/which").exit_code == 1
    with pytest.raises(ImageNotFoundError):
        fleet.create(image="busybox", layers=["sha256:" + "0" * 64])
    with pytest.raises(ImageNotFoundError):
        fleet.create(image="busybox", layers=["no/such-layer:1"])


def _admitted_memory(d: Daemon) -> float:
    """The admission's committed memory limits, from the daemon's /metrics."""
    import httpx

    with httpx.Client(transport=httpx.HTTPTransport(uds=str(d.socket))) as http:
        text = http.get("http://sandfleet/metrics").text
    return float(
        next(ln.split()[-1] for ln in text.splitlines() if ln.startswith("sandfleet_admission_memory_limits_bytes"))
    )


def test_image_defaults_apply_unless_the_spec_sets_them(daemon: Daemon, fleet: Client) -> None:
    store = LayerStore(IMAGES)
    base = store.resolve("busybox")
    base_env = {"GREETING": "hi", "PATH": "/bin:/sbin"}
    store.put_manifest("t/defaults", "1", base.layers, env=base_env, workdir="/tmp", user="nobody")
    try:
        with fleet.create(image="t/defaults:1") as sb:
            assert sb.exec("echo $GREETING; pwd; id -u").stdout == "hi\n/tmp\n65534\n"
        spec = {"env": {"GREETING": "yo", "TOKEN": "secret"}, "workdir": "/", "user": "root"}
        with fleet.create(image="t/defaults:1", labels={"agent": "a7"}, **spec) as sb:
            assert sb.exec("echo $GREETING; pwd; id -u").stdout == "yo\n/\n0\n"
            sb.pack("t/defaults-packed:1")
        # A packed image keeps its source image's defaults (not the caller's env) and records who built it.
        packed = store.resolve("t/defaults-packed:1")
        assert (packed.env, packed.workdir, packed.user) == (base_env, "/tmp", "nobody")
        assert json.loads(packed.recipe)["labels"] == {"agent": "a7"}
        # An imported image may carry defaults a spec could not: the create says so, and costs nothing.
        store.put_manifest("t/defaults", "2", base.layers, env={"java.home": "/opt/jdk"}, workdir="app")
        committed = fleet.health()["sandboxes_running"], _admitted_memory(daemon)
        for _ in range(3):
            with pytest.raises(InvalidArgumentError, match="defaults"):
                fleet.create(image="t/defaults:2")
        assert (fleet.health()["sandboxes_running"], _admitted_memory(daemon)) == committed  # no budget kept
        with fleet.create(image="t/defaults:1", workdir="/", user="root") as sb:  # the node is fine
            assert sb.exec("echo $GREETING").stdout == "hi\n"
    finally:
        store.remove_image("t/defaults:1")
        with contextlib.suppress(StoreImageNotFound):
            store.remove_image("t/defaults:2")
        with contextlib.suppress(StoreImageNotFound):
            store.remove_image("t/defaults-packed:1")


def test_corrupt_or_truncated_layer_is_data_loss_and_leaves_nothing(daemon: Daemon, fleet: Client) -> None:
    digest = _layer_of(fleet, "head -c 300000 /dev/urandom > /blob", "t/corrupt:1")
    path = IMAGES / "layers" / ("sha256-" + digest.removeprefix("sha256:") + ".erofs")
    assert wait_until(lambda: not residue(daemon).sandbox_ids)
    before = residue(daemon)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the content hash can tell
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    try:
        with pytest.raises(DataLossError, match="corrupt"):
            fleet.create(image="busybox", layers=[digest])
        path.write_bytes(bytes(data[: len(data) // 2]))  # truncated
        with pytest.raises(DataLossError):
            fleet.create(image="busybox", layers=[digest])
        after = residue(daemon)
        assert (after.mounts, after.cgroups, after.sandbox_dirs, after.processes) == (
            before.mounts,
            before.cgroups,
            before.sandbox_dirs,
            before.processes,
        )
        layer_mounts = [ln for ln in daemon.mountinfo().splitlines() if digest.removeprefix("sha256:") in ln]
        assert layer_mounts == []
    finally:
        path.unlink()


def test_bytes_flipped_in_place_after_verification_with_the_mtime_put_back_are_data_loss(
    daemon: Daemon, fleet: Client
) -> None:
    """The verification record must not be fooled by a writer that restores the mtime: the ctime
    changes anyway. Before, the create succeeded and reads of the flipped page died with SIGBUS."""
    digest = _layer_of(fleet, "head -c 300000 /dev/urandom > /blob", "t/flipped:1")
    path = IMAGES / "layers" / ("sha256-" + digest.removeprefix("sha256:") + ".erofs")
    hexdigest = digest.removeprefix("sha256:")
    try:
        with fleet.create(image="busybox", layers=[digest]) as sb:  # mounted, so hashed and stamped
            assert sb.exec("wc -c < /blob").stdout.strip() == "300000"
        assert LayerStore(IMAGES).is_verified(digest)
        assert wait_until(lambda: not residue(daemon).sandbox_ids)
        fleet.gc_images(min_age=1e9)  # unmounts unused layers; min_age keeps every file
        assert wait_until(lambda: hexdigest not in daemon.mountinfo())
        st = os.stat(path)
        os.chmod(path, 0o644)
        with open(path, "r+b") as f:  # in place: same inode, same size
            f.seek(st.st_size // 2)
            byte = f.read(1)
            f.seek(st.st_size // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
        os.chmod(path, 0o444)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert (os.stat(path).st_ino, os.stat(path).st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
        with pytest.raises(DataLossError, match="corrupt"):
            fleet.create(image="busybox", layers=[digest])
        assert hexdigest not in daemon.mountinfo()
    finally:
        path.unlink(missing_ok=True)


def _layer_file(digest: str, store: Path = IMAGES) -> Path:
    return store / "layers" / ("sha256-" + digest.removeprefix("sha256:") + ".erofs")


def _put_file(path: Path, data: bytes) -> None:
    """Replace `path` with a new file holding `data` (a new inode, as a copy or a fetch makes)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, 0o444)
    os.rename(tmp, path)


def test_a_layer_file_deleted_or_replaced_while_mounted_is_checked_before_reuse(own_daemon: Daemon) -> None:
    """A mounted layer's file deleted or replaced under the store: new creates do not reuse the mount
    blindly. Deleted: `data_loss` for an image naming it (`not_found` for a bare digest), before and
    after a restart alike; replaced by a corrupt copy: `data_loss`; by an intact copy: fine. A sandbox
    already running on the layer is unaffected, and a failed create leaves nothing."""
    d = own_daemon
    d.start()
    with d.client() as fleet:
        digest = _layer_of(fleet, "head -c 200000 /dev/urandom > /blob", "t/gone-src:1")
    store = LayerStore(IMAGES)
    path = _layer_file(digest)
    data = path.read_bytes()
    base = store.resolve("busybox").layers
    store.put_manifest("t/gone", "1", [*base, LayerRef(digest=digest, size=len(data), kind="layer")])

    def refused(fleet: Client) -> None:
        """An image naming the layer has lost it; a digest no image names is no layer at all."""
        for spec in ({"image": "t/gone:1"}, {"image": "busybox", "layers": [digest]}):
            with pytest.raises(DataLossError, match="missing"):
                fleet.create(**spec)  # type: ignore[arg-type]
        manifest = IMAGES / "images" / "t" / "gone" / "1.json"
        text = manifest.read_text()
        store.remove_image("t/gone:1")
        with pytest.raises(ImageNotFoundError):
            fleet.create(image="busybox", layers=[digest])
        manifest.parent.mkdir(parents=True, exist_ok=True)
        manifest.write_text(text)  # (put_manifest would refuse: the layer is gone)

    try:
        with d.client() as fleet:
            keep = fleet.create(image="t/gone:1")  # holds the layer's mount
            want = keep.exec("md5sum /blob").stdout
            assert len(want) > 32
            _put_file(path, data)  # an intact copy: checked again (hashed), then the mount is reused
            with fleet.create(image="t/gone:1") as sb:
                assert sb.exec("md5sum /blob").stdout == want
            assert wait_until(lambda: residue(d).sandbox_ids == (keep.id,))
            before = residue(d)
            flipped = bytearray(data)
            flipped[len(flipped) // 2] ^= 0xFF
            _put_file(path, bytes(flipped))  # a corrupt copy of the same size
            for spec in ({"image": "t/gone:1"}, {"image": "busybox", "layers": [digest]}):
                with pytest.raises(DataLossError, match="corrupt"):
                    fleet.create(**spec)  # type: ignore[arg-type]
            path.unlink()  # deleted
            refused(fleet)
            after = residue(d)
            assert (after.mounts, after.cgroups, after.sandbox_dirs, after.processes, after.sandbox_ids) == (
                before.mounts,
                before.cgroups,
                before.sandbox_dirs,
                before.processes,
                before.sandbox_ids,
            )
            assert keep.exec("md5sum /blob").stdout == want  # its mount holds the file it started with
        d.kill()
        d.start()
        with d.client() as fleet:
            assert fleet.get(keep.id).exec("md5sum /blob").stdout == want
            refused(fleet)  # the same answers as before the restart
            _put_file(path, data)  # put back: usable again
            with fleet.create(image="t/gone:1") as sb:
                assert sb.exec("md5sum /blob").stdout == want
            with fleet.create(image="busybox", layers=[digest]) as sb:
                assert sb.exec("md5sum /blob").stdout == want
                path.unlink()  # the other order: mounted by this daemon, then deleted
                refused(fleet)
            fleet.get(keep.id).stop()
    finally:
        with contextlib.suppress(StoreImageNotFound):
            store.remove_image("t/gone:1")
        path.unlink(missing_ok=True)


# -- on demand from a shared store ------------------------------------------------------------------


@pytest.fixture
def shared_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Path]]:
    if os.geteuid() != 0:
        pytest.skip("the container tier needs root")
    shared = tmp_path_factory.mktemp("shared-store")
    # A tiny local cache: every unused local copy of a shared layer goes at the next trim.
    d = make_daemon("shared", f'shared_image_dir = "{shared}"\nimage_cache_max = 1\n')
    d.start()
    yield d, shared
    destroy_daemon(d)


def _resident(path: Path) -> int:
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], capture_output=True)
    return int(out.stdout.split()[0])


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.slow
def test_on_demand_layer_reads_only_what_the_sandbox_touches(shared_daemon: tuple[Daemon, Path]) -> None:
    d, shared = shared_daemon
    with d.client() as fleet:
        with fleet.create(image="busybox") as sb:
            # 40 files of 1 MiB: a task reads one of them.
            sb.exec("mkdir /data && for i in $(seq 1 40); do head -c 1048576 /dev/urandom > /data/f$i; done")
            sb.exec("echo small > /data/small")
            sb.pack("t/ondemand:1")
        local = LayerStore(IMAGES, shared=shared)
        pushed = asyncio.run(local.push("t/ondemand:1"))
        assert asyncio.run(local.push("t/ondemand:1")).layers == pushed.layers  # converted once, reused
        local.remove_image("t/ondemand:1")  # from here on only the shared store has the image
        top = pushed.layers[-1]
        assert top.blob is not None and top.blob_size is not None and top.blob_size > 40 * 2**20
        assert top.size < 2**20  # the metadata image is what a node copies
        blob = shared / "blobs" / ("sha256-" + top.blob.removeprefix("sha256:") + ".blob")
        _evict(blob)
        assert _resident(blob) == 0
        assert "t/ondemand:1" in [f"{i.name}:{i.tag}" for i in fleet.images()]
        with fleet.create(image="t/ondemand:1") as sb:
            assert sb.exec("cat /data/small").stdout == "small\n"
            assert sb.exec("stat -c %s /data/f7").stdout.strip() == "1048576"  # size: metadata only
            digest = sb.exec("md5sum /data/f3").stdout.split()[0]
            # What came from the blob is what EROFS now caches for the layer's files (the layer was
            # mounted fresh by this create). The blob is read with direct I/O: it holds no second copy.
            mounted = Path(f"/proc/{d.pid}/root{d.run_dir}/layers/{top.digest.replace(':', '-')}")
            read = sum(_resident(f) for f in (mounted / "data").iterdir())
            assert 2**20 <= read <= 2**20 + 64 * 2**10, read  # f3 (and the tiny `small`) of 41 MiB
            assert _resident(blob) == 0
        with fleet.create(image="t/ondemand:1") as sb:  # a second sandbox: the node's page cache
            assert sb.exec("md5sum /data/f3").stdout.split()[0] == digest
            local_meta = IMAGES / "layers" / ("sha256-" + top.digest.removeprefix("sha256:") + ".erofs")
            assert local_meta.exists() and local_meta.stat().st_size == top.size
            fleet.gc_images(min_age=1e9)  # only the cache trim can remove anything: the layer is in use
            assert local_meta.exists()
        assert wait_until(lambda: not residue(d).sandbox_ids and not residue(d).mounts)
        # Over the cache limit and unused: the local copy goes, and comes back when needed.
        assert top.digest in fleet.gc_images(min_age=1e9).removed
        assert not local_meta.exists()
        with fleet.create(image="t/ondemand:1") as sb:
            assert sb.exec("md5sum /data/f3").stdout.split()[0] == digest
        assert local_meta.exists()


def test_shared_blob_missing_is_data_loss(shared_daemon: tuple[Daemon, Path]) -> None:
    d, shared = shared_daemon
    with d.client() as fleet:
        with fleet.create(image="busybox") as sb:
            sb.exec("echo x > /x")
            sb.pack("t/ondemand-missing:1")
        local = LayerStore(IMAGES, shared=shared)
        pushed = asyncio.run(local.push("t/ondemand-missing:1"))
        local.remove_image("t/ondemand-missing:1")
        top = pushed.layers[-1]
        assert top.blob is not None
        (shared / "blobs" / ("sha256-" + top.blob.removeprefix("sha256:") + ".blob")).unlink()
        with pytest.raises(DataLossError, match="blob"):
            fleet.create(image="t/ondemand-missing:1")
        assert wait_until(lambda: not residue(d).sandbox_ids)


def test_a_shared_layer_deleted_while_mounted_is_fetched_again_or_data_loss(shared_daemon: tuple[Daemon, Path]) -> None:
    """An on-demand layer in use: its local metadata copy deleted is fetched again from the shared
    store; its data blob gone from the shared store is `data_loss`, before and after a restart alike."""
    d, shared = shared_daemon
    with d.client() as fleet:
        with fleet.create(image="busybox") as sb:
            sb.exec("head -c 100000 /dev/urandom > /x")
            sb.pack("t/shared-gone:1")
        local = LayerStore(IMAGES, shared=shared)
        pushed = asyncio.run(local.push("t/shared-gone:1"))
        local.remove_image("t/shared-gone:1")  # only the shared store has the image now
        top = pushed.layers[-1]
        assert top.blob is not None
        meta = _layer_file(top.digest)
        blob = shared / "blobs" / ("sha256-" + top.blob.removeprefix("sha256:") + ".blob")
        keep = fleet.create(image="t/shared-gone:1")
        want = keep.exec("md5sum /x").stdout
        meta.unlink()
        with fleet.create(image="t/shared-gone:1") as sb:
            assert sb.exec("md5sum /x").stdout == want
        assert meta.exists()  # fetched again
        blob.rename(blob.with_suffix(".away"))
        with pytest.raises(DataLossError, match="blob"):
            fleet.create(image="t/shared-gone:1")
        assert keep.exec("md5sum /x").stdout == want  # its mount holds the blob open
    d.kill()
    d.start()
    with d.client() as fleet:
        with pytest.raises(DataLossError, match="blob"):
            fleet.create(image="t/shared-gone:1")
        blob.with_suffix(".away").rename(blob)
        with fleet.create(image="t/shared-gone:1") as sb:
            assert sb.exec("md5sum /x").stdout == want
        fleet.get(keep.id).stop()
