"""Checkpoint and rollback in place: how long `sb.checkpoint()` and `sb.rollback(cp)` take, and where
that time goes.

A round: a small change (one file of the repo edited through the session, a 4 MiB file written),
`sb.checkpoint()` (B1), a change to throw away, `sb.rollback(cp)` and the next `exec("true")` (B2), a
check that the files, the session and the background process are the checkpoint's, then the
checkpoint is deleted (so every round writes a full one, as the first does).

The breakdown is read from what the daemon leaves on disk, without touching it:

- criu's own statistics (`stats-dump` / `stats-restore` in the images, microseconds): the time the
  tasks were frozen by criu, spent draining their memory and writing it out; forking and restoring;
- the timeline of each checkpoint from its files' birth and change times (the daemon's steps create
  them in order: the folder, the writable-layer copy `fs/`, criu's `dump.log`, the images,
  `checkpoint.json`) and of each rollback from the new sandbox directory, criu's `restore.log` and
  its pid file. The kernel stamps files with a coarse clock (one tick, 4 ms here), so each of those
  phases is +-4 ms;
- the sizes: memory images (pages) against the writable layer and /dev.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common import Daemon, pct

# Random bytes: pages of equal content (a bytearray touched once a page) would be merged by the daemon's
# KSM once a restore has made the process mergeable, and the sandbox would then hold a few MiB.
HOLD = "import os, time; b = os.urandom({mib} << 20); time.sleep(1e6)"
REPO_FILES = 200
DIRTY_MIB = 4
CHECKPOINT_HOLD_MIB = 200

# The targets: B1 checkpoint after a small change, B2 rollback until the next exec answers.
CHECKPOINT_TARGETS_MS = {"checkpoint_p50": 15.0, "rollback_to_first_exec_p50": 5.0}

# criu's images/stats.proto: stats_entry {dump = 1; restore = 2}
DUMP_FIELDS = {1: "freezing_us", 2: "frozen_us", 3: "memdump_us", 4: "memwrite_us", 5: "pages_scanned",
               6: "pages_skipped_parent", 7: "pages_written", 9: "pages_lazy"}  # fmt: skip
RESTORE_FIELDS = {1: "pages_compared", 2: "pages_skipped_cow", 3: "forking_us", 4: "restore_us", 5: "pages_restored"}


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def _protobuf(buf: bytes) -> dict[int, Any]:
    """Varint and length-delimited fields of one protobuf message (all criu's stats use)."""
    out: dict[int, Any] = {}
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            out[field], i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            out[field] = buf[i : i + n]
            i += n
        else:
            raise ValueError(f"wire type {wire}")
    return out


def criu_stats(path: Path) -> dict[str, int]:
    """A criu stats image: two magics (u32 each), then one entry: u32 size, a stats_entry."""
    try:
        raw = path.read_bytes()
        (size,) = struct.unpack_from("<I", raw, 8)
        entry = _protobuf(raw[12 : 12 + size])
        if 1 in entry:
            return {DUMP_FIELDS[k]: v for k, v in _protobuf(entry[1]).items() if k in DUMP_FIELDS}
        if 2 in entry:
            return {RESTORE_FIELDS[k]: v for k, v in _protobuf(entry[2]).items() if k in RESTORE_FIELDS}
    except (OSError, ValueError, IndexError, struct.error):
        pass
    return {}


def _files(top: Path) -> dict[str, tuple[float, float, float, int]]:
    """relative path -> (birth, modify, change time, size) of everything under `top` ('' for `top`).
    coreutils' `stat` reads the birth time (statx); this findutils' `-printf %B` does not."""
    paths = [str(top)]
    for d, dirs, files in os.walk(top):
        paths += [os.path.join(d, n) for n in dirs + files]
    fmt = r"%n\t%.9W\t%.9Y\t%.9Z\t%s\n"
    r = subprocess.run(["stat", "--printf", fmt, "--", *paths], capture_output=True, text=True)
    out = {}
    for line in r.stdout.splitlines():
        name, b, m, c, s = line.rsplit("\t", 4)
        out[os.path.relpath(name, top) if name != str(top) else ""] = (float(b), float(m), float(c), int(s))
    return out


def checkpoint_timeline(folder: Path) -> dict[str, Any]:
    """Where a checkpoint's time went, from its files (see the module's docstring)."""
    f = _files(folder)
    fs = {k: v for k, v in f.items() if k == "fs" or k.startswith("fs/")}
    img = {k: v for k, v in f.items() if k.startswith("img/")}
    start = f[""][0]  # the folder: made as the tier's snapshot begins
    copy_start = min(v[0] for k, v in fs.items() if k != "fs")  # cp -a makes fs/upper first
    copy_end = max(v[2] for k, v in fs.items() if k != "fs")  # ... and sets owners/times last
    criu_start = f["dump.log"][0]
    criu_end = max(v[2] for v in img.values())
    done = f["checkpoint.json"][0]
    ms = lambda a, b: round((b - a) * 1000, 1)  # noqa: E731
    pages = sum(v[3] for k, v in img.items() if k.startswith("img/pages-"))
    return {
        "phases_ms": {
            "begin: channel handover, freeze, cp started": ms(start, copy_start),
            "writable-layer copy (cp -a upper, dev)": ms(copy_start, copy_end),
            "criu started": ms(copy_end, criu_start),
            "criu dump": ms(criu_start, criu_end),
            "end: checks, thaw, channel taken back, du, record": ms(criu_end, done),
        },
        "bytes": {
            "memory pages": pages,
            "other criu images": sum(v[3] for v in img.values()) - pages,
            "writable layer + /dev": sum(v[3] for k, v in fs.items() if k != "fs"),
            "files in the writable layer": sum(1 for k in fs if k.startswith("fs/upper/")),
        },
        "criu": criu_stats(folder / "img" / "stats-dump"),
    }


def rollback_timeline(t_call: float, sdir: Path, images: Path, t_return: float) -> dict[str, Any]:
    """Where a rollback's time went: the call (wall clock), the new sandbox directory, criu's
    restore log and pid file, the call's return."""
    f = _files(sdir)
    made = f[""][0]
    criu_start = f["restore.log"][0]
    criu_end = f["agent.pid"][2]
    ms = lambda a, b: round((b - a) * 1000, 1)  # noqa: E731
    return {
        "phases_ms": {
            "request, old sandbox torn down": ms(t_call, made),
            "new sandbox prepared (rootfs, cgroups), launcher, criu started": ms(made, criu_start),
            "criu restore": ms(criu_start, criu_end),
            "agent: hello, forget, ping; handles back; response": ms(criu_end, t_return),
        },
        "criu": criu_stats(images / "stats-restore"),
    }


def _replay_copy(fs: Path, near: Path) -> dict[str, float]:
    """The last checkpoint's writable-layer copy done again by the bench, `cp -a` of the same tree
    (3 times each, the fastest): to the filesystem the checkpoints are on, and to a tmpfs. Says
    whether the copy's time is the bytes or the files, and the destination's part in it."""
    out: dict[str, float] = {}
    for name, base in (("same_fs_as_checkpoints", near), ("tmpfs", Path("/dev/shm"))):
        times = []
        for _ in range(3):
            dest = Path(tempfile.mkdtemp(prefix="sfbench-cp-replay-", dir=base))
            try:
                t = time.perf_counter()
                subprocess.run(["cp", "-a", "--", str(fs / "upper"), str(fs / "dev"), str(dest)], check=True)
                times.append(time.perf_counter() - t)
            finally:
                shutil.rmtree(dest, ignore_errors=True)
        out[name] = round(min(times) * 1000, 1)
    return out


def _pstats(xs: Sequence[float]) -> dict[str, Any]:
    ms = [x * 1000 for x in xs]
    return {
        "n": len(ms),
        "p50_ms": round(pct(ms, 0.5), 2),
        "p90_ms": round(pct(ms, 0.9), 2),
        "min_ms": round(min(ms), 2),
        "max_ms": round(max(ms), 2),
        "samples_ms": [round(x, 2) for x in ms],
    }


def _median_dict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Key by key median (p50) of dicts of numbers, nested."""
    out: dict[str, Any] = {}
    for k, v in rows[0].items():
        if isinstance(v, dict):
            out[k] = _median_dict([r[k] for r in rows if isinstance(r.get(k), dict)])
        elif isinstance(v, int | float):
            vals = [r[k] for r in rows if k in r]
            m = pct(vals, 0.5)
            out[k] = int(m) if all(isinstance(x, int) for x in vals) else round(float(m), 1)
    return out


def make_parent(fleet: Any, image: str, labels: dict[str, str], hold_mib: int = 0) -> tuple[Any, Any, Any]:
    """The issue's parent: a sandbox of `image` running a session (cwd and a variable set) and a
    background process (holding `hold_mib` MiB of touched anonymous memory of random bytes if > 0,
    else `sleep`), with a repo of small files. Returns (sandbox, session, process)."""
    sb = fleet.create(image=image, labels=labels, resources={"memory": "1GiB", "disk": "2GiB"})
    try:
        prep = sb.exec(
            f"mkdir -p /work/repo && cd /work/repo && i=0; while [ $i -lt {REPO_FILES} ]; do "
            'i=$((i+1)); printf "def f%s():\\n    return %s\\n" $i $i > mod$i.py; done; ls | wc -l'
        )
        if prep.exit_code != 0 or prep.stdout.strip() != str(REPO_FILES):
            raise RuntimeError(f"repo setup failed: {prep}")
        shell = sb.session()
        shell.run("cd /work/repo && export STEP=0")
        if hold_mib:
            bg = sb.start(["python3", "-c", HOLD.format(mib=hold_mib)])
            deadline = time.monotonic() + 60
            while sb.usage().memory_bytes < hold_mib << 20 and time.monotonic() < deadline:
                time.sleep(0.2)
        else:
            bg = sb.start("sleep 1000000")
        time.sleep(0.5)
    except BaseException:
        with contextlib.suppress(Exception):
            sb.stop()
        raise
    return sb, shell, bg


def bench_checkpoint(
    fleet: Any,
    daemon: Daemon,
    image: str,
    rounds: int,
    labels: dict[str, str],
    hold_mib: int = 0,
    think: float = 0.0,
) -> dict[str, Any]:
    """B1 (checkpoint after a small change) and B2 (rollback to it until the next exec answers) on the
    issue's parent (`make_parent`): `rounds` timed rounds after one warm-up. `think`: seconds between
    the checkpoint and the change thrown away (a model deciding its next action): long enough for the
    daemon's standby of the checkpoint (restored ahead, frozen) to be ready, the rollback swaps it in;
    with 0 the rollback waits for the standby being made (about a restore's time)."""
    sb, shell, bg = make_parent(fleet, image, labels, hold_mib)
    try:
        memory_bytes = sb.usage().memory_bytes
        cp_root = daemon.root / "state" / "checkpoints" / sb.id
        sdir = daemon.root / "run" / "sandboxes" / sb.id
        rows: list[dict[str, Any]] = []
        copy_replay: dict[str, float] = {}
        for r in range(rounds + 1):  # round 0: warm-up
            # B1: a small change, then the checkpoint.
            shell.run(f"echo '# edit {r}' >> mod{r % REPO_FILES + 1}.py && export STEP={r}")
            sb.exec(f"head -c {DIRTY_MIB << 20} /dev/urandom > /work/dirty.bin")
            t = time.perf_counter()
            cp = sb.checkpoint()
            cp_wall = time.perf_counter() - t
            folder = cp_root / cp.id
            try:
                cp_tl = checkpoint_timeline(folder)
            except (KeyError, ValueError) as exc:
                cp_tl = {"error": f"{type(exc).__name__}: {exc}"}
            time.sleep(think)
            # A branch to throw away.
            sb.exec("echo lost > /work/repo/mod1.py && rm /work/dirty.bin")
            # B2: rollback, until the next exec answers.
            t_call = time.time()
            t = time.perf_counter()
            rb = sb.rollback(cp)
            rb_call = time.perf_counter() - t
            t_return = time.time()
            ok = sb.exec("true")
            rb_wall = time.perf_counter() - t
            if ok.exit_code != 0:
                raise RuntimeError(f"exec after rollback failed: {ok}")
            swapped = bool([e for e in sb.events() if e.kind == "rolled_back"][-1].data.get("standby"))
            try:
                # (a standby's directory and criu log are from its restore, made before the call)
                rb_tl = {"standby": 1} if swapped else rollback_timeline(t_call, sdir, folder / "img", t_return)
            except (KeyError, ValueError, OSError) as exc:
                rb_tl = {"error": f"{type(exc).__name__}: {exc}"}
            # The checkpoint's state came back: files, the session's shell, the background process.
            check = sb.exec(f"cat /work/repo/mod1.py; test -f /work/dirty.bin && echo dirty-{DIRTY_MIB}")
            if "lost" in check.stdout or f"dirty-{DIRTY_MIB}" not in check.stdout:
                raise RuntimeError(f"round {r}: files not as at the checkpoint: {check.stdout!r}")
            step = shell.run("echo $STEP $(pwd)").stdout.split()
            if step != [str(r), "/work/repo"]:
                raise RuntimeError(f"round {r}: the session is not as at the checkpoint: {step}")
            if not any(p.id == bg.id and p.running for p in sb.processes()):
                raise RuntimeError(f"round {r}: the background process did not come back")
            memory_after_rollback = sb.usage().memory_bytes
            if r == rounds:
                copy_replay = _replay_copy(folder / "fs", daemon.root)
            sb.delete_checkpoint(cp)
            if r:
                rows.append(
                    {
                        "cp_wall": cp_wall,
                        "cp_server": cp.seconds,
                        "cp_bytes": cp.size_bytes,
                        "rb_call": rb_call,
                        "rb_server": rb.seconds,
                        "rb_wall": rb_wall,
                        "standby": swapped,
                        "memory_mib_after_rollback": round(memory_after_rollback / 2**20, 1),
                        "cp_timeline": cp_tl,
                        "rb_timeline": rb_tl,
                    }
                )
        events = sb.events()
        ev_cp = [e.data.get("seconds") for e in events if e.kind == "checkpoint"][1:]
        ev_rb = [e.data.get("seconds") for e in events if e.kind == "rolled_back"][1:]
        memory_after = sb.usage().memory_bytes
    finally:
        with contextlib.suppress(Exception):
            sb.stop()
    cp_ok = [x["cp_timeline"] for x in rows if "error" not in x["cp_timeline"]]
    rb_ok = [x["rb_timeline"] for x in rows if "error" not in x["rb_timeline"] and "standby" not in x["rb_timeline"]]
    return {
        "image": image,
        "think_s": think,
        "rollbacks_through_a_standby": sum(1 for x in rows if x["standby"]),
        "rounds": rounds,
        "hold_mib": hold_mib,
        "memory_mib": round(memory_bytes / 2**20, 1),
        "memory_mib_end": round(memory_after / 2**20, 1),
        "repo_files": REPO_FILES,
        "dirty_mib": DIRTY_MIB,
        "checkpoint_client": _pstats([x["cp_wall"] for x in rows]),
        "checkpoint_server": _pstats([x["cp_server"] for x in rows]),
        "checkpoint_events": _pstats([s for s in ev_cp if s is not None]),
        "size_mib_p50": round(pct([x["cp_bytes"] for x in rows], 0.5) / 2**20, 2),
        "rollback_call_client": _pstats([x["rb_call"] for x in rows]),
        "rollback_server": _pstats([x["rb_server"] for x in rows]),
        "rollback_events": _pstats([s for s in ev_rb if s is not None]),
        "rollback_to_first_exec": _pstats([x["rb_wall"] for x in rows]),
        "checkpoint_breakdown_p50": _median_dict(cp_ok) if cp_ok else {},
        "copy_replay_ms": copy_replay,
        "rollback_breakdown_p50": _median_dict(rb_ok) if rb_ok else {},
        "timeline_errors": sorted(
            {x[k]["error"] for x in rows for k in ("cp_timeline", "rb_timeline") if "error" in x[k]}
        ),  # fmt: skip
        "per_round": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in x.items()} for x in rows],
    }


