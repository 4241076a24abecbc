"""`sandfleet` command line: serve, gateway, cluster, create, exec, shell, ls, rm, pause, resume, network,
audit, snapshot, pack, fork, checkpoint, checkpoints, rollback, delete-checkpoint, images, doctor, demo, e2b."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
import time
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from sandfleet.cli_common import SocketOpt, _client, _fail, _pairs, console, err_console
from sandfleet.cli_e2b import serve as e2b_serve
from sandfleet.cli_images import images_app
from sandfleet.client import AsyncClient, Client, Sandbox
from sandfleet.cluster.cli import cluster_app
from sandfleet.cluster.cli import gateway as cluster_gateway
from sandfleet.errors import SandboxError
from sandfleet.models import Backend, NetworkPolicy, Resources, SandboxSpec

app = typer.Typer(help="sandfleet: elastic sandboxes for agentic RL.", no_args_is_help=True, add_completion=False)
app.add_typer(images_app, name="images")
app.add_typer(cluster_app, name="cluster")
app.command(name="gateway")(cluster_gateway)
app.command(name="e2b")(e2b_serve)


# -- serve ----------------------------------------------------------------------------------------


@app.command()
def serve(
    config: Annotated[Path | None, typer.Option(help="TOML config file")] = None,
    socket: Annotated[Path | None, typer.Option(help="unix socket path")] = None,
    state_dir: Annotated[Path | None, typer.Option(help="state directory")] = None,
    run_dir: Annotated[Path | None, typer.Option(help="runtime directory")] = None,
    tcp: Annotated[str | None, typer.Option(help="also listen on HOST:PORT (needs --token)")] = None,
    token: Annotated[str | None, typer.Option(envvar="SANDFLEET_TOKEN", help="bearer token")] = None,
    max_sandboxes: Annotated[int | None, typer.Option(help="admission limit")] = None,
    stopped_retention: Annotated[float | None, typer.Option(help="seconds stopped sandboxes stay listed")] = None,
    ready_file: Annotated[Path | None, typer.Option(help="write our pid here once serving")] = None,
) -> None:
    """Run the node daemon (as root)."""
    from sandfleet.daemon.config import DaemonConfig
    from sandfleet.daemon.server import prepare_process
    from sandfleet.daemon.server import serve as run

    try:
        cfg = DaemonConfig.load(
            config,
            socket=socket,
            state_dir=state_dir,
            run_dir=run_dir,
            tcp=tcp,
            token=token,
            max_sandboxes=max_sandboxes,
            stopped_retention=stopped_retention,
        )
    except (OSError, ValueError) as exc:
        # an unreadable file, bad TOML or settings: said whole, each line unwrapped (not in a panel)
        err_console.print(f"error: invalid daemon configuration: {exc}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from exc
    prepare_process(cfg)
    console.print(f"sandfleet daemon listening on {cfg.socket}" + (f" and {cfg.tcp}" if cfg.tcp else ""))
    asyncio.run(run(cfg, ready_file=ready_file))


# -- sandboxes --------------------------------------------------------------------------------------


@app.command()
def create(
    image: Annotated[str | None, typer.Option(help="image reference (default busybox unless --layer)")] = None,
    layer: Annotated[
        list[str] | None, typer.Option(help="a layer or image stacked on top, bottom -> top; repeatable")
    ] = None,
    cpu: float = 1.0,
    memory: str = "1GiB",
    disk: str = "1GiB",
    pids: int = 512,
    label: Annotated[list[str] | None, typer.Option(help="KEY=VALUE, repeatable")] = None,
    env: Annotated[list[str] | None, typer.Option(help="KEY=VALUE, repeatable")] = None,
    idle_ttl: Annotated[float | None, typer.Option(help="seconds")] = 600.0,
    network: Annotated[
        list[str] | None, typer.Option(help="a service (pypi) or host[:port] the sandbox may reach; repeatable")
    ] = None,
    socket: SocketOpt = None,
) -> None:
    """Create a sandbox and print its id."""
    try:
        spec = SandboxSpec(
            image=image,
            layers=layer or [],
            resources=Resources(cpu=cpu, memory=memory, disk=disk, pids=pids),
            labels=_pairs(label, "label"),
            env=_pairs(env, "env"),
            idle_ttl=idle_ttl,
            network=NetworkPolicy.model_validate(network or "none"),
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    with _client(socket) as fleet:
        try:
            console.print(fleet.create(spec).id)
        except SandboxError as exc:
            raise _fail(exc) from exc


@app.command(name="exec", context_settings={"allow_interspersed_args": False})
def exec_(
    sandbox_id: str,
    command: Annotated[list[str], typer.Argument(help="command and arguments (use -- before options)")],
    timeout: float = 60.0,
    user: str | None = None,
    cwd: str | None = None,
    socket: SocketOpt = None,
) -> None:
    """Run a command in a sandbox, streaming its output; exits with its exit code."""
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise typer.BadParameter("no command given")
    argv: str | list[str] = command[0] if len(command) == 1 else command
    with _client(socket) as fleet:
        try:
            sb = fleet.get(sandbox_id)
            code = 0
            for ev in sb.exec_stream(argv, timeout=timeout, user=user, cwd=cwd):
                if ev.type == "stdout":
                    sys.stdout.write(ev.data)
                    sys.stdout.flush()
                elif ev.type == "stderr":
                    sys.stderr.write(ev.data)
                    sys.stderr.flush()
                elif ev.result is not None:
                    code = ev.result.exit_code
                    if ev.result.timed_out:
                        err_console.print(f"[yellow]timed out after {timeout}s[/yellow]")
        except SandboxError as exc:
            raise _fail(exc) from exc
    raise typer.Exit(code)


@app.command()
def shell(
    sandbox_id: str,
    command: Annotated[str | None, typer.Option("--command", "-c", help="run this instead of the login shell")] = None,
    line_mode: Annotated[bool, typer.Option("--line-mode", help="a line-by-line session even on a terminal")] = False,
    socket: SocketOpt = None,
) -> None:
    """A shell in a sandbox: a real terminal (raw mode, the window size followed, Ctrl-C to the job
    in the sandbox) when this one is a terminal; otherwise a line-by-line session (cd and variables
    carry over) reading commands from standard input."""
    if not line_mode and sys.stdin.isatty() and sys.stdout.isatty():
        raise typer.Exit(asyncio.run(_attach(socket, sandbox_id, command)))
    with _client(socket) as fleet:
        try:
            sb = fleet.get(sandbox_id)
            session = sb.session()
        except SandboxError as exc:
            raise _fail(exc) from exc
        console.print(f"[dim]session {session.id} in {sb.id}; exit or Ctrl-D to leave[/dim]")
        try:
            while True:
                try:
                    line = input(f"{sb.id}$ ")
                except EOFError:
                    break
                if line.strip() in ("exit", "logout"):
                    break
                if not line.strip():
                    continue
                try:
                    r = session.run(line, timeout=300)
                except SandboxError as exc:
                    err_console.print(f"[red]{exc.code}[/red]: {exc.message}")
                    continue
                sys.stdout.write(r.stdout)
                sys.stderr.write(r.stderr)
                if r.exit_code:
                    err_console.print(f"[dim]exit {r.exit_code}[/dim]")
        finally:
            with contextlib.suppress(SandboxError):
                session.close()


async def _attach(socket: Path | None, sandbox_id: str, command: str | None) -> int:
    from sandfleet.client.tty import attach

    try:
        async with AsyncClient(socket) as fleet:
            return await attach(await fleet.get(sandbox_id), command)
    except SandboxError as exc:
        raise _fail(exc) from exc
    except asyncio.CancelledError:  # SIGTERM or SIGHUP: the terminal is restored by now
        return 128 + 15


@app.command(name="ls")
def list_(
    label: Annotated[list[str] | None, typer.Option(help="KEY=VALUE filter")] = None,
    state: str | None = None,
    socket: SocketOpt = None,
) -> None:
    """List sandboxes."""
    with _client(socket) as fleet:
        try:
            items = fleet.list(_pairs(label, "label"), state)
        except SandboxError as exc:
            raise _fail(exc) from exc
    table = Table("ID", "STATE", "IMAGE", "CPU", "MEMORY", "AGE", "LABELS")
    now = time.time()
    for s in items:
        r = s.spec.resources
        table.add_row(
            s.id,
            s.state,
            s.spec.environment(),
            f"{r.cpu:g}",
            f"{r.memory / 1024**2:.0f}MiB",
            f"{now - s.created_at:.0f}s",
            ",".join(f"{k}={v}" for k, v in s.spec.labels.items()),
        )
    console.print(table)


def _by_id_or_label(
    socket: Path | None,
    sandbox_ids: list[str] | None,
    label: list[str] | None,
    one: Callable[[Sandbox], object],
    many: Callable[[Client, dict[str, str]], list[str]],
) -> None:
    """Apply `one` to each sandbox id and `many` to the label selector; print the ids affected."""
    with _client(socket) as fleet:
        try:
            for sid in sandbox_ids or []:
                one(fleet.get(sid))
                console.print(sid)
            if label:
                for sid in many(fleet, _pairs(label, "label")):
                    console.print(sid)
        except SandboxError as exc:
            raise _fail(exc) from exc


@app.command(name="rm")
def remove(
    sandbox_ids: Annotated[list[str] | None, typer.Argument()] = None,
    label: Annotated[list[str] | None, typer.Option(help="stop all sandboxes with KEY=VALUE")] = None,
    socket: SocketOpt = None,
) -> None:
    """Stop sandboxes by id or by label."""
    _by_id_or_label(socket, sandbox_ids, label, lambda sb: sb.stop(), lambda fleet, sel: fleet.stop_many(sel))


@app.command()
def pause(
    sandbox_ids: Annotated[list[str] | None, typer.Argument()] = None,
    label: Annotated[list[str] | None, typer.Option(help="pause all running sandboxes with KEY=VALUE")] = None,
    socket: SocketOpt = None,
) -> None:
    """Pause sandboxes by id or by label: freeze them and push their memory out."""
    _by_id_or_label(socket, sandbox_ids, label, lambda sb: sb.pause(), lambda fleet, sel: fleet.pause_many(sel))


@app.command()
def resume(
    sandbox_ids: Annotated[list[str] | None, typer.Argument()] = None,
    label: Annotated[list[str] | None, typer.Option(help="resume all paused sandboxes with KEY=VALUE")] = None,
    socket: SocketOpt = None,
) -> None:
    """Resume paused sandboxes by id or by label (any request to a paused sandbox also resumes it)."""
    _by_id_or_label(socket, sandbox_ids, label, lambda sb: sb.resume(), lambda fleet, sel: fleet.resume_many(sel))


@app.command(name="network")
def network_(
    sandbox_ids: Annotated[list[str] | None, typer.Argument()] = None,
    allow: Annotated[
        list[str] | None, typer.Option(help="a service or host[:port] to allow, repeatable; none: no network")
    ] = None,
    label: Annotated[list[str] | None, typer.Option(help="every running or paused sandbox with KEY=VALUE")] = None,
    socket: SocketOpt = None,
) -> None:
    """Set the egress policy of sandboxes, at once (no --allow: none, loopback only)."""
    policy = allow or "none"
    _by_id_or_label(
        socket, sandbox_ids, label, lambda sb: sb.set_network(policy), lambda fleet, sel: fleet.set_network(sel, policy)
    )


@app.command()
def audit(
    follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing records as they come")] = False,
    since: Annotated[int, typer.Option(help="records after this seq")] = 0,
    kind: Annotated[list[str] | None, typer.Option(help="api, connection, finding, ...; repeatable")] = None,
    sandbox: Annotated[str | None, typer.Option(help="only this sandbox's records")] = None,
    limit: int = 1000,
    socket: SocketOpt = None,
) -> None:
    """Print the node's audit stream as JSON lines (API calls, connections, limits hit, findings)."""
    with _client(socket) as fleet:
        try:
            if follow:
                with fleet.follow_audit(since=since, kinds=kind, sandbox_id=sandbox) as records:
                    for rec in records:
                        print(rec.model_dump_json(), flush=True)  # noqa: T201 (JSON lines for jq)
            else:
                for rec in fleet.audit(since=since, kinds=kind, sandbox_id=sandbox, limit=limit).records:
                    print(rec.model_dump_json())  # noqa: T201
        except SandboxError as exc:
            raise _fail(exc) from exc
        except KeyboardInterrupt:
            pass


