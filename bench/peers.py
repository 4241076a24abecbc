"""The peers, run side by side with sandfleet: crun (minimal and with sandfleet's config), bwrap,
runsc, podman, `crun exec` and `nsenter`, each timed as one subprocess, in a helper process
(`--peer-worker`) inside a private mount namespace where /sys/fs/cgroup/unified is unmounted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common import DEVNULL, ID_RANGE, UID_BASE, in_cgroup_ns_wrapper, stats, version_of

# Peers' stdio: runtimes chown their stdio to the container user, and crun 1.8.1 does so even to the
# host's /dev/null (containers/crun#1845), so peers get a private empty file and a private sink.
PEER_STDIO = Path(tempfile.gettempdir()) / "sandfleet-bench-stdio"  # peer_worker points it into its tmp dir


def timed_runs(argv: Sequence[str] | Callable[[int], Sequence[str]], n: int, *, warmup: int = 2) -> list[float]:
    """Run argv n times (after `warmup` untimed runs), each as one subprocess; fail on non-zero exit."""
    out: list[float] = []
    for i in range(-warmup, n):
        cmd = argv(i) if callable(argv) else argv
        t0 = time.perf_counter()
        with open(PEER_STDIO.with_suffix(".in"), "ab+") as stdin, open(PEER_STDIO.with_suffix(".out"), "ab") as sink:
            r = subprocess.run(cmd, stdin=stdin, stdout=sink, stderr=subprocess.PIPE)
        dt_ = time.perf_counter() - t0
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.decode(errors='replace')[-800:]}")
        if i >= 0:
            out.append(dt_)
    return out


def stage_rootfs(root: Path) -> None:
    """The same busybox tree sandfleet's busybox image is built from, owned by the sandbox root uid."""
    from sandfleet.images.builders import stage_busybox

    stage_busybox(root)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), UID_BASE, UID_BASE)
    os.lchown(root, UID_BASE, UID_BASE)


def minimal_oci(rootfs: Path, args: list[str], cgroup_path: str) -> dict[str, Any]:
    """A minimal OCI config: user namespace (root -> UID_BASE) plus sandfleet's other namespaces."""
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
            "cwd": "/",
        },
        "root": {"path": str(rootfs), "readonly": True},
        "hostname": "peer",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
        ],
        "linux": {
            "uidMappings": [{"containerID": 0, "hostID": UID_BASE, "size": ID_RANGE}],
            "gidMappings": [{"containerID": 0, "hostID": UID_BASE, "size": ID_RANGE}],
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount", "user", "cgroup")],
            "cgroupsPath": cgroup_path,
        },
    }


def sandfleet_oci(rootfs: Path, args: list[str], cgroup_path: str) -> dict[str, Any]:
    """sandfleet's own config.json (seccomp, caps, masked paths, cgroup limits) with a different command."""
    from sandfleet.backends.container import bundle
    from sandfleet.models import Resources

    r = Resources()
    cfg = bundle.ContainerConfig(
        rootfs=str(rootfs),
        args=args,
        hostname="peer",
        limits=bundle.ContainerLimits(cpu=r.cpu, memory=int(r.memory), pids=r.pids),
        cgroup_path=cgroup_path,
        uid_base=UID_BASE,
    )
    return bundle.build(cfg)


