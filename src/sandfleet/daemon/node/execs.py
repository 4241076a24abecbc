"""Commands in a sandbox: exec (whole or streamed) and background processes.

Each command goes to the sandbox's agent as one EXEC; the daemon keeps its own deadline on it
(the command's timeout plus a grace) and pings the agent meanwhile (core.await_agent). Exit
statuses become `ExecResult`s; a SIGKILL the cgroup counted as an OOM kill says so. Background
processes keep their output (capped) until someone waits for them; a stop hook marks them lost
when their sandbox stops.

A command that runs a while is watched (cpuwatch.py: its CPU budget, and whether the node starved
it when its timeout fired), on a tier whose commands are host processes (HostProcesses); elsewhere
a CPU budget is `unsupported`.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import codecs
import contextlib
import errno
import secrets
import shlex
import signal
import time
from collections.abc import AsyncGenerator

import pydantic

from sandfleet.backends.base import HostProcesses, LiveSandbox, offers
from sandfleet.daemon.net.sandbox_network import Networking
from sandfleet.daemon.node.core import AGENT_START_TIMEOUT, EventStream, NodeCore, resolve_cwd, wire_text
from sandfleet.daemon.node.cpuwatch import CommandWatch, boot_ticks
from sandfleet.daemon.node.lifecycle import HOLDING_STATES, PAUSED, BackgroundProcess, Sandbox, forget_finished
from sandfleet.daemon.node.pausing import Pauser
from sandfleet.daemon.node.process_output import follow
from sandfleet.daemon.node.sandbox_files import Files
from sandfleet.errors import (
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
    UnsupportedError,
    WrongStateError,
)
from sandfleet.models import ExecEvent, ExecRequest, ExecResult, ProcessInfo, TerminalRequest, shown, validation_message
from sandfleet.runtime.agent_errors import AgentError, ChannelClosedError, ExecStartError, ProtocolError
from sandfleet.runtime.agent_exec import ExecProcess
from sandfleet.runtime.agent_wire import AGENT_VERSION, SCOPE_TREE, ExitInfo, OutputChunk

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

FATAL_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP})

KILL_WAIT = 2.0  # after a fatal signal to a background process: wait this long for its exit
_NO_PTY = frozenset({errno.ENOSPC, errno.EAGAIN, errno.EMFILE, errno.ENFILE, errno.ENOMEM})  # none left


def _argv(req: ExecRequest) -> list[str]:
    """A string command runs under /bin/sh -c; a list is the argv itself."""
    return ["/bin/sh", "-c", req.command] if isinstance(req.command, str) else list(req.command)


def _exec_result(out: bytes, err: bytes, ex: ExitInfo, encoding: str = "utf-8") -> ExecResult:
    return ExecResult(
        exit_code=ex.exit_code,
        stdout=wire_text(out, encoding),
        stderr=wire_text(err, encoding),
        duration=ex.duration,
        timed_out=ex.timed_out,
        stdout_truncated=ex.stdout_truncated,
        stderr_truncated=ex.stderr_truncated,
        signal=ex.signal,
        encoding=encoding,
    )


async def _nothing() -> None:
    return None


def _start_failure(exc: ExecStartError, req: ExecRequest) -> ExecResult:
    # Shell conventions: 127 = not found, 126 = found but not runnable.
    code = 127 if exc.errno == errno.ENOENT else 126
    return ExecResult(exit_code=code, stdout="", stderr=f"sandfleet: {_argv(req)[0]}: {exc.message}\n", duration=0.0)


class Execs:
    def __init__(self, core: NodeCore, pauser: Pauser, files: Files, networking: Networking) -> None:
        self.core = core
        self.pauser = pauser
        self.files = files
        self.networking = networking
        self._readable: dict[str, HostProcesses | None] = {}  # tier name -> the tier, if HostProcesses
        core.table.on_stopped(self._lost)

    @staticmethod
    def _lost(sb: Sandbox) -> None:
        """Stop hook: its background processes will never finish now."""
        for bp in sb.processes.values():
            bp.lost = bp.lost or f"sandbox {sb.id} stopped ({sb.stop_reason})"
            bp.ended()  # its followers too

    async def start(
        self,
        sb: Sandbox,
        live: LiveSandbox,
        req: ExecRequest,
        *,
        setsid: bool = False,
        keep_stdin: bool = False,
        uncapped: bool = False,
        session: bool = False,
        nondump: bool = False,
        low_fds: bool = False,
        lazy: bool = False,
    ) -> ExecProcess:
        if req.pty is not None and live.channel.agent_version not in (None, AGENT_VERSION):
            raise UnsupportedError(
                f"sandbox {sb.id} runs {live.channel.agent_version}, from before the daemon was upgraded; "
                f"terminals need {AGENT_VERSION}"
            )
        user = await self.files.user(sb, live, req.user or sb.spec.user)
        argv = _argv(req)
        env = {"PATH": DEFAULT_PATH, "HOME": user.home, "HOSTNAME": sb.spec.hostname or sb.id}
        if req.pty is not None:
            name = req.user or sb.spec.user or "root"
            env.update(TERM="xterm-256color", LANG="C.UTF-8", USER=name, LOGNAME=name)
        env.update(self.networking.env(sb))
        env.update(sb.spec.env)
        env.update(req.env)
        data = req.stdin_bytes()
        keep = keep_stdin or req.keep_stdin_open
        try:
            async with asyncio.timeout(AGENT_START_TIMEOUT):  # even an agent that stopped reading
                process = await live.channel.start(
                    argv,
                    env=env,
                    cwd=resolve_cwd(sb, req.cwd),
                    uid=user.uid,
                    gid=user.gid,
                    timeout=req.timeout,
                    out_cap=None if uncapped else req.output_limit,
                    stdin=data is not None or keep,
                    setsid=setsid,
                    merge_stderr=req.merge_stderr,
                    session=session,
                    nondump=nondump,
                    pty=None if req.pty is None else (req.pty.rows, req.pty.cols),
                    low_fds=low_fds,
                    lazy=lazy and not (data is not None or keep),  # (its input goes after STARTED)
                )
        except TimeoutError:
            raise self.core.unresponsive(sb, f"a command did not start within {AGENT_START_TIMEOUT:.0f}s") from None
        except ChannelClosedError as exc:
            raise UnavailableError(f"sandbox {sb.id} is not answering (its init exited)") from exc
        except ValueError as exc:  # the one agent message would exceed its 64 KiB
            raise InvalidArgumentError(
                f"the command, its environment and working directory are too large together ({exc}); "
                "write a script file and run it"
            ) from exc
        if req.pty is not None:
            keep = True  # typed into the terminal; closing our end of it would end nothing
        if data is not None or (keep is False and (req.stdin is not None or req.stdin_b64 is not None)):
            try:
                async with asyncio.timeout(AGENT_START_TIMEOUT):
                    if data:
                        await process.write_stdin(data)
                    if not keep:
                        await process.close_stdin()
            except TimeoutError:
                live.channel.kill_nowait(process.id)
                raise self.core.unresponsive(sb, "it stopped reading the command's standard input") from None
            except ChannelClosedError as exc:
                raise UnavailableError(f"sandbox {sb.id} stopped while the command started") from exc
        return process

    def _host_processes(self, sb: Sandbox) -> HostProcesses | None:
        """The sandbox's tier, if its commands are host processes the daemon can read (not a VM's)."""
        name = sb.spec.backend
        if name not in self._readable:  # a protocol's isinstance costs microseconds: once per tier
            tier = self.core.tier(sb)
            self._readable[name] = tier if isinstance(tier, HostProcesses) and offers(tier, "host_processes") else None
        return self._readable[name]

    def check_budget(self, sb: Sandbox) -> None:
        """A CPU budget counts the command's own processes: refused where the node cannot read them."""
        if self._host_processes(sb) is None:
            raise UnsupportedError(
                f"cpu_time: the {self.core.tier(sb).name} tier cannot measure a command's own CPU (its "
                "processes are not the node's); give it a timeout"
            )

    def _watch(
        self, sb: Sandbox, live: LiveSandbox, req: ExecRequest, process: ExecProcess, since: int
    ) -> CommandWatch | None:
        """The watch of a command started at `since` (cpuwatch.boot_ticks()), if it needs one."""
        if not CommandWatch.wanted(req):
            return None

        def kill() -> None:
            if not live.channel.closed:
                live.channel.kill_nowait(process.id)

        tier = self._host_processes(sb)
        return CommandWatch(
            req,
            init=0 if tier is None else tier.init_pid(live),
            pid=process.pid,
            since=since,
            cpu_limit=sb.spec.resources.cpu,
            node_cpus=self.core.admission.cpus,
            kill=kill,
        )

    async def after_exec(
        self, sb: Sandbox, req: ExecRequest, result: ExecResult, out_bytes: int, err_bytes: int
    ) -> ExecResult:
        """Record the exec; returns the result, with `oom_killed` set when the kernel's OOM killer
        ended it (a SIGKILL the cgroup counted as an OOM kill since we last looked)."""
        cmd = req.command if isinstance(req.command, str) else shlex.join(req.command)
        # Only a failed command can have hit a limit (killed, or a refused fork reported on stderr);
        # reading the cgroup after every successful exec would cost a thread hop for nothing.
        if sb.live is not None and (result.exit_code >= 128 or (result.exit_code != 0 and result.stderr)):
            new_ooms = await self.core.record_limits(sb, sb.live)
            # (the monitor's sweep may have noted this exec's OOM kill while it ran, a long one)
            while_it_ran = sb.oom_noted_at >= time.monotonic() - result.duration - 1.0
            killed = result.signal == signal.SIGKILL or result.exit_code == 128 + signal.SIGKILL
            if (new_ooms or while_it_ran) and killed and not result.timed_out:
                result = result.model_copy(update={"oom_killed": True})
        if result.cause is not None:
            self.core.metrics.failures.labels(cause=result.cause).inc()
        self.core.jobs.executed(sb, result, cmd)
        self.core.journal.record(
            sb.id,
            "exec",
            {
                "command": cmd[:1000],
                "exit_code": result.exit_code,
                "duration": round(result.duration, 6),
                "stdout_bytes": out_bytes,
                "stderr_bytes": err_bytes,
                "timed_out": result.timed_out,
                **({"oom_killed": True} if result.oom_killed else {}),
            },
        )
        if result.truncated:
            self.core.journal.record(
                sb.id,
                "output_truncated",
                {"stdout_bytes": out_bytes, "stderr_bytes": err_bytes, "limit": req.output_limit},
            )
        if result.timed_out:
            self.core.journal.record(sb.id, "exec_timeout", {"command": cmd[:1000], "timeout": req.timeout})
        return result

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        if req.cpu_time is not None:
            self.check_budget(self.core.sandbox(sandbox_id))
        sb, live = await self.pauser.ready(sandbox_id)
        if req.background:
            raise InvalidArgumentError("use the processes endpoint for background=true")
        deadline = self.core.busy(sb, req.timeout)
        t0 = time.perf_counter()
        terminal = int(req.pty is not None)
        sb.terminals += terminal
        try:
            since = boot_ticks()
            try:
                process = await self.start(sb, live, req, lazy=True)
            except ExecStartError as exc:
                return _start_failure(exc, req)
            watch = self._watch(sb, live, req, process, since)
            try:
                # a short command's whole answer came with its STARTED: nothing left to wait for
                done = process.collected()
                if done is None:
                    done = await self.core.await_agent(sb, live, process.wait(), deadline)
                out, err, ex = done
            except (ChannelClosedError, ProtocolError) as exc:
                raise UnavailableError(f"sandbox {sb.id} stopped while the command ran") from exc
            except BaseException:
                if not live.channel.closed:  # abandoned (deadline, client gone): don't leave it running
                    live.channel.kill_nowait(process.id)
                raise
            finally:
                if watch is not None:
                    watch.stop()
            result = _exec_result(out, err, ex, req.encoding)
            if watch is not None:
                result = watch.judged(result, ex.cpu)
            return await self.after_exec(sb, req, result, ex.stdout_bytes, ex.stderr_bytes)
        finally:
            sb.terminals -= terminal
            self.core.idle_done(sb)
            self.core.metrics.execs.inc()
            self.core.metrics.exec_seconds.observe(time.perf_counter() - t0)

    async def exec_stream(self, sandbox_id: str, req: ExecRequest) -> EventStream[ExecEvent]:
        """Validate and start now (so errors surface before streaming), then yield events."""
        if req.cpu_time is not None:
            self.check_budget(self.core.sandbox(sandbox_id))
        sb, live = await self.pauser.ready(sandbox_id)
        deadline = self.core.busy(sb, req.timeout)
        terminal = int(req.pty is not None)
        sb.terminals += terminal
        since = boot_ticks()
        try:
            process = await self.start(sb, live, req)
        except ExecStartError as exc:
            sb.terminals -= terminal
            self.core.idle_done(sb)
            failed = _start_failure(exc, req)

            async def failed_stream() -> AsyncGenerator[ExecEvent, None]:
                yield ExecEvent(type="stderr", data=wire_text(failed.stderr.encode(), req.encoding))
                yield ExecEvent(type="exit", result=failed.model_copy(update={"encoding": req.encoding}))

            return EventStream(failed_stream(), _nothing)
        except BaseException:
            sb.terminals -= terminal
            self.core.idle_done(sb)
            raise
        finished = False
        watch = self._watch(sb, live, req, process, since)

        async def release() -> None:
            if watch is not None:
                watch.stop()
            sb.terminals -= terminal
            self.core.idle_done(sb)
            self.core.metrics.execs.inc()
            if not finished and not live.channel.closed:
                # The client went away (mid-stream, or before it began): don't leave the command running.
                live.channel.kill_nowait(process.id)

        async def stream() -> AsyncGenerator[ExecEvent, None]:
            nonlocal finished
            decoders = {s: codecs.getincrementaldecoder("utf-8")("replace") for s in ("stdout", "stderr")}
            out: builtins.list[bytes] = []
            err: builtins.list[bytes] = []
            events = process.events()
            try:
                while True:
                    try:
                        ev = await self.core.await_agent(sb, live, anext(events), deadline)
                    except StopAsyncIteration:
                        break
                    if isinstance(ev, OutputChunk):
                        (out if ev.stream == "stdout" else err).append(ev.data)
                        if req.encoding == "base64":
                            yield ExecEvent(type=ev.stream, data=base64.b64encode(ev.data).decode())
                        else:
                            text = decoders[ev.stream].decode(ev.data)
                            if text:
                                yield ExecEvent(type=ev.stream, data=text)
                    elif isinstance(ev, ExitInfo):
                        result = _exec_result(b"".join(out), b"".join(err), ev, req.encoding)
                        if watch is not None:
                            result = watch.judged(result, ev.cpu)
                        result = await self.after_exec(sb, req, result, ev.stdout_bytes, ev.stderr_bytes)
                        finished = True
                        yield ExecEvent(type="exit", result=result)
                        break
            except (ChannelClosedError, ProtocolError) as exc:
                raise UnavailableError(f"sandbox {sb.id} stopped while the command ran") from exc
            finally:
                await wrapped.release()

        wrapped = EventStream(stream(), release)
        return wrapped

    async def open_terminal(self, sandbox_id: str, req: TerminalRequest) -> Terminal:
        """Start a command on a new pseudo-terminal for a client that relays keystrokes and output
        (the terminal WebSocket). It keeps the sandbox busy (no idle pause, no idle TTL) while open."""
        try:
            ereq = req.exec_request()
        except pydantic.ValidationError as exc:
            raise InvalidArgumentError(validation_message(exc.errors())) from None
        sb, live = await self.pauser.ready(sandbox_id)
        deadline = self.core.busy(sb, req.timeout)
        try:
            # no cap by default: the relay holds the command back when its client reads slowly
            process = await self.start(sb, live, ereq, uncapped=req.output_limit is None)
        except ExecStartError as exc:
            self.core.idle_done(sb)
            if exc.errno == errno.ENOSYS:  # an agent without terminals (the fake tier's)
                raise UnsupportedError(exc.message) from exc
            if exc.errno in _NO_PTY:
                why = errno.errorcode.get(exc.errno, str(exc.errno))
                raise ResourceExhaustedError(f"sandbox {sb.id} has no pseudo-terminal left ({why})") from exc
            raise InvalidArgumentError(_start_failure(exc, ereq).stderr.strip()) from exc
        except BaseException:
            self.core.idle_done(sb)
            raise
        sb.terminals += 1
        shown_as = ereq.model_copy(update={"command": req.command or "(login shell)"})  # for events
        self.core.journal.record(
            sb.id, "terminal_opened", {"command": str(shown_as.command)[:1000], "pid": process.pid}
        )
        return Terminal(self, sb, live, process, shown_as, deadline)

    async def start_process(self, sandbox_id: str, req: ExecRequest) -> ProcessInfo:
        if req.pty is not None:
            raise InvalidArgumentError("pty: a background process has no terminal; use a terminal (sb.terminal())")
        if req.cpu_time is not None:
            self.check_budget(self.core.sandbox(sandbox_id))
        sb, live = await self.pauser.ready(sandbox_id)
        self.core.touch(sb)
        since = boot_ticks()
        try:
            process = await self.start(sb, live, req, setsid=True)
        except ExecStartError as exc:
            raise InvalidArgumentError(_start_failure(exc, req).stderr.strip()) from exc
        watch = self._watch(sb, live, req, process, since)
        bp = BackgroundProcess(
            "p-" + secrets.token_hex(6),
            req.command,
            time.time(),
            process,
            encoding=req.encoding,
            limit=req.output_limit,
        )
        sb.processes[bp.id] = bp
        forget_finished(sb)
        self.core.spawn(self.collect(sb, bp, req, watch), name=f"bg-{sb.id}-{bp.id}")
        self.core.journal.record(sb.id, "process_started", {"process_id": bp.id, "command": str(req.command)[:1000]})
        return self._process_info(bp)

    async def collect(
        self, sb: Sandbox, bp: BackgroundProcess, req: ExecRequest, watch: CommandWatch | None = None
    ) -> None:
        try:
            async for ev in bp.process.events():
                if isinstance(ev, OutputChunk):
                    bp.output(ev.stream, ev.data)
                elif isinstance(ev, ExitInfo):
                    result = _exec_result(bytes(bp.stdout), bytes(bp.stderr), ev, bp.encoding)
                    bp.stdout, bp.stderr = bytearray(), bytearray()  # the result holds the output now
                    if watch is not None:
                        result = watch.judged(result, ev.cpu)
                    bp.result = await self.after_exec(sb, req, result, ev.stdout_bytes, ev.stderr_bytes)
        except AgentError:
            bp.lost = bp.lost or "its sandbox's agent went away"
        finally:
            if watch is not None:
                watch.stop()
            bp.ended()
            forget_finished(sb)

    def _process_info(self, bp: BackgroundProcess) -> ProcessInfo:
        return ProcessInfo(
            id=bp.id,
            command=bp.command,
            running=bp.result is None and not bp.done.is_set(),
            started_at=bp.started_at,
            result=bp.result,
        )

    def _bg(self, sandbox_id: str, process_id: str) -> tuple[Sandbox, BackgroundProcess]:
        sb = self.core.sandbox(sandbox_id)
        bp = sb.processes.get(process_id)
        if bp is None:
            raise NotFoundError(f"process {shown(process_id)} not found in sandbox {sandbox_id}")
        return sb, bp

    def _check_finished(self, sb: Sandbox, bp: BackgroundProcess) -> None:
        """A process that will never report an exit is an error, not a result of None."""
        if bp.done.is_set() and bp.result is None:
            why = bp.lost or f"sandbox {sb.id} is {sb.state}"
            raise WrongStateError(f"process {bp.id} ended without an exit status: {why}")

    async def list_processes(self, sandbox_id: str) -> builtins.list[ProcessInfo]:
        return [self._process_info(bp) for bp in self.core.sandbox(sandbox_id).processes.values()]

    async def process_output(self, sandbox_id: str, process_id: str) -> EventStream[ExecEvent]:
        sb, bp = self._bg(sandbox_id, process_id)
        return follow(sb, bp)

    async def wait_process(self, sandbox_id: str, process_id: str, timeout: float | None) -> ProcessInfo:
        sb, bp = self._bg(sandbox_id, process_id)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await bp.done.wait()
        self._check_finished(sb, bp)
        return self._process_info(bp)

    async def kill_process(self, sandbox_id: str, process_id: str, signo: int = signal.SIGKILL) -> ProcessInfo:
        """Signal the process's tree; for a signal that ends processes, wait briefly for its exit so
        the answer says what happened, not what was before."""
        sb, bp = self._bg(sandbox_id, process_id)
        if bp.result is None and not bp.done.is_set():
            if sb.live is None or sb.live.channel.closed or sb.state not in HOLDING_STATES:
                raise WrongStateError(f"sandbox {sb.id} is {sb.state}: process {bp.id} is gone with it")
            if sb.state == PAUSED:
                await self.pauser.ready(sandbox_id)
            try:
                async with asyncio.timeout(AGENT_START_TIMEOUT):
                    await bp.process.signal(signo, SCOPE_TREE)
            except TimeoutError:
                raise self.core.unresponsive(sb, "it stopped taking signals") from None
            if signo in FATAL_SIGNALS:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(KILL_WAIT):
                        await bp.done.wait()
        self._check_finished(sb, bp)
        return self._process_info(bp)

    async def write_process_stdin(self, sandbox_id: str, process_id: str, data: bytes, close: bool) -> None:
        sb, bp = self._bg(sandbox_id, process_id)
        if bp.done.is_set() or sb.live is None or sb.live.channel.closed:
            raise WrongStateError(f"process {bp.id} has ended")
        await self.pauser.ready(sandbox_id)
        self.core.touch(sb)
        try:
            async with asyncio.timeout(AGENT_START_TIMEOUT):
                if data:
                    await bp.process.write_stdin(data)
                if close:
                    await bp.process.close_stdin()
        except TimeoutError:
            raise self.core.unresponsive(sb, "it stopped reading a process's standard input") from None
        except ChannelClosedError as exc:
            raise UnavailableError(f"sandbox {sb.id} stopped") from exc