@app.command()
def snapshot(sandbox_id: str, socket: SocketOpt = None) -> None:
    """Checkpoint a sandbox (processes, memory, files) and print the snapshot's id; it keeps running."""
    with _client(socket) as fleet:
        try:
            snap = fleet.get(sandbox_id).snapshot()
        except SandboxError as exc:
            raise _fail(exc) from exc
        console.print(f"{snap.id}  ({snap.size_bytes / 2**20:.1f} MiB, {snap.seconds:.3f} s)")


@app.command()
def pack(
    sandbox_id: str,
    image: Annotated[str, typer.Argument(help="name:tag of the new image")],
    exclude: Annotated[
        list[str] | None, typer.Option(help="absolute path whose changes to leave out, repeatable")
    ] = None,
    socket: SocketOpt = None,
) -> None:
    """Save a sandbox's changes as a new image (its layers + one layer of what it changed)."""
    with _client(socket) as fleet:
        try:
            info = fleet.get(sandbox_id).pack(image, exclude=exclude or [])
        except SandboxError as exc:
            raise _fail(exc) from exc
        console.print(f"{info.name}:{info.tag}  ({len(info.layers)} layers, {info.size / 2**20:.1f} MiB)")


@app.command()
def fork(
    source: Annotated[str, typer.Argument(help="a sandbox id (forked as it is now) or a snapshot id (snap-...)")],
    count: Annotated[int, typer.Option("-n", "--count", help="how many children")] = 1,
    label: Annotated[list[str] | None, typer.Option(help="KEY=VALUE for the children, repeatable")] = None,
    socket: SocketOpt = None,
) -> None:
    """Start sandboxes from a live sandbox or a snapshot; print each child's id (or its error)."""
    labels = _pairs(label, "label")
    with _client(socket) as fleet:
        try:
            if source.startswith("snap-"):
                results = fleet.restore(source, count, labels)
            else:
                results = fleet.get(source).fork(count, labels)
        except SandboxError as exc:
            raise _fail(exc) from exc
        for r in results:
            if isinstance(r, SandboxError):
                err_console.print(f"[red]error[/red] ({r.code}): {r.message}")
            else:
                console.print(r.id)