def peer_worker(params_file: Path) -> None:
    """Runs inside `unshare -m` with /sys/fs/cgroup/unified unmounted; writes results JSON."""
    global PEER_STDIO
    p = json.loads(params_file.read_text())
    tmp = Path(p["tmp"])
    PEER_STDIO = tmp / "peer-stdio"
    n, n_exec, cg = p["n"], p["n_exec"], p["cgroup_parent"]
    rootfs = tmp / "peer-rootfs"
    crun_root = tmp / "crun-root"
    runsc_root = tmp / "runsc-root"
    res: dict[str, Any] = {"cycle": {}, "exec": {}}
    out_file = Path(p["out"])

    def save() -> None:
        out_file.write_text(json.dumps(res, indent=1))

    def attempt(name: str, section: str, fn: Callable[[], dict[str, Any]]) -> None:
        print(f"  peer: {name} ...", flush=True)
        try:
            res[section][name] = {"status": "ok", **fn()}
        except Exception as exc:  # a peer failing is a result, not a crash
            res[section][name] = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:1500]}
        save()

    # host baseline: fork+exec of /bin/true with no isolation at all (the floor of every timing here)
    attempt(
        "host fork+exec (no isolation)",
        "cycle",
        lambda: {"argv": ["/bin/true"], "stats": stats(timed_runs(["/bin/true"], n))},
    )

    def crun_cycle(kind: str) -> dict[str, Any]:
        bundle = tmp / f"bundle-{kind}"
        bundle.mkdir(exist_ok=True)
        make = minimal_oci if kind == "minimal" else sandfleet_oci

        def argv(i: int) -> list[str]:
            cid = f"sfb-{kind}-{i + 10}"
            cfg = make(rootfs, ["/bin/true"], f"{cg}/{cid}")
            (bundle / "config.json").write_text(json.dumps(cfg))
            return ["crun", "--root", str(crun_root), "run", "--bundle", str(bundle), cid]

        return {"argv": argv(0), "stats": stats(timed_runs(argv, n))}

    attempt("crun run (minimal config)", "cycle", lambda: crun_cycle("minimal"))
    attempt("crun run (sandfleet's config.json)", "cycle", lambda: crun_cycle("sandfleet"))

    def bwrap() -> dict[str, Any]:
        if shutil.which("bwrap") is None:
            raise FileNotFoundError("bwrap not installed (apt-get install -y bubblewrap)")
        argv = [
            "bwrap",
            "--unshare-all",
            "--ro-bind",
            str(rootfs),
            "/",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "/bin/true",
        ]
        return {"argv": argv, "stats": stats(timed_runs(argv, n))}

    attempt("bwrap --unshare-all", "cycle", bwrap)

    if shutil.which("runsc"):

        def runsc() -> dict[str, Any]:
            bundle = tmp / "bundle-runsc"
            bundle.mkdir(exist_ok=True)

            def argv(i: int) -> list[str]:
                cid = f"sfb-runsc-{i + 10}"
                (bundle / "config.json").write_text(json.dumps(minimal_oci(rootfs, ["/bin/true"], f"{cg}/{cid}")))
                return ["runsc", "--root", str(runsc_root), "--network=none", "run", "--bundle", str(bundle), cid]

            return {"argv": argv(0), "version": version_of(["runsc", "--version"]), "stats": stats(timed_runs(argv, n))}

        attempt("runsc run (gVisor)", "cycle", runsc)
    else:
        res["cycle"]["runsc run (gVisor)"] = {
            "status": "skipped",
            "reason": "runsc not installed (apt-get install -y runsc)",
        }

    if shutil.which("podman"):

        def podman() -> dict[str, Any]:
            pod = tmp / "podman"
            base = [
                "podman",
                "--root",
                str(pod / "root"),
                "--runroot",
                str(pod / "run"),
                "--tmpdir",
                str(pod / "tmp"),
                "--cgroup-manager",
                "cgroupfs",
                "--events-backend",
                "file",
                "--storage-driver",
                "overlay",
            ]
            tarball = tmp / "busybox.tar"
            with tarfile.open(tarball, "w") as tf:
                tf.add(rootfs, arcname=".")
            t0 = time.perf_counter()
            r = subprocess.run([*base, "import", str(tarball), "localhost/sfbench-busybox"], capture_output=True)
            if r.returncode != 0:
                raise RuntimeError(f"podman import failed: {r.stderr.decode(errors='replace')[-800:]}")
            import_s = time.perf_counter() - t0
            # This host's root lacks CAP_SYS_RESOURCE, so podman's default rlimits (nofile 1048576) fail.
            argv = [
                *base,
                "run",
                "--rm",
                "--network",
                "none",
                "--cgroup-parent",
                f"{cg}/podman",
                "--ulimit",
                "nofile=1024:1024",
                "--ulimit",
                "nproc=4096:4096",
                "localhost/sfbench-busybox",
                "true",
            ]
            return {
                "argv": argv,
                "version": version_of(["podman", "--version"]),
                "image_import_s": round(import_s, 3),
                "note": "no user namespace (podman's default as root); --network none",
                "stats": stats(timed_runs(argv, n)),
            }

        attempt("podman run --rm", "cycle", podman)
    else:
        res["cycle"]["podman run --rm"] = {
            "status": "skipped",
            "reason": "podman not installed "
            "(apt-get install -y podman); it would also need a local busybox image "
            "(no registry is reachable): the benchmark imports one from a tarball",
        }

    res["cycle"]["docker run --rm"] = {"status": "skipped", "reason": p["docker_reason"]}
    save()

    # exec into a running container
    long_bundle = tmp / "bundle-long"
    long_bundle.mkdir(exist_ok=True)
    (long_bundle / "config.json").write_text(json.dumps(minimal_oci(rootfs, ["/bin/sleep", "3600"], f"{cg}/long")))
    long_id = "sfb-long"
    try:
        errlog = tmp / "crun-long.err"  # a file, not a pipe: the detached container keeps its stderr open
        with open(errlog, "wb") as err, open(tmp / "crun-long.in", "ab+") as stdin:
            r = subprocess.run(
                ["crun", "--root", str(crun_root), "run", "--detach", "--bundle", str(long_bundle), long_id],
                stdin=stdin,
                stdout=err,
                stderr=err,
            )
        if r.returncode != 0:
            res["exec"]["crun exec"] = {"status": "failed", "reason": errlog.read_text(errors="replace")[-800:]}
        else:
            state = json.loads(
                subprocess.run(
                    ["crun", "--root", str(crun_root), "state", long_id], capture_output=True, check=True
                ).stdout
            )
            pid = int(state["pid"])
            crun_exec = ["crun", "--root", str(crun_root), "exec", long_id, "/bin/true"]
            attempt("crun exec", "exec", lambda: {"argv": crun_exec, "stats": stats(timed_runs(crun_exec, n_exec))})
            nsenter = ["nsenter", "-t", str(pid), "-a", "/bin/true"]
            attempt("nsenter -a", "exec", lambda: {"argv": nsenter, "stats": stats(timed_runs(nsenter, n_exec))})
    finally:
        subprocess.run(["crun", "--root", str(crun_root), "delete", "--force", long_id], stdout=DEVNULL, stderr=DEVNULL)
    save()


