"""Building C sources the daemon runs (the agent, the launcher, vminit: static binaries; the criu and
QEMU preload shims: shared objects), cached by source hash."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from sandfleet.runtime.agent_errors import AgentBuildError
from sandfleet.runtime.prebuilt import install_prebuilt, prebuilt_dir

AGENT_SOURCE = Path(__file__).with_name("agent.c")
LAUNCHER_SOURCE = Path(__file__).with_name("launcher.c")
LAUNCHER_NAME = "sandfleet-run"  # <= 15 bytes: it is also the command name the orphan reaper matches


def build_static(source_path: Path, cache_dir: Path, name: str, *, prefer_musl: bool = False) -> Path:
    """Compile a C source statically to ``cache_dir/<hash>/<name>`` (content-addressed, reused if present).

    The file name is kept as given because it is the process's command name (`comm`), which the
    orphan reaper matches on. With `prefer_musl`, musl-gcc (Debian's musl-tools) is used when installed:
    a static glibc binary runs dozens of CPUID instructions at start (cache and feature probing), and
    each one traps to the hypervisor on a VM, so exec of the glibc-built agent costs ~0.5 ms against
    ~0.24 ms for the musl build, once per sandbox.
    """
    source = source_path.read_bytes()
    # A gcc build keeps the key it always had (a snapshot names the agent build it can be restored
    # with); a musl build is another build of the same source. A build already here or prebuilt at
    # setup is used before any compiler runs; musl's first.
    keys = {"gcc": hashlib.sha256(source).hexdigest()[:16]}
    if prefer_musl:
        keys["musl-gcc"] = hashlib.sha256(b"musl-gcc\0" + source).hexdigest()[:16]
        if found := _ready(cache_dir, keys["musl-gcc"], name):
            return found
    compiler = "musl-gcc" if prefer_musl and shutil.which("musl-gcc") else "gcc"
    key = keys[compiler]
    target = cache_dir / key / name
    if found := _ready(cache_dir, key, name):
        return found
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", dir=target.parent)
    os.close(fd)
    try:
        res = subprocess.run(
            [compiler, "-O2", "-static", "-Wall", "-Wextra", "-o", tmp, str(source_path)],
            capture_output=True,
            text=True,
        )
        if res.returncode != 0:
            raise AgentBuildError(f"{compiler} failed on {source_path.name} ({res.returncode}):\n{res.stderr}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # atomic: concurrent builders just overwrite with identical bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _ready(cache_dir: Path, key: str, name: str) -> Path | None:
    """`cache_dir/key/name` if it is there or could be copied from the prebuilt set."""
    target = cache_dir / key / name
    if target.exists():
        return target
    if (prebuilt_dir() / key / name).is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        if install_prebuilt(key, name, target):
            return target
    return None


def build_shared(source_path: Path, cache_dir: Path, name: str) -> Path:
    """Compile a C source to the shared object ``cache_dir/<hash>/<name>`` (content-addressed, reused;
    a preload shim, built against the host's glibc)."""
    key = hashlib.sha256(b"shared\0" + source_path.read_bytes()).hexdigest()[:16]
    if found := _ready(cache_dir, key, name):
        return found
    target = cache_dir / key / name
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        argv = ["gcc", "-O2", "-shared", "-fPIC", "-Wall", "-Wextra", "-o", tmp, str(source_path), "-ldl"]
        res = subprocess.run(argv, capture_output=True, text=True)
        if res.returncode != 0:
            raise AgentBuildError(f"gcc failed on {source_path.name} ({res.returncode}):\n{res.stderr}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # atomic: concurrent builders write identical bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def build_agent(cache_dir: Path) -> Path:
    """The in-sandbox agent (agent.c), built once per source version."""
    return build_static(AGENT_SOURCE, cache_dir, "agent", prefer_musl=True)


def build_launcher(cache_dir: Path) -> Path:
    """The launcher (launcher.c) that starts a sandbox's agent in fresh namespaces."""
    return build_static(LAUNCHER_SOURCE, cache_dir, LAUNCHER_NAME)