# -- checkpoints (in place) -----------------------------------------------------------------------


@app.command()
def checkpoint(
    sandbox_id: str,
    label: Annotated[list[str] | None, typer.Option(help="KEY=VALUE for the checkpoint, repeatable")] = None,
    socket: SocketOpt = None,
) -> None:
    """Checkpoint a sandbox to roll it back to later (processes, memory, files, sessions) and print the
    checkpoint's id; it keeps running. Its checkpoints go when it stops."""
    labels = _pairs(label, "label")
    with _client(socket) as fleet:
        try:
            cp = fleet.get(sandbox_id).checkpoint(labels=labels)
        except SandboxError as exc:
            raise _fail(exc) from exc
        console.print(f"{cp.id}  ({cp.size_bytes / 2**20:.1f} MiB, {cp.seconds:.3f} s)")


@app.command()
def checkpoints(sandbox_id: str, socket: SocketOpt = None) -> None:
    """List a sandbox's checkpoints, oldest first."""
    with _client(socket) as fleet:
        try:
            items = fleet.get(sandbox_id).checkpoints()
        except SandboxError as exc:
            raise _fail(exc) from exc
    table = Table("ID", "CREATED", "SIZE", "SECONDS", "LABELS")
    for cp in items:
        table.add_row(
            cp.id,
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(cp.created_at)),
            f"{cp.size_bytes / 2**20:.1f}MiB",
            f"{cp.seconds:.3f}",
            ",".join(f"{k}={v}" for k, v in cp.labels.items()),
        )
    console.print(table)


