"""Layer-stack benchmark: sandboxes from a 3-layer ~2 GB environment, mounted vs extracted, and on
demand from a shared store.

    python3 bench/layers.py [--quick] [--results DIR] [--rebuild] [--clean]      (as root)

Measures
  (a) time until a sandbox is exec-ready from a 3-layer environment (debian:bookworm + a ~1.2 GB
      "workspace" + a ~0.6 GB "toolkit"), N sandboxes one after another:
        - sandfleet: `create(image="bench/env3:1")` (the layers are EROFS files mounted once per node
          and stacked by overlayfs per sandbox), then the first `exec("true")`; the same with the stack
          named at create time (`create(layers=[3 digests])`);
        - per-sandbox extraction: `tar -x` of the merged tree into a fresh directory on the same disk
          as the layer store, then `bwrap --bind DIR / ... --unshare-all /bin/true` (the bwrap peer of
          bench/run.py); the directory is deleted after each cycle (not timed) so disk stays bounded.
  (b) bytes read from a shared store (a local directory standing in for NFS) for a task that touches a
      few files of the image: the image is pushed as on-demand layers (a small metadata image + a blob
      of file data per layer), a daemon whose local store is empty creates a sandbox from it with a cold
      page cache, and the task runs. The daemon mounts each layer with EROFS's `directio` option (the
      blob is read around the page cache; EROFS caches the file data in the page cache of the layer's
      own files), so what was read is the metadata images (copied whole to the node) plus the page-cache
      residency (mincore(2), as `fincore` reports it) of every file inside the image's layer mounts,
      reached in the daemon's mount namespace through /proc/<pid>/root. The blobs' own residency is
      reported as a check (~0). Also the time to first exec from the shared store vs an eager full
      copy of the same files, and the bytes each writes locally.

The environment is built once into a private layer store under /var/lib/sandfleet/bench-env
(SANDFLEET_BENCH_ENV overrides it) and reused while ENV_VERSION and the shape match (~5 GB for the
full shape: store, shared store, tar). `--clean` deletes it. Writes bench/results/layers.json and
layers.md. Everything else it makes (daemons, sandboxes, cgroups, mounts, temp dirs) goes at the end,
also on error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import hashlib
import json
import math
import mmap
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from run import machine_info, pct, print_tables, remove_cgroup_tree, stats, version_of
from sandfleet.daemon.node.process import DaemonProcess
from sandfleet.errors import SandboxError
from sandfleet.images import LayerRef, LayerStore, fsutil
from sandfleet.images.builders import mounted_layers

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
IMAGES = Path(os.environ.get("SANDFLEET_TEST_IMAGES", "/var/lib/sandfleet/images"))
ENV_ROOT = Path(os.environ.get("SANDFLEET_BENCH_ENV", "/var/lib/sandfleet/bench-env"))
# Bump when the generator or the layer layout changes: a cached environment of another version is rebuilt.
ENV_VERSION = "env3-v1"
REF = "bench/env3:1"
MIB = 1 << 20
BLOCK = 64 * 1024  # binaries are made of blocks that are either incompressible or highly compressible
# What the reference design reported for mount vs per-sandbox extraction, end to end.
REFERENCE_RATIO = 1.76

# The task of (b): what an agent's first step in a repository looks like: read a few files, list the
# tree, run the shell and one tool of the toolkit. Everything it reads is named here.
TASK_FILES = (
    "/workspace/README.md",
    "/workspace/pyproject.toml",
    "/workspace/src/app/main.py",
    "/workspace/src/app/config.py",
    "/workspace/data/fixtures/sample.json",
)
TASK = (
    f"cat {' '.join(TASK_FILES)} > /dev/null && ls -l /workspace /workspace/src > /dev/null && "
    "sh -c true && /opt/toolkit/bin/tk --version"
)
TASK_OUTPUT = "tk 3.1.0\n"


@dataclasses.dataclass(frozen=True)
class Shape:
    """How big the environment is and how many sandboxes each phase makes."""

    name: str
    workspace_bytes: int
    toolkit_bytes: int
    mount_sandboxes: int
    tar_sandboxes: int
    host_fs_tar_sandboxes: int  # extractions straight onto the host's root fs (see ext4_scratch)
    ondemand_reps: int


FULL = Shape("full", 1200 * 10**6, 600 * 10**6, 50, 50, 2, 3)
QUICK = Shape("quick", 160 * 10**6, 80 * 10**6, 10, 10, 2, 1)


@dataclasses.dataclass(frozen=True)
class FileClass:
    """One kind of file in a synthetic layer: where it goes, its share of the layer's bytes, its size
    range (log-uniform, like real trees: many small files, few big ones) and its content."""

    where: str
    share: float
    lo: int
    hi: int
    # None: text (source-like, ~2-3x compressible); else the share of 64 KiB blocks that are random
    # (already-compressed data: packs, media, stripped code sections), the rest compress very well.
    random_share: float | None
    suffixes: tuple[str, ...]
    per_dir: int  # files per directory: source trees are wide and shallow


WORKSPACE = (
    FileClass("workspace/src", 0.35, 1024, 48 * 1024, None, (".py", ".ts", ".go", ".rs", ".md"), 30),
    FileClass("workspace/.git/objects/pack", 0.20, 16 * MIB, 128 * MIB, 1.0, (".pack",), 8),
    FileClass("workspace/build", 0.30, 256 * 1024, 16 * MIB, 0.5, (".o", ".so", ".a", ".bin"), 20),
    FileClass("workspace/data", 0.15, 64 * 1024, 4 * MIB, None, (".json", ".csv", ".jsonl"), 20),
)
TOOLKIT = (
    FileClass("opt/toolkit/bin", 0.25, 1 * MIB, 24 * MIB, 0.6, ("",), 50),
    FileClass("opt/toolkit/lib", 0.45, 32 * 1024, 6 * MIB, 0.6, (".so",), 40),
    FileClass("opt/toolkit/lib/python3/site-packages", 0.15, 1024, 32 * 1024, None, (".py", ".pyi"), 25),
    FileClass("opt/toolkit/share", 0.15, 512, 16 * 1024, None, (".txt", ".html", ".1"), 40),
)


# --------------------------------------------------------------------------- small helpers


def run_cmd(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[bytes]:
    """Run argv, failing with its stderr tail on a non-zero exit."""
    r = subprocess.run(argv, capture_output=True, **kw)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {r.returncode}: {r.stderr.decode(errors='replace')[-800:]}")
    return r


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
PAGE = os.sysconf("SC_PAGE_SIZE")
_MAP_FAILED = ctypes.c_void_p(-1).value
_LOW_BIT = bytes(i & 1 for i in range(256))  # mincore(2): only the lowest bit of each byte is defined


def _os_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def resident_fd(fd: int, size: int) -> int:
    """Bytes of the open file in the page cache, in whole pages: what fincore(1) reports (mmap +
    mincore: mapping reads nothing, and nothing is touched)."""
    if size == 0:
        return 0
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        raise _os_error("mmap")
    try:
        vec = ctypes.create_string_buffer((size + PAGE - 1) // PAGE)
        if _libc.mincore(addr, size, vec) != 0:
            raise _os_error("mincore")
        return vec.raw.translate(_LOW_BIT).count(1) * PAGE
    finally:
        _libc.munmap(addr, size)


def resident(path: Path) -> int:
    """Bytes of `path` in the page cache: what has been read from it since it was last evicted."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        return resident_fd(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def tree_resident(root: Path) -> dict[str, int]:
    """Page-cache residency summed over every regular file under `root` (scandir, symlinks not
    followed): files, their bytes, how many have any page cached, and the bytes cached."""
    out = {"files": 0, "file_bytes": 0, "files_with_cached_pages": 0, "resident_bytes": 0}
    stack = [str(root)]
    while stack:
        with os.scandir(stack.pop()) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                elif e.is_file(follow_symlinks=False):
                    fd = os.open(e.path, os.O_RDONLY | os.O_NOFOLLOW)
                    try:
                        size = os.fstat(fd).st_size
                        res = resident_fd(fd, size)
                    finally:
                        os.close(fd)
                    out["files"] += 1
                    out["file_bytes"] += size
                    out["files_with_cached_pages"] += res > 0
                    out["resident_bytes"] += res
    return out