class Terminal:
    """A command on a pseudo-terminal, as the API relays it: output bytes, then its result; keystrokes
    and window sizes in. `close()` (idempotent) kills what still runs and releases the sandbox."""

    def __init__(
        self, execs: Execs, sb: Sandbox, live: LiveSandbox, process: ExecProcess, req: ExecRequest, deadline: float
    ) -> None:
        self.pid = process.pid
        self._execs, self._sb, self._live, self._process = execs, sb, live, process
        self._req, self._deadline = req, deadline
        self._finished = self._closed = False

    async def output(self) -> AsyncGenerator[bytes | ExecResult, None]:
        """Output as it comes, then the ExecResult (no output kept in it: `stdout_bytes` counts)."""
        core, sb, live = self._execs.core, self._sb, self._live
        events = self._process.events()
        try:
            while True:
                try:
                    ev = await core.await_agent(sb, live, anext(events), self._deadline)
                except StopAsyncIteration:
                    return
                if isinstance(ev, OutputChunk):
                    yield ev.data
                elif isinstance(ev, ExitInfo):
                    result = await self._execs.after_exec(
                        sb, self._req, _exec_result(b"", b"", ev), ev.stdout_bytes, ev.stderr_bytes
                    )
                    self._finished = True
                    yield result
                    return
        except (ChannelClosedError, ProtocolError) as exc:
            raise UnavailableError(f"sandbox {sb.id} stopped while its terminal was open") from exc

    async def write(self, data: bytes) -> None:
        """Keystrokes (^C is the terminal's interrupt: the foreground job gets SIGINT)."""
        self._execs.core.touch(self._sb)
        try:
            async with asyncio.timeout(AGENT_START_TIMEOUT):
                await self._process.write_stdin(data)
        except TimeoutError:
            raise self._execs.core.unresponsive(self._sb, "it stopped reading its terminal's input") from None
        except ChannelClosedError as exc:
            raise UnavailableError(f"sandbox {self._sb.id} stopped while its terminal was open") from exc

    async def resize(self, rows: int, cols: int) -> None:
        with contextlib.suppress(ChannelClosedError):
            await self._process.resize(rows, cols)

    async def hold(self, stop: bool) -> None:
        """Stop reading its output while the client is behind (what it writes then blocks), or read on."""
        with contextlib.suppress(ChannelClosedError):
            await self._process.hold(stop)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        core = self._execs.core
        self._sb.terminals -= 1
        core.idle_done(self._sb)
        core.metrics.execs.inc()
        if not self._finished and not self._live.channel.closed:
            self._live.channel.kill_nowait(self._process.id)
        core.journal.record(self._sb.id, "terminal_closed", {"pid": self.pid, "exited": self._finished})