@app.command()
def rollback(
    sandbox_id: str,
    checkpoint_id: Annotated[str, typer.Argument(metavar="CHECKPOINT", help="one of the sandbox's checkpoints")],
    socket: SocketOpt = None,
) -> None:
    """Put a sandbox back to a checkpoint, in place; print what was dropped (sessions and background
    processes started after it) and how long it took."""
    with _client(socket) as fleet:
        try:
            r = fleet.get(sandbox_id).rollback(checkpoint_id)
        except SandboxError as exc:
            raise _fail(exc) from exc
    dropped = [f"sessions {', '.join(r.dropped_sessions)}"] if r.dropped_sessions else []
    dropped += [f"processes {', '.join(r.dropped_processes)}"] if r.dropped_processes else []
    console.print(
        f"{r.sandbox_id} back to {r.checkpoint_id}  ({r.seconds:.3f} s); dropped: {'; '.join(dropped) or 'nothing'}"
    )


@app.command()
def delete_checkpoint(
    sandbox_id: str,
    checkpoint_ids: Annotated[list[str], typer.Argument(metavar="CHECKPOINT", help="checkpoints of the sandbox")],
    socket: SocketOpt = None,
) -> None:
    """Delete checkpoints of a sandbox; print each id deleted."""
    with _client(socket) as fleet:
        try:
            sb = fleet.get(sandbox_id)
            for cid in checkpoint_ids:
                sb.delete_checkpoint(cid)
                console.print(cid)
        except SandboxError as exc:
            raise _fail(exc) from exc


