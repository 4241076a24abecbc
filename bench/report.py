"""The report: tables (peer / sandfleet ratios), markdown, the chart, the machine's description."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import platform
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common import REPO, meminfo_kib, version_of


def write_chart(res: dict[str, Any], path: Path) -> bool:
    """Box plots of every latency distribution of the run (log scale), side by side with the peers."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no chart", flush=True)
        return False
    sf = res["sandfleet"]
    create: list[tuple[str, list[float]]] = [
        ("sandfleet (cold)", sf["create_to_first_exec"]["create_plus_first_exec"].get("samples_ms", []))
    ]
    if "pooled_create_to_first_exec" in sf:
        create.append(
            ("sandfleet (warm pool)", sf["pooled_create_to_first_exec"]["create_plus_first_exec"]["samples_ms"])
        )
    for name, pr in res["peers"]["cycle"].items():
        if pr.get("status") == "ok" and pr["stats"].get("samples_ms"):
            create.append((name, pr["stats"]["samples_ms"]))
    execs: list[tuple[str, list[float]]] = [
        (f"sandfleet {name}", v["stats"]["samples_ms"])
        for name, v in sf["exec"].items()
        if v["stats"].get("samples_ms")
    ]
    for name, pr in res["peers"]["exec"].items():
        if pr.get("status") == "ok" and pr["stats"].get("samples_ms"):
            execs.append((name, pr["stats"]["samples_ms"]))
    fig, axes = plt.subplots(2, 1, figsize=(10, 8.5))
    for ax, title, series in (
        (axes[0], "fresh sandbox + run `true` (ms, log scale)", create),
        (axes[1], "exec into a running sandbox (ms, log scale)", execs),
    ):
        series = [(n, s) for n, s in series if s]
        ax.boxplot([s for _, s in series], vert=False, whis=(1, 99), showfliers=False)
        ax.set_yticks(range(1, len(series) + 1), [n for n, _ in series], fontsize=8)
        ax.set_xscale("log")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", which="both", alpha=0.3)
    meta = res["meta"]
    fig.suptitle(f"sandfleet benchmark {meta.get('date', '')} (whiskers: p1-p99)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b:
        return None
    return round(a / b, 2)


def build_tables(res: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    def f(x: Any, nd: int = 2) -> str:
        if x is None:
            return "-"
        if isinstance(x, float):
            return f"{x:.{nd}f}"
        return str(x)

    sf = res["sandfleet"]
    tables = []
    base = sf["create_to_first_exec"]["create_plus_first_exec"]

    def sandfleet_row(label: str, st: dict[str, Any], note: str) -> list[str]:
        """One sandfleet line of the cycle table, with its ratios to the cold create."""
        ratios = [f(st["p50_ms"] / base["p50_ms"], 2), f(st["mean_ms"] / base["mean_ms"], 2)]
        return [label, f(st["p50_ms"]), f(st["p99_ms"]), f(st["mean_ms"]), *ratios, note]

    rows = []
    for key, label, how in (
        ("create_to_first_exec", 'sandfleet SDK: create + exec("true")', ""),
        ("spaced_create_to_first_exec", 'sandfleet SDK, one every 0.1 s: create + exec("true")',
         "; cold creates after an idle spell (a lone one's cost)"),
        ("pooled_create_to_first_exec", 'sandfleet SDK, warm pool: create + exec("true")',
         "; one create every 0.2 s (the CPUs idle in between)"),
    ):  # fmt: skip
        if key in sf:
            run = sf[key]
            note = f"create p50 {f(run['create']['p50_ms'])} ms + first exec p50 {f(run['first_exec']['p50_ms'])} ms"
            rows.append(sandfleet_row(label, run["create_plus_first_exec"], note + how))
    if "pooled_groups" in sf:
        pg = sf["pooled_groups"]
        rows.append(
            sandfleet_row(
                f'sandfleet SDK, warm pool, groups of {pg["group"]} back to back: create + exec("true")',
                pg["create_plus_first_exec"],
                f"create p50 {f(pg['create']['p50_ms'])} ms; {pg['groups']} groups, the pool refilled between them",
            )
        )
    for name, pr in res["peers"]["cycle"].items():
        if pr["status"] == "ok":
            s = pr["stats"]
            r = res["ratios"]["create_cycle"][name]
            rows.append(
                [name, f(s["p50_ms"]), f(s["p99_ms"]), f(s["mean_ms"]), f(r["p50"]), f(r["mean"]), pr.get("note", "")]
            )
        else:
            rows.append([name, "-", "-", "-", "-", "-", f"{pr['status']}: {pr['reason']}"[:160]])
    n = base["n"]
    tables.append(
        (
            f"Fresh sandbox + run `true` (ms, N={n}; ratio = peer / sandfleet)",
            ["what", "p50", "p99", "mean", "ratio p50", "ratio mean", "notes"],
            rows,
        )
    )

    rows = []
    ex = sf["exec"]
    ref = ex['exec("true")']["stats"]
    for name, e in ex.items():
        s = e["stats"]
        rows.append(
            [
                f"sandfleet SDK {name}",
                f(s["p50_ms"]),
                f(s["p99_ms"]),
                f(s["mean_ms"]),
                f(ratio(s["p50_ms"], ref["p50_ms"])),
                f(ratio(s["mean_ms"], ref["mean_ms"])),
                f"daemon-side mean {f(e['daemon_side_mean_ms'])} ms",
            ]
        )
    for name, pr in res["peers"]["exec"].items():
        if pr["status"] == "ok":
            s = pr["stats"]
            r = res["ratios"]["exec"][name]
            rows.append([name, f(s["p50_ms"]), f(s["p99_ms"]), f(s["mean_ms"]), f(r["p50"]), f(r["mean"]), ""])
        else:
            rows.append([name, "-", "-", "-", "-", "-", f"{pr['status']}: {pr['reason']}"[:160]])
    tables.append(
        (
            f'Exec into a running sandbox (ms, N={ref["n"]}; ratio = x / sandfleet exec("true"))',
            ["what", "p50", "p99", "mean", "ratio p50", "ratio mean", "notes"],
            rows,
        )
    )

    rows = []
    for d in sf["density"]:
        e = d["exec_into_random_idle"]
        n = d["sandboxes"]
        rows += [
            [
                f"{n} idle: daemon RSS before -> after (MiB)",
                f"{f(d['daemon_rss_before_mib'], 1)} -> {f(d['daemon_rss_after_mib'], 1)}",
            ],
            [f"{n} idle: daemon RSS per sandbox (KiB)", f(d["daemon_rss_per_sandbox_kib"], 1)],
            [
                f"{n} idle: host memory per sandbox (MemAvailable delta / N, KiB)",
                f(d["host_mem_used_per_sandbox_kib"], 1),
            ],
            [
                f"{n} idle: PSS of all sandbox processes (MiB total / KiB each)",
                f"{f(d['sandbox_pss_total_mib'])} / {f(d['sandbox_pss_per_sandbox_kib'], 1)}",
            ],
            [f"{n} idle: sandbox cgroups' memory.usage_in_bytes total (MiB)", f(d["cgroup_memory_usage_total_mib"], 1)],
            [
                f"{n} idle: daemon fds / threads before -> after",
                f"{d['daemon_fds_before']} / {d['daemon_threads_before']} -> {d['daemon_fds_after']} / "
                f"{d['daemon_threads_after']}",
            ],
            [
                f"{n} idle: daemon CPU while idle ({f(d['idle_window_s'], 1)} s, % of one core)",
                f(d["daemon_idle_cpu_percent_of_one_core"]),
            ],
            [
                f'{n} idle: exec("true") into random idle sandboxes p50 / p99 / mean (ms)',
                f"{f(e['p50_ms'])} / {f(e['p99_ms'])} / {f(e['mean_ms'])} (N={e['n']})",
            ],
            [f"{n} idle: create_many of all (s)", f(d["create_all_s"])],
            [f"{n} idle: stop_many of all (s)", f(d["stop_all_s"])],
        ]
    for key in ("burst", "sustained"):
        b = sf[key]
        rows += [
            [
                f"{key}: {b['sandboxes']} creates (create_many, {b['in_flight']} in flight): seconds / creations/s",
                f"{f(b['created_s'])} / {f(b['creations_per_s'], 1)}",
            ],
            [f"{key}: all {b['sandboxes']} exec-ready (created + one exec each) (s)", f(b["all_exec_ready_s"])],
            [f"{key}: failed creates / stop_many of all (s)", f"{b['failed']} / {f(b['stop_many_s'])}"],
        ]
    pz = sf["pause"]
    rows += [
        [
            f"pause of a sandbox holding {f(pz['memory_before_mib'], 0)} MiB anon: seconds (median / max of {pz['n']})",
            f"{f(pz['pause_s'], 3)} / {f(pz['pause_s_max'], 3)}",
        ],
        [
            "pause: memory left in the sandbox's cgroup (MiB) / share pushed out / zram growth (MiB)",
            f"{f(pz['memory_after_mib'])} / {f(100 * pz['fraction_pushed_out'], 1)} % / {f(pz['zram_growth_mib'])}",
        ],
        [
            "resume (transparent, by exec) to first exec done, ms (median / max)",
            f"{f(pz['resume_to_first_exec_ms'])} / {f(pz['resume_to_first_exec_ms_max'])}",
        ],
    ]
    fk = sf["fork"]
    rows += [
        [
            f"fork of {fk['children']} from one live sandbox: seconds (median / max of {fk['n']}); snapshot part",
            f"{f(fk['fork_s'], 3)} / {f(fk['fork_s_max'], 3)}; {f(fk['snapshot_s'], 3)}",
        ],
        ["fork: until every child has run one exec (s)", f(fk["fork_and_one_exec_each_s"], 3)],
    ]
    fm = sf.get("fork_memory") or {}
    for mode, label in (("ksm", "with KSM (default)"), ("no_ksm", "without KSM")):
        if mode in fm:
            m = fm[mode]
            rows.append(
                [
                    f"fork of {fm['children']} from a parent holding {f(m['parent_mib'], 0)} MiB, {label}: host "
                    "memory of all children (MiB; per child); fork s; KSM settle s",
                    f"{f(m['children_mib'], 0)} ({f(m['per_child_mib'], 1)}); {f(m['fork_s'], 2)}; "
                    f"{f(m['ksm_settle_s'], 0)}",
                ]
            )
    qs = sf["qos"]
    rows += [
        [
            'QoS: latency-sensitive exec("true") p50 / p99, unloaded (ms)',
            f"{f(qs['unloaded']['p50_ms'])} / {f(qs['unloaded']['p99_ms'])}",
        ],
        [
            f"QoS: same, while {qs['hogs']} run as best_effort (ms; p50 ratio to unloaded)",
            f"{f(qs['hogs_best_effort']['p50_ms'])} / {f(qs['hogs_best_effort']['p99_ms'])} "
            f"({f(qs['ratio_p50_with_qos'])}x)",
        ],
        [
            "QoS: same, with the hogs latency_sensitive too (no QoS) (ms; p50 ratio)",
            f"{f(qs['hogs_latency_sensitive']['p50_ms'])} / {f(qs['hogs_latency_sensitive']['p99_ms'])} "
            f"({f(qs['ratio_p50_without_qos'])}x)",
        ],
    ]
    rows += [
        [
            "daemon crashes during the run",
            "; ".join(
                f"{c['where']} (exit {c['exit_code']}: {', '.join(c['errors'])[:120]})"
                for c in sf.get("daemon_crashes", [])
            )
            or "none",
        ],
    ]
    tables.append(("Density and burst", ["measure", "value"], rows))

    rows = [[t["target"], f(t["measured"]), "yes" if t["met"] else "NO"] for t in res["targets"]]
    tables.append(("Targets", ["target", "measured", "met"], rows))
    return tables


def write_markdown(res: dict[str, Any], tables: list[tuple[str, list[str], list[list[str]]]], path: Path) -> None:
    m = res["meta"]
    lines = [
        "# sandfleet benchmark: latest run",
        "",
        f"{m['date']} — {m['nproc']} CPUs ({m['cpu']}), {m['mem_total_gib']} GiB, kernel {m['kernel']}, "
        f"cgroup {m['cgroup']}, Python {m['python']}, sandfleet {m['sandfleet_commit']}"
        f"{' (--quick)' if res['config']['quick'] else ''}. Load average at start / end: {m['loadavg_start']} / "
        f"{m['loadavg_end']}. Runtimes: " + ", ".join(v for v in m["versions"].values() if v) + ".",
        "",
        "Produced by `python bench/run.py`; every figure is also in `latest.json`. Each peer cycle is one "
        "subprocess started and waited for from Python; sandfleet figures are wall time through the sync SDK "
        "over the daemon's unix socket.",
        "",
    ]
    for title, header, rows in tables:
        lines += [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in rows:
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
        lines.append("")
    path.write_text("\n".join(lines))


def print_tables(
    tables: list[tuple[str, list[str], list[list[str]]]], text_columns: Sequence[str] = ("notes", "target")
) -> None:
    """Rich tables on the terminal: the first column and `text_columns` left-aligned, numbers right."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(160, shutil.get_terminal_size().columns))
    for title, header, rows in tables:
        t = Table(title=title, title_justify="left")
        for i, h in enumerate(header):
            t.add_column(h, justify="left" if i == 0 or h in text_columns else "right", overflow="fold")
        for row in rows:
            t.add_row(*row)
        console.print(t)


def machine_info() -> dict[str, Any]:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    commit = "?"
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        commit = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout.strip()
        if dirty:  # (what ran is not that commit)
            commit += " + uncommitted changes"
    from sandfleet.runtime import cgroups

    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "mem_total_gib": round(meminfo_kib("MemTotal") / 1024**2, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "cgroup": cgroups.detect(),
        "sandfleet_commit": commit,
        "loadavg_start": Path("/proc/loadavg").read_text().split()[0],
        "versions": {
            "crun": version_of(["crun", "--version"]),
            "bwrap": version_of(["bwrap", "--version"]),
            "runsc": version_of(["runsc", "--version"]),
            "podman": version_of(["podman", "--version"]),
            "docker": version_of(["docker", "--version"]),
            "util-linux (nsenter)": version_of(["nsenter", "--version"]),
        },
    }


def write_checkpoint_markdown(res: dict[str, Any], path: Path) -> None:
    """`run.py --only checkpoint`: B1 / B2 for each image, then where the time went."""
    m = res["meta"]
    cfg = res["config"]
    images = [res[k] for k in ("python", "python_think", "busybox", "busybox_think") if res.get(k)]
    first = images[0] if images else {}
    lines = [
        f"# sandfleet checkpoint and rollback in place, {m['date']} (commit {m['sandfleet_commit']})",
        "",
        f"{m['nproc']} CPUs ({m['cpu']}), {m['mem_total_gib']} GiB, kernel {m['kernel']}, cgroup {m['cgroup']}, "
        f"criu {m.get('criu') or '?'}. Load average at start / end: {m['loadavg_start']} / "
        f"{m.get('loadavg_end', '?')}.",
        "",
        f"Produced by `python3 bench/run.py --only checkpoint`{' --quick' if cfg['quick'] else ''}; every figure and "
        "round is also in `checkpoint.json`. One sandbox per image, with a session (`sb.session()`, cwd and a "
        f"variable set), a background process (`sb.start(...)`: python holding {cfg['hold_mib']} MiB of random "
        f"bytes, anonymous memory; `sleep` in busybox) and a repo of {first.get('repo_files', '?')} small files "
        f"under /work/repo. Each round: one repo file edited through the session and {first.get('dirty_mib', '?')} MiB "
        "written (`head -c ... /dev/urandom`), then **B1** `cp = sb.checkpoint()`; a change to throw away; then "
        '**B2** `sb.rollback(cp); sb.exec("true")`; then a check that files, session and background process are '
        f"the checkpoint's, and `sb.delete_checkpoint(cp)`. {cfg['rounds']} timed rounds after "
        f"{cfg['warm_up_rounds']} warm-up. Wall times through the sync SDK over the daemon's unix socket; "
        '"server" is the daemon\'s own `cp.seconds` / `RollbackResult.seconds` (the same figures as the '
        "`checkpoint` / `rolled_back` journal events).",
        "",
        "## B1 / B2",
        "",
        "| image | memory (start / end) | B1 checkpoint p50 / p90 | B1 server (`cp.seconds`) p50 / p90 | size p50 "
        "| B2 rollback + first exec p50 / p90 | rollback call p50 / p90 | rollback server p50 / p90 "
        "| rollbacks through a standby |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def label(r: dict[str, Any]) -> str:
        think = r.get("think_s") or 0
        return f"{r['image']}, {think:g} s to think" if think else r["image"]

    def pp(s: dict[str, Any]) -> str:
        return f"{s['p50_ms']:.1f} / {s['p90_ms']:.1f} ms"

    def row(label: str, cells: Sequence[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    def ms(x: Any) -> str:
        return f"{x:.1f} ms" if isinstance(x, int | float) else "?"

    for r in images:
        row(
            label(r),
            [
                f"{r['memory_mib']:.0f} / {r['memory_mib_end']:.0f} MiB",
                pp(r["checkpoint_client"]),
                pp(r["checkpoint_server"]),
                f"{r['size_mib_p50']:.1f} MiB",
                pp(r["rollback_to_first_exec"]),
                pp(r["rollback_call_client"]),
                pp(r["rollback_server"]),
                f"{r.get('rollbacks_through_a_standby', 0)} of {r['rounds']}",
            ],
        )
    lines += [
        "",
        "A checkpoint is restored ahead in the background (a standby, kept frozen); a rollback to it thaws "
        "that restore in the sandbox's place. Rolled back at once, the rollback waits for the standby still "
        "being made (about a restore); after the think time (a model choosing its next action) it is a swap.",
    ]
    header = ["", "| phase (p50 over the rounds) | " + " | ".join(label(r) for r in images) + " |"]
    header.append("|---|" + "---|" * len(images))
    lines += ["", "## Where a checkpoint's time goes", ""]
    lines += [
        "From the checkpoint's files, which the daemon's steps create in order (the folder, the writable-layer "
        "copy `fs/`, criu's `dump.log`, its images, `checkpoint.json`): birth and change times, stamped by the "
        "kernel's coarse clock (a 4 ms tick here), so each phase is +-4 ms. criu's own figures are from its "
        "`stats-dump` image (microseconds).",
        *header,
    ]
    cps = [r.get("checkpoint_breakdown_p50") or {} for r in images]
    for phase in (cps[0] if cps else {}).get("phases_ms", {}):
        row(phase, [ms(c.get("phases_ms", {}).get(phase)) for c in cps])
    row("sum of the phases", [ms(sum(c.get("phases_ms", {}).values())) for c in cps])
    row("server total (`cp.seconds`)", [ms(r["checkpoint_server"]["p50_ms"]) for r in images])
    row("client total", [ms(r["checkpoint_client"]["p50_ms"]) for r in images])
    for key, label in (
        ("frozen_us", "criu: tasks frozen by criu (its whole dump)"),
        ("memdump_us", "criu: memory drained (parasite -> pipes)"),
        ("memwrite_us", "criu: memory written to the images"),
    ):
        row(label, [ms(c.get("criu", {}).get(key, 0) / 1000) for c in cps])
    row("criu: pages written", [str(c.get("criu", {}).get("pages_written", "?")) for c in cps])
    reps = [r.get("copy_replay_ms") or {} for r in images]
    row(
        "the same `cp -a` replayed by the bench: to the checkpoints' fs / to a tmpfs",
        [f"{ms(x.get('same_fs_as_checkpoints'))} / {ms(x.get('tmpfs'))}" for x in reps],
    )
    for key in (cps[0] if cps else {}).get("bytes", {}):
        if key.startswith("files"):
            row(key, [str(c.get("bytes", {}).get(key, "?")) for c in cps])
        else:
            row(f"size: {key}", [f"{c.get('bytes', {}).get(key, 0) / 2**20:.2f} MiB" for c in cps])
    lines += ["", "## Where a rollback's time goes", ""]
    lines += [
        "From the call's wall clock, the new sandbox directory's birth, criu's `restore.log` (birth) and pid file "
        "(written as the restore ends), and the call's return: +-4 ms each. criu's figures are from its "
        "`stats-restore` image.",
        *header,
    ]
    rbs = [r.get("rollback_breakdown_p50") or {} for r in images]
    for phase in (rbs[0] if rbs else {}).get("phases_ms", {}):
        row(phase, [ms(c.get("phases_ms", {}).get(phase)) for c in rbs])
    row("rollback call, client", [ms(r["rollback_call_client"]["p50_ms"]) for r in images])
    row(
        "first exec after it",
        [ms(r["rollback_to_first_exec"]["p50_ms"] - r["rollback_call_client"]["p50_ms"]) for r in images],
    )
    for key, label in (("forking_us", "criu: forking the tree"), ("restore_us", "criu: restoring it")):
        row(label, [ms(c.get("criu", {}).get(key, 0) / 1000) for c in rbs])
    row("criu: pages restored", [str(c.get("criu", {}).get("pages_restored", "?")) for c in rbs])
    fork = res.get("fork16")
    if fork:
        lines += [
            "",
            f"## B3 / B4: a fork of {fork['children']} from the python parent ({fork['hold_mib']} MiB held)",
            "",
            "ksmd stopped meanwhile (no merging). The call returns once every child's agent answered.",
            "",
            "| figure | value |",
            "|---|---|",
            f"| B3 fork call, until all {fork['children']} are exec-ready | {fork['fork_ms']:.0f} ms |",
            f"| of which the parent's snapshot | {fork['snapshot_ms']:.0f} ms |",
            f"| of which the {fork['children']} restores (2 cores) | {fork['restores_ms']:.0f} ms |",
            f"| then one exec in each, in turn | {fork['fork_and_one_exec_each_ms'] - fork['fork_ms']:.0f} ms |",
            f"| parent's memory cgroup | {fork['parent_mib']:.0f} MiB |",
            f"| the children's memory cgroups, summed | {fork['children_cgroups_mib']:.0f} MiB |",
            f"| MemAvailable's drop | {fork['children_mem_available_drop_mib']:.0f} MiB |",
            f"| B4 children / parent | {fork['children_over_parent']:.2f}x |",
        ]
    if res.get("targets"):
        lines += ["", "## Targets (from the issue)", "", "| target | measured | met |", "|---|---|---|"]
        for t in res["targets"]:
            unit = "x" if t["target"].startswith("B4") else " ms"
            lines.append(f"| {t['target']} | {t['measured']:.2f}{unit} | {'yes' if t['met'] else '**no**'} |")
    errors = sorted({e for r in images for e in r.get("timeline_errors", [])})
    if errors:
        lines += ["", "Breakdown not read in some rounds: " + "; ".join(f"`{e}`" for e in errors)]
    if res.get("daemon_crashes"):
        lines += ["", f"**The daemon crashed {len(res['daemon_crashes'])} time(s)**: see `checkpoint.json`."]
    lines.append("")
    path.write_text("\n".join(lines))