def peer_leftover_cleanup(tmp: Path) -> None:
    """Delete any peer container a crashed worker left behind (inside a crun-friendly namespace)."""
    script = []
    if (tmp / "crun-root").is_dir():
        for cid in os.listdir(tmp / "crun-root"):
            script.append(f"crun --root {tmp / 'crun-root'} delete --force {cid}")
    if (tmp / "runsc-root").is_dir() and shutil.which("runsc"):
        script.append(
            f"for c in $(runsc --root {tmp / 'runsc-root'} list -quiet 2>/dev/null); do "
            f"runsc --root {tmp / 'runsc-root'} delete -force $c; done"
        )
    pod = tmp / "podman"
    if pod.is_dir() and shutil.which("podman"):
        script.append(
            f"podman --root {pod / 'root'} --runroot {pod / 'run'} --tmpdir {pod / 'tmp'} "
            "--cgroup-manager cgroupfs --events-backend file --storage-driver overlay rm -af -t 0"
        )
    if script:
        subprocess.run(
            in_cgroup_ns_wrapper(["sh", "-c", "; ".join(script)]), stdout=DEVNULL, stderr=DEVNULL, timeout=120
        )


def docker_skip_reason() -> str:
    if shutil.which("docker") is None:
        return "no docker CLI and no docker engine"
    try:
        r = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=15
        )
    except subprocess.TimeoutExpired:
        return "no docker engine (docker info timed out)"
    if r.returncode != 0:
        err = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"no docker engine (dockerd is not running on this kind of machine; docker info: {err})"
    return f"docker engine {r.stdout.strip()} is present but this benchmark does not drive it yet"