# -- doctor ---------------------------------------------------------------------------------------


@app.command()
def doctor(state_dir: Path = Path("/var/lib/sandfleet"), socket: SocketOpt = None) -> None:
    """Check this host for what sandfleet needs; say how to fix what is missing."""
    from sandfleet.backends.tiers import tier_checks
    from sandfleet.runtime.doctor import Check, run_checks

    def daemon_check() -> Check:
        sock = socket or Path("/run/sandfleet/sandfleet.sock")
        if not sock.exists():
            return Check("daemon", "warn", f"not running ({sock} missing): sandfleet serve")
        try:
            with Client(sock) as c:
                h = c.health()
        except SandboxError as exc:
            return Check("daemon", "warn", f"{sock} exists but does not answer: {exc.message}")
        tiers = ", ".join(h.get("tiers", {}))
        return Check("daemon", "ok", f"{sock}: {h.get('sandboxes_running')} sandboxes running; tiers {tiers}")

    table = Table("CHECK", "STATUS", "DETAIL / FIX")
    failed = 0
    host = list(run_checks(state_dir=state_dir))
    for check in [*host, *tier_checks(host), daemon_check()]:
        status = {"ok": "[green]ok[/green]", "warn": "[yellow]warn[/yellow]", "fail": "[red]FAIL[/red]"}[check.status]
        failed += check.status == "fail"
        table.add_row(check.name, status, check.detail)
    console.print(table)
    raise typer.Exit(1 if failed else 0)


# -- demo -----------------------------------------------------------------------------------------