def evict(path: Path) -> None:
    """Drop `path` from the page cache (fsync first: DONTNEED leaves dirty pages alone)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def tree_stats(root: Path) -> tuple[int, int]:
    """(regular files, their bytes) under root."""
    files = size = 0
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            st = os.lstat(os.path.join(dirpath, n))
            if stat.S_ISREG(st.st_mode):
                files += 1
                size += st.st_size
    return files, size


def df_free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def mib(n: float) -> float:
    return round(n / MIB, 1)


def worktree_state() -> dict[str, Any]:
    """Whether src/ has uncommitted changes (the commit alone would then not identify the code)."""
    out: dict[str, Any] = {}
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        diff = subprocess.run(
            ["git", "-C", str(REPO), "diff", "HEAD", "--", "src"], capture_output=True, check=True
        ).stdout
        out["src_uncommitted_changes"] = bool(diff)
        if diff:
            out["src_diff_sha256"] = hashlib.sha256(diff).hexdigest()[:12]
    return out


# --------------------------------------------------------------------------- synthetic layers


def _text_pool(rng: random.Random, size: int) -> bytes:
    """Source-like text: identifiers and keywords with a Zipf-ish frequency, indented lines.
    Files are slices of it, so generating ~1 GB of text costs one pool, not a token loop per byte."""
    syll = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "xi", "ze", "qu", "sh", "th", "pr", "st", "en", "ar"]
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    words += ["def", "return", "if", "else", "for", "in", "import", "class", "self", "None", "=", "(", ")", ":"] * 40
    weights = [1.0 / (i + 1) ** 0.8 for i in range(len(words))]
    out: list[str] = []
    n = 0
    while n < size:
        line = " " * (4 * rng.randint(0, 3)) + " ".join(rng.choices(words, weights, k=rng.randint(2, 12))) + "\n"
        out.append(line)
        n += len(line)
    return "".join(out).encode()[:size]


class Filler:
    """Writes files of the FileClasses into a staging tree, deterministically for one seed."""

    def __init__(self, seed: str) -> None:
        self.rng = random.Random(seed)
        self.pool = _text_pool(self.rng, 4 * MIB)
        # Compressible blocks of binaries: repeated structures (tables, padding, string sections).
        self.soft = [
            (bytes(self.rng.randrange(256) for _ in range(64)) * (BLOCK // 64)),
            bytes(BLOCK),
            self.pool[:BLOCK],
            (b"\x00" * 48 + bytes(self.rng.randrange(256) for _ in range(16))) * (BLOCK // 64),
        ]

    def text(self, label: str, size: int) -> bytes:
        head = f"# {label}\n".encode()
        body = size - len(head)
        off = self.rng.randrange(len(self.pool))
        chunks, n = [], 0
        while n < body:  # wraps around the pool for files bigger than what is left of it
            piece = self.pool[off : off + body - n]
            chunks.append(piece)
            n += len(piece)
            off = 0
        return head + b"".join(chunks)

    def binary(self, size: int, random_share: float) -> bytes:
        blocks = []
        for _ in range(math.ceil(size / BLOCK)):
            if self.rng.random() < random_share:
                blocks.append(self.rng.randbytes(BLOCK))
            else:
                blocks.append(self.rng.choice(self.soft))
        return b"".join(blocks)[:size]

    def fill(self, root: Path, target: int, classes: tuple[FileClass, ...]) -> None:
        for cls in classes:
            budget, written, i = int(target * cls.share), 0, 0
            while written < budget:
                size = min(int(math.exp(self.rng.uniform(math.log(cls.lo), math.log(cls.hi)))), budget - written)
                size = max(size, 64)
                d = i // cls.per_dir
                rel = (
                    Path(cls.where)
                    / f"p{d // 16:03d}"
                    / f"m{d % 16:02d}"
                    / f"f{i:06d}{cls.suffixes[i % len(cls.suffixes)]}"
                )
                data = self.text(str(rel), size) if cls.random_share is None else self.binary(size, cls.random_share)
                path = root / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
                if cls.random_share is not None and "/bin" in cls.where:
                    os.chmod(path, 0o755)
                written += size
                i += 1


def stage_workspace(root: Path, target: int) -> None:
    f = Filler(f"{ENV_VERSION}/workspace")
    f.fill(root, target, WORKSPACE)
    ws = root / "workspace"
    named = {
        "README.md": f.text("README", 6 * 1024),
        "pyproject.toml": f.text("pyproject", 2 * 1024),
        "src/app/main.py": f.text("main", 14 * 1024),
        "src/app/config.py": f.text("config", 5 * 1024),
        "data/fixtures/sample.json": f.text("sample", 300 * 1024),
    }
    for rel, data in named.items():
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_bytes(data)


def stage_toolkit(root: Path, target: int) -> None:
    f = Filler(f"{ENV_VERSION}/toolkit")
    f.fill(root, target, TOOLKIT)
    tk = root / "opt/toolkit"
    (tk / "etc").mkdir(parents=True, exist_ok=True)
    (tk / "etc/tk.conf").write_text("version=3.1.0\n")
    (tk / "bin/tk").write_text('#!/bin/sh\n. /opt/toolkit/etc/tk.conf\necho "tk $version"\n')
    os.chmod(tk / "bin/tk", 0o755)


# --------------------------------------------------------------------------- the environment (cached)


@dataclasses.dataclass
class Env:
    """The built environment: where its parts are and what they measure."""

    dir: Path
    meta: dict[str, Any]

    @property
    def store(self) -> Path:
        return self.dir / "store"

    @property
    def shared(self) -> Path:
        return self.dir / "shared"

    @property
    def tar(self) -> Path:
        return self.dir / "env3.tar"

    @property
    def digests(self) -> list[str]:
        return [layer["digest"] for layer in self.meta["layers"]]

    def shared_files(self) -> list[tuple[str, str, Path]]:
        """(layer name, "metadata"|"blob", path) of every file of the image in the shared store."""
        out = []
        for layer in self.meta["layers"]:
            od = layer["on_demand"]
            out.append((layer["name"], "metadata", self.shared / "layers" / od["metadata_file"]))
            out.append((layer["name"], "blob", self.shared / "blobs" / od["blob_file"]))
        return out


def load_env(shape: Shape) -> Env | None:
    d = ENV_ROOT / f"{ENV_VERSION}-{shape.name}"
    try:
        meta = json.loads((d / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    env = Env(d, meta)
    if meta.get("version") != ENV_VERSION or meta.get("shape") != dataclasses.asdict(shape):
        return None
    files = [env.tar] + [p for _, _, p in env.shared_files()]
    files += [env.store / "layers" / ("sha256-" + x.removeprefix("sha256:") + ".erofs") for x in env.digests]
    if not all(p.exists() for p in files):
        return None
    return env


async def build_env(shape: Shape) -> Env:
    """Build the three layers into a private store, the tar of the merged tree and the shared-store
    copy (on-demand layers). Slow (minutes), so it runs once per ENV_VERSION and shape."""
    d = ENV_ROOT / f"{ENV_VERSION}-{shape.name}"
    fsutil.rmtree(d)  # a partial or outdated build
    d.mkdir(parents=True)
    store = LayerStore(d / "store")
    timings: dict[str, float] = {}

    # Layer 1: the real debian:bookworm base, copied from the host's image store (built there if missing).
    t = time.perf_counter()
    host = LayerStore(IMAGES)
    deb = (await host.ensure("debian:bookworm")).layers[0]
    name = "sha256-" + deb.digest.removeprefix("sha256:") + ".erofs"
    shutil.copyfile(IMAGES / "layers" / name, store.layers_dir / name)  # a copy: the host store may gc its own
    os.chmod(store.layers_dir / name, 0o444)
    timings["debian_s"] = time.perf_counter() - t

    refs: list[tuple[str, LayerRef, int, int]] = []
    async with mounted_layers([store.layers_dir / name], d / "mnt-debian") as mnt:
        deb_files, deb_bytes = await asyncio.to_thread(tree_stats, mnt)
    (d / "mnt-debian").rmdir()
    refs.append(("debian:bookworm", deb, deb_files, deb_bytes))
    for label, stage, target in (
        ("workspace", stage_workspace, shape.workspace_bytes),
        ("toolkit", stage_toolkit, shape.toolkit_bytes),
    ):
        staging = d / f"staging-{label}"
        t = time.perf_counter()
        print(f"  generating the {label} layer ({target / 1e6:.0f} MB)", flush=True)
        await asyncio.to_thread(stage, staging, target)
        files, size = await asyncio.to_thread(tree_stats, staging)
        timings[f"{label}_generate_s"] = time.perf_counter() - t
        t = time.perf_counter()
        print(f"  mkfs.erofs -zlz4hc of the {label} layer", flush=True)
        ref = await store.add_layer_from_dir(staging, f"bench {label} ({ENV_VERSION})")
        timings[f"{label}_mkfs_s"] = time.perf_counter() - t
        await asyncio.to_thread(fsutil.rmtree, staging)
        refs.append((label, ref, files, size))
    store.put_manifest("bench/env3", "1", [r for _, r, _, _ in refs], recipe=f"bench/layers.py {ENV_VERSION}")
    paths = store.layer_paths(store.resolve(REF))

    # The tar of the merged tree, made from the very layers sandfleet mounts (an overlay of them).
    t = time.perf_counter()
    print("  tar of the merged tree", flush=True)
    async with mounted_layers(paths, d / "mnt-merged") as merged:
        merged_files, merged_bytes = await asyncio.to_thread(tree_stats, merged)
        await asyncio.to_thread(run_cmd, ["tar", "--numeric-owner", "-cf", str(d / "env3.tar"), "-C", str(merged), "."])
    for p in d.glob("mnt-merged*"):
        p.rmdir()
    timings["tar_s"] = time.perf_counter() - t

    # The shared store: each layer as a metadata image + a blob of its file data.
    t = time.perf_counter()
    print("  push to the shared store (on-demand layers)", flush=True)
    pushed = await LayerStore(d / "store", shared=d / "shared").push(REF)
    timings["push_s"] = time.perf_counter() - t

    layers = []
    for (label, ref, files, size), od in zip(refs, pushed.layers, strict=True):
        assert od.blob is not None and od.blob_size is not None
        layers.append(
            {
                "name": label,
                "digest": ref.digest,
                "files": files,
                "file_bytes": size,
                "erofs_lz4hc_bytes": ref.size,
                "on_demand": {
                    "metadata_digest": od.digest,
                    "metadata_file": "sha256-" + od.digest.removeprefix("sha256:") + ".erofs",
                    "metadata_bytes": od.size,
                    "blob_file": "sha256-" + od.blob.removeprefix("sha256:") + ".blob",
                    "blob_bytes": od.blob_size,
                },
            }
        )
    meta = {
        "version": ENV_VERSION,
        "shape": dataclasses.asdict(shape),
        "ref": REF,
        "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "build_timings_s": {k: round(v, 1) for k, v in timings.items()},
        "layers": layers,
        "merged_files": merged_files,
        "merged_file_bytes": merged_bytes,
        "tar_bytes": (d / "env3.tar").stat().st_size,
    }
    (d / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")  # last: marks the build complete
    return Env(d, meta)


# --------------------------------------------------------------------------- a daemon of our own


class BenchDaemon:
    """`sandfleet serve` with its own socket, state, run dir and cgroup parent, on a given layer store."""

    def __init__(self, root: Path, cgroup_parent: str, image_dir: Path, shared: Path | None = None) -> None:
        self.root = root
        self.socket = root / "sandfleet.sock"
        self.cgroup_parent = cgroup_parent
        root.mkdir(parents=True, exist_ok=True)
        config = root / "config.toml"
        config.write_text(
            f'socket = "{self.socket}"\nstate_dir = "{root / "state"}"\nrun_dir = "{root / "run"}"\n'
            f'image_dir = "{image_dir}"\n'
            + (f'shared_image_dir = "{shared}"\n' if shared is not None else "")
            # Nothing may be built behind the benchmark's back (it would land in the timings).
            + "stopped_retention = 0\nbuild_missing_images = false\n"
            + f'[container]\ncgroup_parent = "{cgroup_parent}"\n'
        )
        self.process = DaemonProcess(["--config", str(config)], workdir=root, log=root / "daemon.log")

    def start(self) -> None:
        self.process.start(120)

    def layer_mount(self, digest: str) -> Path:
        """Where the daemon mounted layer `digest`, seen from here: it mounts layers in a private mount
        namespace, at <run_dir>/layers/<digest with ':' replaced by '-'>."""
        return Path(f"/proc/{self.process.pid}/root{self.root / 'run'}/layers/{digest.replace(':', '-')}")

    def stop(self, labels: dict[str, str]) -> None:
        """Stop our sandboxes through the API (the daemon keeps sandboxes across restarts), then it."""
        if self.process.alive():
            from sandfleet import Client

            try:
                with Client(self.socket, timeout=300) as c:
                    c.stop_many(labels)
            except (SandboxError, OSError) as exc:
                print(f"cleanup: stopping sandboxes failed: {exc}", file=sys.stderr)
        self.process.stop()


@contextlib.contextmanager
def daemon_running(
    root: Path, cgroup_parent: str, image_dir: Path, labels: dict[str, str], shared: Path | None = None
) -> Iterator[BenchDaemon]:
    d = BenchDaemon(root, cgroup_parent, image_dir, shared)
    try:
        d.start()
        yield d
    except BaseException:
        print("daemon log tail:\n" + d.process.log()[-3000:], file=sys.stderr)
        raise
    finally:
        d.stop(labels)


# --------------------------------------------------------------------------- (a) exec-ready


def verified(store: Path, digest: str) -> bool:
    """Whether the daemon will take the layer file as already hashed (its verification stamp)."""
    from sandfleet.images import LayerStore

    return LayerStore(store).is_verified(digest)


def bench_mount(env: Env, tmp: Path, cgroup_parent: str, n: int, labels: dict[str, str]) -> dict[str, Any]:
    """create + first exec from the layer stack, n times, one after another (stop not timed)."""
    from sandfleet import Client

    out: dict[str, Any] = {}
    with (
        daemon_running(tmp / "daemon-a", cgroup_parent, env.store, labels) as d,
        Client(d.socket, timeout=600) as fleet,
    ):
        # The first create on a node mounts the three layers (and hashes a layer file whose verification
        # stamp does not match it): a one-off per node, reported apart from the steady state.
        fresh = not all(verified(env.store, x) for x in env.digests)
        t = time.perf_counter()
        sb = fleet.create(image=REF, labels=labels)
        t1 = time.perf_counter()
        if sb.exec("true").exit_code != 0:
            raise RuntimeError("exec true failed")
        out["first_create_on_node"] = {
            "create_ms": ms(t1 - t),
            "create_plus_first_exec_ms": ms(time.perf_counter() - t),
            "included_layer_hash_check": fresh,
        }
        sb.stop()
        for key, spec in (
            ("image", {"image": REF}),
            ("layers", {"layers": env.digests}),  # the stack named at create time, by digest
        ):
            create, first, total = [], [], []
            for _ in range(n):
                t0 = time.perf_counter()
                sb = fleet.create(labels=labels, **spec)
                t1 = time.perf_counter()
                r = sb.exec("true")
                t2 = time.perf_counter()
                if r.exit_code != 0:
                    raise RuntimeError(f"exec true failed: {r}")
                sb.stop()
                create.append(t1 - t0)
                first.append(t2 - t1)
                total.append(t2 - t0)
            out[key] = {
                "create_plus_first_exec": stats(total),
                "create": stats(create),
                "first_exec": stats(first),
                "total_s": round(sum(total), 3),
            }
    return out


def fs_journal(path: Path) -> str:
    """The ext4 data journalling mode of the filesystem holding `path` ("none" without a journal)."""
    dev = subprocess.run(["findmnt", "-no", "SOURCE", "--target", str(path)], capture_output=True, text=True)
    try:
        options = Path(f"/proc/fs/ext4/{Path(dev.stdout.strip()).name}/options").read_text().split()
    except OSError:
        return "not ext4"
    return next((o.removeprefix("data=") for o in options if o.startswith("data=")), "none")


@contextlib.contextmanager
def ext4_scratch(tmp: Path, size: int) -> Iterator[Path]:
    """A fresh ext4 made with mkfs.ext4's defaults (so with a journal), in a file on the store's disk,
    loop-mounted with direct I/O (data cached once, as on a block device of its own).

    Why not the host's root fs itself: it is an ext4 without a journal, and there every inode
    allocation skips inodes deleted in the last minute by probing the buffer cache for each
    (ext4 `recently_deleted()`, nojournal mode only; seen with perf). Deleting one extracted tree
    then makes the next extraction several times slower. The host-fs rows show it; a node built
    for this would not run so."""
    img, mnt = tmp / "scratch-ext4.img", tmp / "scratch-ext4"
    with open(img, "wb") as f:
        f.truncate(size)  # sparse: only what is written takes disk
    # Inode tables and journal zeroed now, not by ext4lazyinit in the background while we measure.
    run_cmd(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", str(img)])
    mnt.mkdir()
    run_cmd(["mount", "-o", "loop", str(img), str(mnt)])  # autoclear: umount detaches the loop device
    try:
        dev = run_cmd(["findmnt", "-no", "SOURCE", str(mnt)]).stdout.decode().strip()
        run_cmd(["losetup", "--direct-io=on", dev])
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        img.unlink(missing_ok=True)


def bench_tar(env: Env, scratch: Path, n: int, *, warmup: int = 1) -> dict[str, Any]:
    """tar -x of the merged tree into a fresh directory, then bwrap over it running /bin/true; the
    directory is deleted after each cycle (timed apart: it is the price of the next one's disk)."""
    journal = fs_journal(scratch)
    extract, start, total, delete = [], [], [], []
    for i in range(-warmup, n):  # warm-up untimed: the tar file is then in the page cache for all
        d = scratch / f"sandbox-{i + warmup}"
        t0 = time.perf_counter()
        d.mkdir()
        run_cmd(["tar", "--numeric-owner", "-xf", str(env.tar), "-C", str(d)])
        t1 = time.perf_counter()
        run_cmd(["bwrap", "--bind", str(d), "/", "--proc", "/proc", "--dev", "/dev", "--unshare-all", "/bin/true"])
        t2 = time.perf_counter()
        run_cmd(["rm", "-rf", "--one-file-system", str(d)])
        t3 = time.perf_counter()
        if i >= 0:
            extract.append(t1 - t0)
            start.append(t2 - t1)
            total.append(t2 - t0)
            delete.append(t3 - t2)
        print(f"    tar cycle {i + 1}/{n}: {t2 - t0:.2f} s (+ {t3 - t2:.2f} s rm)", flush=True)
    return {
        "filesystem": "ext4 without a journal" if journal == "none" else f"data={journal} journal",
        "extract_plus_first_exec": stats(total),
        "extract": stats(extract),
        "bwrap_true": stats(start),
        "delete_not_in_cycle": stats(delete),
        "total_s": round(sum(total), 3),
        "total_with_delete_s": round(sum(total) + sum(delete), 3),
    }


# --------------------------------------------------------------------------- (b) on demand


def unmount_under(root: Path) -> None:
    """Lazily unmount whatever is still mounted below `root` (deepest first), so that deleting `root`
    afterwards can never reach into a mounted filesystem (a crashed daemon's, the scratch ext4)."""
    prefix = str(root).rstrip("/") + "/"
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point.startswith(prefix):
            points.append(point)
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


def layer_files_read(d: BenchDaemon, env: Env) -> dict[str, dict[str, int]]:
    """Per layer of the image, what the page cache holds of the files inside the daemon's mount of it.
    With `directio` the blob is read around the page cache and EROFS caches the file data it read in
    its own files' pages: on a fresh mount, that is what was read from the blob (readahead included)."""
    out = {}
    for layer in env.meta["layers"]:
        mnt = d.layer_mount(layer["on_demand"]["metadata_digest"])
        if os.stat(mnt).st_dev == os.stat(mnt.parent).st_dev:  # not mounted: it would count as 0 read
            raise RuntimeError(f"layer {layer['name']} is not mounted at {mnt}")
        out[layer["name"]] = tree_resident(mnt)
    return out


def evict_all(paths: list[Path]) -> int:
    """Evict the files, return what stayed resident (should be 0: nothing may hold them mapped)."""
    for p in paths:
        evict(p)
    return sum(resident(p) for p in paths)


def copy_file(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)
    os.chmod(dst, 0o444)


def bench_ondemand(
    env: Env, tmp: Path, cgroup_parent: str, rep: int, labels: dict[str, str], *, eager: bool
) -> dict[str, Any]:
    """One node with an empty local store and a cold page cache: time to first exec, then the task,
    then what was read from and written to where. `eager` copies the image's files locally first."""
    from sandfleet import Client

    kind = "eager" if eager else "ondemand"
    local = tmp / f"{kind}-{rep}-local"  # the node's own layer store: empty
    files = env.shared_files()
    paths = [p for _, _, p in files]
    left = evict_all(paths)
    # The eager node reads from a full local copy of the image's shared-store files instead.
    shared = tmp / f"{kind}-{rep}-copy" if eager else env.shared
    if eager:
        for sub in ("layers", "blobs", "images/bench/env3"):
            (shared / sub).mkdir(parents=True)
    row: dict[str, Any] = {"kind": kind, "rep": rep, "resident_after_evict": left}
    with (
        daemon_running(tmp / f"daemon-{kind}-{rep}", cgroup_parent, local, labels, shared) as d,
        Client(d.socket, timeout=600) as fleet,
    ):
        t0 = time.perf_counter()
        if eager:
            for _name, what, src in files:
                copy_file(src, shared / ("blobs" if what == "blob" else "layers") / src.name)
            # the manifest last, as push does: the copy is then complete before anyone resolves it
            copy_file(env.shared / "images/bench/env3/1.json", shared / "images/bench/env3/1.json")
        t1 = time.perf_counter()
        sb = fleet.create(image=REF, labels=labels)
        t2 = time.perf_counter()
        if sb.exec("true").exit_code != 0:
            raise RuntimeError("exec true failed")
        t3 = time.perf_counter()
        r = sb.exec(TASK)
        t4 = time.perf_counter()
        if r.exit_code != 0 or r.stdout != TASK_OUTPUT:
            raise RuntimeError(f"task failed: {r}")
        shared_resident = {f"{name} {what}": resident(p) for name, what, p in files}
        ts = time.perf_counter()
        layer_files = layer_files_read(d, env)
        scan_s = time.perf_counter() - ts
        # A second sandbox on the same node: layers mounted, the touched pages cached.
        t5 = time.perf_counter()
        sb2 = fleet.create(image=REF, labels=labels)
        if sb2.exec(TASK).stdout != TASK_OUTPUT:
            raise RuntimeError("task failed in the second sandbox")
        t6 = time.perf_counter()
        sb.stop()
        sb2.stop()
    written = fsutil.disk_usage(local) + (fsutil.disk_usage(shared) if eager else 0)
    metadata_read = sum(v for k, v in shared_resident.items() if k.endswith(" metadata"))
    blob_resident = {k.removesuffix(" blob"): v for k, v in shared_resident.items() if k.endswith(" blob")}
    if not eager and sum(blob_resident.values()) > 4 * MIB:
        print(f"    warning: the blobs are in the page cache ({blob_resident}): not mounted with directio?", flush=True)
    # On demand: the metadata images (fetched whole) + the file data EROFS read from the blobs. Eager:
    # the copy read every file of the image in the shared store (buffered: their page-cache residency).
    read = metadata_read + sum(x["resident_bytes"] for x in layer_files.values())
    row.update(
        {
            "copy_s": round(t1 - t0, 3),
            "create_ms": ms(t2 - t1),
            "first_exec_ms": ms(t3 - t2),
            "time_to_first_exec_s": round(t3 - t0, 3),
            "task_ms": ms(t4 - t3),
            "second_sandbox_create_plus_task_ms": ms(t6 - t5),
            "bytes_read_from_shared": sum(shared_resident.values()) if eager else read,
            "metadata_images_read": metadata_read,
            "layer_files_read": layer_files,  # eager: read from the local copy of the blobs
            "layer_files_scan_s": round(scan_s, 2),
            "blob_page_cache_residency": blob_resident,  # on demand: should be ~0 (direct I/O)
            "shared_store_page_cache_residency": shared_resident,
            "bytes_written_locally": written,
            "metadata_copied_to_local_store": fsutil.disk_usage(local / "layers"),
        }
    )
    fsutil.rmtree(local)
    if eager:
        fsutil.rmtree(shared)
    return row


def summarize_ondemand(env: Env, rows: list[dict[str, Any]]) -> dict[str, Any]:
    meta_bytes = sum(x["on_demand"]["metadata_bytes"] for x in env.meta["layers"])
    blob_bytes = sum(x["on_demand"]["blob_bytes"] for x in env.meta["layers"])
    image = meta_bytes + blob_bytes

    def med(kind: str, key: str) -> float:
        return pct([r[key] for r in rows if r["kind"] == kind], 0.5)

    od_read = med("ondemand", "bytes_read_from_shared")
    ods = [r for r in rows if r["kind"] == "ondemand"]
    return {
        "image_bytes_in_shared_store": image,
        "metadata_bytes": meta_bytes,
        "blob_bytes": blob_bytes,
        "task": TASK,
        "bytes_read_median": int(od_read),
        "fraction_of_image_read": round(od_read / image, 5),
        "ondemand_metadata_images_read_median": int(med("ondemand", "metadata_images_read")),
        "ondemand_blob_page_cache_residency_max": max(sum(r["blob_page_cache_residency"].values()) for r in ods),
        "ondemand_time_to_first_exec_s": round(med("ondemand", "time_to_first_exec_s"), 3),
        "eager_time_to_first_exec_s": round(med("eager", "time_to_first_exec_s"), 3),
        "eager_copy_s": round(med("eager", "copy_s"), 3),
        "ondemand_bytes_written_locally": int(med("ondemand", "bytes_written_locally")),
        "eager_bytes_written_locally": int(med("eager", "bytes_written_locally")),
        "eager_bytes_read_from_shared": int(med("eager", "bytes_read_from_shared")),
        "ratio_time_eager_over_ondemand": round(
            med("eager", "time_to_first_exec_s") / med("ondemand", "time_to_first_exec_s"), 2
        ),
    }


# --------------------------------------------------------------------------- report


def f2(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def tables(res: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    env = res["environment"]
    a, b = res["exec_ready"], res["on_demand"]
    out: list[tuple[str, list[str], list[list[str]]]] = []

    rows = [
        [
            x["name"],
            f"{x['files']:,}",
            f2(x["file_bytes"] / 1e6, 0),
            f2(x["erofs_lz4hc_bytes"] / 1e6, 0),
            f"{f2(x['on_demand']['metadata_bytes'] / 1e6, 1)} + {f2(x['on_demand']['blob_bytes'] / 1e6, 0)}",
        ]
        for x in env["layers"]
    ]
    rows.append(
        [
            "merged tree (tar)",
            f"{env['merged_files']:,}",
            f2(env["merged_file_bytes"] / 1e6, 0),
            f"tar {f2(env['tar_bytes'] / 1e6, 0)}",
            "",
        ]
    )
    out.append(
        (
            f"The environment `{REF}` (MB = 10^6 bytes)",
            ["layer", "files", "file data MB", "EROFS layer (lz4hc) MB", "shared store: metadata + blob MB"],
            rows,
        )
    )

    def cyc(label: str, st: dict[str, Any], total: float | None, note: str) -> list[str]:
        return [label, f2(st["p50_ms"]), f2(st["p99_ms"]), f2(st["mean_ms"]), f2(total, 2) if total else "", note]

    im, ly, tr, th = a["mount"]["image"], a["mount"]["layers"], a["tar"], a["tar_host_root_fs"]
    fc = a["mount"]["first_create_on_node"]
    n = im["create_plus_first_exec"]["n"]
    rows = [
        cyc(
            f'sandfleet: create(image="{REF}") + exec("true")',
            im["create_plus_first_exec"],
            im["total_s"],
            "exec-ready: the daemon mounts nothing new; overlay of the 3 mounted EROFS layers + scratch tmpfs",
        ),
        cyc("  sandfleet: create alone", im["create"], None, "returns when the sandbox's agent said HELLO"),
        cyc("  sandfleet: first exec alone", im["first_exec"], None, ""),
        cyc(
            'sandfleet: create(layers=[3 digests]) + exec("true")',
            ly["create_plus_first_exec"],
            ly["total_s"],
            "the stack named at create time instead of by a manifest",
        ),
        cyc(
            "tar -x + bwrap /bin/true",
            tr["extract_plus_first_exec"],
            tr["total_s"],
            f"uncompressed tar of the merged tree ({f2(env['tar_bytes'] / 1e9, 2)} GB), page-cached",
        ),
        cyc("  tar -x alone (creation)", tr["extract"], None, "into a fresh dir: " + tr["filesystem"]),
        cyc("  bwrap --unshare-all /bin/true alone", tr["bwrap_true"], None, "--bind DIR / --proc /proc --dev /dev"),
        cyc(
            "  rm -rf of the extracted dir (after, not in the cycle)",
            tr["delete_not_in_cycle"],
            tr["delete_not_in_cycle"]["mean_ms"] * tr["delete_not_in_cycle"]["n"] / 1000,
            "what keeps the disk bounded",
        ),
        cyc(
            "tar -x + bwrap /bin/true, straight on the host's root fs",
            th["extract_plus_first_exec"],
            th["total_s"],
            f"{th['extract_plus_first_exec']['n']} cycles (each "
            + " / ".join(f2(x / 1000, 1) for x in th["extract_plus_first_exec"]["samples_ms"])
            + " s): ext4 without a journal, slow after a deletion (see notes)",
        ),
        [
            "first sandfleet create on a fresh daemon (one-off per node)",
            "",
            "",
            f2(fc["create_plus_first_exec_ms"]),
            "",
            "mounts the 3 layers"
            + (
                " and hashes the layer files (no matching verification stamp)"
                if fc["included_layer_hash_check"]
                else ""
            ),
        ],
    ]
    r = a["ratios"]
    rows.append(
        [
            "**ratio tar / mount** (exec-ready; creation alone)",
            f"{f2(r['p50'], 1)}x",
            f"{f2(r['p99'], 1)}x",
            f"{f2(r['mean'], 1)}x",
            f"{f2(r['total'], 1)}x",
            f"creation alone (tar -x / create) p50 {f2(r['creation_p50'], 1)}x; reference design: {REFERENCE_RATIO}x",
        ]
    )
    out.append(
        (
            f"(a) Sandbox exec-ready from the 3-layer environment, {n} sandboxes one after another (ms)",
            ["what", "p50", "p99", "mean", f"total for {n} (s)", "notes"],
            rows,
        )
    )

    ods = [x for x in b["runs"] if x["kind"] == "ondemand"]
    eag = [x for x in b["runs"] if x["kind"] == "eager"]
    s = b["summary"]

    def each(xs: list[dict[str, Any]], key: str, scale: float = 1.0, nd: int = 2) -> str:
        return " / ".join(f2(x[key] * scale, nd) for x in xs)

    rows = [
        [
            "image size in the shared store (metadata images + blobs)",
            f"{mib(s['image_bytes_in_shared_store'])} MiB ({mib(s['metadata_bytes'])} + {mib(s['blob_bytes'])})",
        ],
        [
            "**bytes read from the shared store by the task** (median; each run)",
            f"**{mib(s['bytes_read_median'])} MiB = {f2(100 * s['fraction_of_image_read'], 2)} %** of the image "
            f"({each(ods, 'bytes_read_from_shared', 1 / MIB, 1)} MiB)",
        ],
        [
            "  of which metadata images (copied whole to the node) / file data from the blobs",
            f"{mib(ods[0]['metadata_images_read'])} / "
            f"{mib(sum(x['resident_bytes'] for x in ods[0]['layer_files_read'].values()))} MiB (run 1)",
        ],
        [
            "  file data read per layer: page cache of the files in the layer's mount (run 1)",
            ", ".join(
                f"{k} {x['resident_bytes'] / MIB:.2f} MiB ({x['files_with_cached_pages']:,} of {x['files']:,} files)"
                for k, x in ods[0]["layer_files_read"].items()
            ),
        ],
        [
            "  the blobs' own page-cache residency (read with direct I/O: should be 0; each run)",
            " / ".join(f"{sum(x['blob_page_cache_residency'].values()) / MIB:.2f}" for x in ods) + " MiB",
        ],
        [
            "**time to first exec, on demand, cold page cache** (s, each run)",
            f"**{f2(s['ondemand_time_to_first_exec_s'], 3)}** ({each(ods, 'time_to_first_exec_s', 1, 3)}): "
            "create (fetch + hash metadata, mount) + exec",
        ],
        [
            "**time to first exec, eager full copy first** (s, each run)",
            f"**{f2(s['eager_time_to_first_exec_s'], 3)}** ({each(eag, 'time_to_first_exec_s', 1, 3)}), "
            f"of which copy {f2(s['eager_copy_s'], 3)} s; "
            f"{f2(s['ratio_time_eager_over_ondemand'], 1)}x the on-demand time",
        ],
        [
            "bytes written locally: on demand / eager",
            f"{mib(s['ondemand_bytes_written_locally'])} MiB / {mib(s['eager_bytes_written_locally'])} MiB",
        ],
        [
            "the task after the first exec (ms, each run)",
            f"on demand {each(ods, 'task_ms')}; eager {each(eag, 'task_ms')}",
        ],
        [
            "a second sandbox on the same node, create + task (ms, each run)",
            f"on demand {each(ods, 'second_sandbox_create_plus_task_ms')}; "
            f"eager {each(eag, 'second_sandbox_create_plus_task_ms')}",
        ],
    ]
    out.append(("(b) On demand from a shared store: a task that touches a few files", ["measure", "value"], rows))
    return out


def headline(res: dict[str, Any]) -> list[str]:
    """The few figures the benchmark exists for, in words, above the tables."""
    a, s = res["exec_ready"], res["on_demand"]["summary"]
    im = a["mount"]["image"]["create_plus_first_exec"]
    tr = a["tar"]["extract_plus_first_exec"]
    fastest = min(tr["samples_ms"] + a["tar_host_root_fs"]["extract_plus_first_exec"]["samples_ms"])
    size = res["environment"]["merged_file_bytes"] / 1e9
    return [
        "## Headline",
        "",
        f"- Exec-ready from the 3-layer {size:.1f} GB environment, p50: **{f2(im['p50_ms'], 1)} ms** mounted "
        f"(sandfleet create + first exec) vs **{f2(tr['p50_ms'] / 1000, 2)} s** extracted (tar -x + bwrap): "
        f"**{f2(a['ratios']['p50'], 0)}x** ({f2(a['ratios']['total'], 0)}x for the whole run of {im['n']}). "
        f"Against the fastest single extraction seen on this disk ({f2(fastest / 1000, 2)} s) it is still "
        f"{f2(fastest / im['p50_ms'], 0)}x. The reference design reported {REFERENCE_RATIO}x.",
        f"- A task touching a few files of the image, on demand from the shared store: "
        f"**{mib(s['bytes_read_median'])} MiB read of {mib(s['image_bytes_in_shared_store'])} MiB "
        f"({f2(100 * s['fraction_of_image_read'], 2)} %)**; first exec after "
        f"**{f2(s['ondemand_time_to_first_exec_s'], 3)} s** with a cold page cache vs "
        f"{f2(s['eager_time_to_first_exec_s'], 2)} s after an eager copy "
        f"({f2(s['ratio_time_eager_over_ondemand'], 0)}x), writing {mib(s['ondemand_bytes_written_locally'])} MiB "
        f"vs {mib(s['eager_bytes_written_locally'])} MiB locally.",
        "",
    ]


def write_markdown(res: dict[str, Any], tbls: list[tuple[str, list[str], list[list[str]]]], path: Path) -> None:
    m = res["meta"]
    wt = m.get("worktree", {})
    dirty = (
        f" plus uncommitted changes in src/ (diff sha256 {wt['src_diff_sha256']})"
        if wt.get("src_uncommitted_changes")
        else ""
    )
    env = res["environment"]
    lines = [
        "# sandfleet benchmark: layer stacks (mount vs extract, on demand vs eager)",
        "",
        f"{m['date']} — {m['nproc']} CPUs ({m['cpu']}), {m['mem_total_gib']} GiB, kernel {m['kernel']}, "
        f"Python {m['python']}, sandfleet {m['sandfleet_commit']}{dirty}"
        f"{' (--quick)' if res['config']['quick'] else ''}. Disk: {m['disk']}. Load average at start / end: "
        f"{m['loadavg_start']} / {m['loadavg_end']}. Tools: " + ", ".join(v for v in m["versions"].values() if v) + ".",
        "",
        f"Produced by `sudo python3 bench/layers.py{' --quick' if res['config']['quick'] else ''}`; every figure "
        f"and every sample is in `layers.json`. Environment {env['version']} built {env['built']} "
        f"(build: {', '.join(f'{k} {v}' for k, v in env['build_timings_s'].items())}).",
        "",
        *headline(res),
        'What the environment is: layer 1 is the real `debian:bookworm` minbase; layer 2, "workspace", is a '
        "synthetic repository checkout (`/workspace`: source-like text files of 1-48 KiB, pack files of random "
        "bytes, build artefacts and data files of which half the 64 KiB blocks are random); layer 3, "
        '"toolkit", a synthetic toolchain (`/opt/toolkit`: binaries and shared libraries 60 % random blocks, '
        "many small Python and doc files). Text compresses ~2-3x, random blocks not at all.",
        "",
    ]
    notes = {
        0: [],
        1: [
            "Each cycle runs after the previous one finished; sandfleet sandboxes are stopped and extracted "
            "directories deleted after each cycle, untimed. sandfleet figures are wall time through the sync "
            "SDK over the daemon's unix socket (HTTP, SQLite, cgroups, seccomp, user namespace included); the "
            "tar path is two subprocesses (`tar -x`, then `bwrap`) with no daemon, no cgroup and no seccomp "
            "— it does less isolation work. The tar is uncompressed and in the page cache (its best case: a "
            "compressed or remote tar would add decompression or download per sandbox). Extraction writes "
            "into the page cache; ext4 writes back in the background, so later cycles pay for earlier ones' "
            "writeback, as a busy node would.",
            "Where the tar is extracted: a fresh ext4 made by `mkfs.ext4` with its defaults (journal, "
            "data=ordered) in a sparse file on the layer store's disk, loop-mounted with direct I/O. Not the "
            "host's root fs itself, because that is an ext4 *without* a journal, where every new inode "
            "skips the inodes deleted in the last minute, probing the buffer cache for each "
            "(`recently_deleted()` in ext4's inode allocator, used only without a journal; perf shows it as "
            "~85 % of tar's time): after `rm -rf` of one extracted tree, the next extraction is several "
            'times slower. The row "straight on the host\'s root fs" shows that with 2 cycles. Its first '
            "cycle, with no recent deletions, is the fastest extraction seen (no journal, no loop device): the "
            "headline gives the ratio against it too, so the figure does not rest on the scratch fs choice.",
        ],
        2: [
            "The shared store is a directory on the same local disk, standing in for NFS. The daemon mounts "
            "each on-demand layer with EROFS's `directio` option (`device=<blob>,directio`): the blob is read "
            "with direct I/O, around the page cache, and EROFS keeps the file data it read in the page cache "
            'of the layer\'s own files. So "bytes read" is the metadata images (fetched whole by the node: '
            "their page-cache residency in the shared store) plus the page-cache residency (mmap + "
            "`mincore(2)`, what `fincore` reports) of every regular file inside the image's layer mounts, "
            "walked in the daemon's mount namespace through `/proc/<daemon pid>/root`, after create + first "
            "exec + the task. It counts whole 4 KiB pages and includes readahead, which now happens per file "
            "inside EROFS (the file's own readahead window, not a window over the blob). Each run starts a "
            "daemon whose local store is empty, so it mounts the layers fresh and EROFS's cache starts empty; "
            "the metadata images and blobs are evicted from the page cache before each run all the same "
            "(fsync + `posix_fadvise(DONTNEED)`). The blobs' own page-cache residency is reported as a check "
            "that nothing read them buffered. "
            "The eager run copies the same metadata images and blobs to the local disk (as fast as this disk "
            "copies, with no network: over real NFS the copy would take longer) and then creates the sandbox "
            "from the copy. Bytes written locally: the node's layer-store directory (metadata images fetched) "
            "plus, for eager, the copy; the eager run's bytes read from the shared store are the page-cache "
            "residency of the files it copied (all of them).",
            f"Task: `{TASK}`.",
        ],
    }
    for i, (title, header, rows) in enumerate(tbls):
        lines += [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in rows:
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
        lines.append("")
        for note in notes.get(i, []):
            lines += [note, ""]
    path.write_text("\n".join(lines))


# --------------------------------------------------------------------------- main


def ratio(a: float, b: float) -> float:
    return round(a / b, 2) if b else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smaller environment and fewer sandboxes (a smoke run)")
    ap.add_argument("--results", type=Path, default=RESULTS, help="where layers.json / layers.md go")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the cached environment even if it is current")
    ap.add_argument("--clean", action="store_true", help=f"delete the cached environments ({ENV_ROOT}) and exit")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/layers.py must run as root (daemons, mounts, namespaces, cgroups)")
        return 2
    if args.clean:
        fsutil.rmtree(ENV_ROOT)
        print(f"removed {ENV_ROOT}")
        return 0
    for tool in ("bwrap", "tar", "mkfs.erofs"):
        if shutil.which(tool) is None:
            print(f"{tool} is missing (apt-get install -y bubblewrap erofs-utils tar)")
            return 2
    shape = QUICK if args.quick else FULL

    def on_term(signo: int, frame: object) -> None:
        raise SystemExit(f"interrupted by signal {signo}")

    signal.signal(signal.SIGTERM, on_term)
    tag = f"{os.getpid()}-{int(time.time())}"
    labels = {"sfbench-layers": tag}
    cgroup_parent = f"/sfbench-layers-{tag}"
    ENV_ROOT.mkdir(parents=True, exist_ok=True)
    # Temp dirs on the same disk as the layer store: extraction must compete for the same device.
    tmp = Path(tempfile.mkdtemp(prefix="tmp-", dir=ENV_ROOT))
    os.chmod(tmp, 0o755)
    started = time.perf_counter()
    res: dict[str, Any] = {"meta": machine_info()}
    res["meta"]["versions"] = {
        "bwrap": version_of(["bwrap", "--version"]),
        "tar": version_of(["tar", "--version"]),
        "erofs-utils": version_of(["dpkg-query", "-W", "-f", "erofs-utils ${Version}", "erofs-utils"]),
    }
    res["meta"]["worktree"] = worktree_state()
    fs = subprocess.run(["findmnt", "-no", "SOURCE,FSTYPE", "--target", str(ENV_ROOT)], capture_output=True, text=True)
    res["meta"]["disk"] = f"{ENV_ROOT} on {fs.stdout.strip()}, {df_free(ENV_ROOT) / 1e9:.0f} GB free at start"
    try:
        env = None if args.rebuild else load_env(shape)
        if env is None:
            print(f"building the environment {ENV_VERSION}-{shape.name} in {ENV_ROOT} (once)", flush=True)
            env = asyncio.run(build_env(shape))
            res["meta"]["environment_built_this_run"] = True
        else:
            print(f"reusing the environment in {env.dir} (built {env.meta['built']})", flush=True)
            res["meta"]["environment_built_this_run"] = False
        res["environment"] = {k: v for k, v in env.meta.items() if k != "shape"}
        res["config"] = {"quick": args.quick, **dataclasses.asdict(shape)}

        print(f"(a) mount: {shape.mount_sandboxes} x create + first exec (image, then layers=)", flush=True)
        mount = bench_mount(env, tmp, cgroup_parent, shape.mount_sandboxes, labels)
        n_tar = shape.tar_sandboxes
        # One extracted tree at a time (each is deleted after its cycle), in a sparse fs file, plus slack.
        fs_size = int(env.meta["merged_file_bytes"] * 1.5) + 2**30
        free = df_free(tmp)
        if free < fs_size + 2e9:
            raise SystemExit(f"only {free / 1e9:.1f} GB free on {tmp}; a tar cycle needs {fs_size / 1e9:.1f} GB")
        print(f"(a) tar: {n_tar} x extract + bwrap true (fresh journalled ext4 on the same disk)", flush=True)
        with ext4_scratch(tmp, fs_size) as scratch:
            tar = bench_tar(env, scratch, n_tar)
        tar["filesystem"] = (
            f"fresh ext4 (mkfs.ext4 defaults: {tar['filesystem']}) in a sparse file on {ENV_ROOT}'s disk, "
            "loop device with direct I/O"
        )
        print(f"(a) tar: {shape.host_fs_tar_sandboxes} x extract + bwrap true on the host's root fs", flush=True)
        host_dir = tmp / "extract-host"
        host_dir.mkdir()
        tar_host = bench_tar(env, host_dir, shape.host_fs_tar_sandboxes, warmup=0)
        tar_host["filesystem"] = f"the host's root fs ({tar_host['filesystem']}), {ENV_ROOT}"
        im = mount["image"]
        res["exec_ready"] = {
            "mount": mount,
            "tar": tar,
            "tar_host_root_fs": tar_host,
            "ratios": {
                "meaning": "tar / mount (sandfleet create(image=...) + first exec): above 1, mounting is faster",
                "p50": ratio(tar["extract_plus_first_exec"]["p50_ms"], im["create_plus_first_exec"]["p50_ms"]),
                "p99": ratio(tar["extract_plus_first_exec"]["p99_ms"], im["create_plus_first_exec"]["p99_ms"]),
                "mean": ratio(tar["extract_plus_first_exec"]["mean_ms"], im["create_plus_first_exec"]["mean_ms"]),
                "total": ratio(tar["total_s"], im["total_s"]),
                "creation_p50": ratio(tar["extract"]["p50_ms"], im["create"]["p50_ms"]),
                "reference_design": REFERENCE_RATIO,
            },
        }

        runs = []
        for rep in range(shape.ondemand_reps):
            for eager in (False, True):
                print(f"(b) {'eager copy' if eager else 'on demand'}, run {rep + 1}/{shape.ondemand_reps}", flush=True)
                runs.append(bench_ondemand(env, tmp, cgroup_parent, rep, labels, eager=eager))
        res["on_demand"] = {"runs": runs, "summary": summarize_ondemand(env, runs)}
        res["meta"]["loadavg_end"] = Path("/proc/loadavg").read_text().split()[0]
        res["meta"]["wall_s"] = round(time.perf_counter() - started, 1)

        tbls = tables(res)
        args.results.mkdir(parents=True, exist_ok=True)
        (args.results / "layers.json").write_text(json.dumps(res, indent=2) + "\n")
        write_markdown(res, tbls, args.results / "layers.md")
        print_tables(tbls, text_columns=("notes", "value"))
        print(f"wrote {args.results / 'layers.json'} and {args.results / 'layers.md'} ({res['meta']['wall_s']} s)")
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # finish cleaning up even on a second ^C
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        left = remove_cgroup_tree(cgroup_parent)
        unmount_under(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if tmp.exists():
            left.append(str(tmp))
        if left:
            print(f"cleanup: could not remove {left}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