# Results of `run.py --only checkpoint`: each image rolled back at once, and after a think time.
CHECKPOINT_RUNS = ("python", "python_think", "busybox", "busybox_think")
THINK_S = 1.0


def run_label(r: dict[str, Any]) -> str:
    think = r.get("think_s") or 0
    return f"{r['image']}, {think:g} s to think" if think else r["image"]


def checkpoint_targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    t1, t2 = CHECKPOINT_TARGETS_MS["checkpoint_p50"], CHECKPOINT_TARGETS_MS["rollback_to_first_exec_p50"]
    for key in CHECKPOINT_RUNS:
        r = res.get(key)
        if not r:
            continue
        b1, b2 = r["checkpoint_client"]["p50_ms"], r["rollback_to_first_exec"]["p50_ms"]
        if not r.get("think_s"):
            out.append({"target": f"B1 {r['image']}: checkpoint p50 <= {t1:.0f} ms", "measured": b1, "met": b1 <= t1})
        out.append(
            {"target": f"B2 {run_label(r)}: rollback to first exec p50 <= {t2:.0f} ms", "measured": b2, "met": b2 <= t2}
        )
    fork = res.get("fork16")
    if fork:
        out.append(
            {"target": "B3 fork of 16 from the python parent: call to all exec-ready <= 150 ms",
             "measured": fork["fork_ms"], "met": fork["fork_ms"] <= 150}
        )  # fmt: skip
        out.append(
            {"target": "B4 host memory of the 16 right after the fork / the parent's <= 1.25x (ratio, not ms)",
             "measured": fork["children_over_parent"], "met": fork["children_over_parent"] <= 1.25}
        )  # fmt: skip
    return out