@app.command()
def demo(
    task: Annotated[
        str,
        typer.Option(
            help="more-itertools: a real task (a bug in more-itertools from PyPI, graded by its hidden suite, "
            "16-rollout groups forked from a set-up state); toy: a few turns on a one-line bug; search: a "
            "best-first search on the same task, by checkpoint/rollback, by fork per node, by a fresh sandbox per node"
        ),
    ] = "more-itertools",
    groups: Annotated[
        int | None, typer.Option(help="more-itertools: groups of rollouts, one after the other [1]")
    ] = None,
    group_size: Annotated[int | None, typer.Option(help="more-itertools: rollouts per group, at once [16]")] = None,
    sandboxes: Annotated[int | None, typer.Option(help="toy: parallel rollouts [8]")] = None,
    expansions: Annotated[int | None, typer.Option(min=1, help="search: expansions per search, at most [24]")] = None,
    image: Annotated[str | None, typer.Option(help="toy: the image [python:3.11]")] = None,
    backend: Annotated[
        str,
        typer.Option(
            help="isolation tier: container, fncall, microvm or vm (toy: any; more-itertools: a tier that can "
            "snapshot and pack, else it refuses; VMs: fewer rollouts under TCG)"
        ),
    ] = "container",
    socket: SocketOpt = None,
) -> None:
    """A demo rollout: start a daemon if none runs, then run RL rollouts on it (see --task)."""
    from sandfleet import search_demo
    from sandfleet.daemon.node.process import DaemonProcess, DaemonStartError
    from sandfleet.demo import run_demo

    if task not in ("more-itertools", "toy", "search"):
        err_console.print(f"[red]no task {task!r}: more-itertools, toy or search[/red]")
        raise typer.Exit(2)
    if backend not in typing.get_args(Backend):
        err_console.print(f"[red]no tier {backend!r}: {', '.join(typing.get_args(Backend))}[/red]")
        raise typer.Exit(2)
    # An option of the other task would be ignored: say so instead.
    own = {"toy": "--sandboxes --image", "more-itertools": "--groups --group-size", "search": "--expansions"}[task]
    options = {"--groups": groups, "--group-size": group_size, "--sandboxes": sandboxes, "--image": image}
    given = [k for k, v in {**options, "--expansions": expansions}.items() if v is not None and k not in own.split()]
    if given:
        err_console.print(f"[red]{', '.join(given)}: not an option of --task {task}[/red]")
        raise typer.Exit(2)
    sock = socket or Path(os.environ.get("SANDFLEET_SOCKET", "/run/sandfleet/sandfleet.sock"))
    with contextlib.ExitStack() as stack:
        try:
            Client(sock).health()
        except SandboxError:
            console.print("[dim]no daemon running: starting an embedded one[/dim]")
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sandfleet-demo-")))
            args = ["--socket", str(sock)]
            if backend in ("microvm", "vm"):  # the default node runs container and fncall only
                config = workdir / "demo.toml"
                config.write_text("".join(f'[[backends]]\ntype = "{t}"\n' for t in ("container", "fncall", backend)))
                args += ["--config", str(config)]
            daemon = DaemonProcess(args, workdir=workdir)
            stack.callback(daemon.stop)
            try:
                daemon.start(timeout=60)
            except DaemonStartError as exc:
                err_console.print(f"[red]the daemon did not start ({exc}); try `sandfleet doctor`[/red]")
                raise typer.Exit(1) from None
        if task == "toy":
            n, ref = 8 if sandboxes is None else sandboxes, image or "python:3.11"
            ok = run_demo(console, sock, n, ref, backend=typing.cast(Backend, backend))
        elif task == "search":
            raise typer.Exit(search_demo.run_demo(console, err_console, sock, expansions or 24, backend))
        else:
            size = (1 if groups is None else groups, 16 if group_size is None else group_size)
            ok = _rl_demo(sock, *size, typing.cast(Backend, backend))
    raise typer.Exit(0 if ok else 1)


def _rl_demo(sock: Path, groups: int, group_size: int, backend: Backend) -> bool:
    from sandfleet.rl_demo import run_task, show, tier_refusal

    async def go() -> bool:
        async with AsyncClient(sock, timeout=120) as fleet:
            refusal = tier_refusal(await fleet.tiers(), backend)
            if refusal is not None:
                err_console.print(f"[red]{escape(refusal)}: run it on the container tier, or --task toy[/red]")
                raise typer.Exit(2)
            with console.status("building the task (more-itertools from PyPI; python:3.11 on first use)..."):
                await fleet.build_image("python:3.11")
            return show(console, await run_task(fleet, groups, group_size, backend))

    try:
        return asyncio.run(go())
    except SandboxError as exc:
        err_console.print(f"[red]{exc.code} ({exc.cause}): {exc.message}[/red]")
        return False


def main() -> None:
    app()
