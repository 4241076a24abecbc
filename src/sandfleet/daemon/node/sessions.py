"""Sessions: a long-lived shell per session whose commands the agent frames (a nonce, a sequence
number, an exit reported on a socket only the shell can write), run whole or streamed; a stop hook
marks them dead when their sandbox stops.

The shell is the image's bash, else its /bin/sh. A shell that cannot name a descriptor above 9
(dash) gets its status socket and command stdin at 9 and 8 (the agent's low fds); every script
hides both from the command it runs. A terminal session (`pty`) runs its shell with job control
(`set -m`: each command's processes are the terminal's foreground group, so a ^C reaches them and
not the shell) and an INT trap (a ^C that lands between two commands does not end the shell).
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import codecs
import contextlib
import posixpath
import secrets
import shlex
import signal
import time
from collections.abc import AsyncGenerator

from sandfleet.backends.base import LiveSandbox
from sandfleet.daemon.node.core import AGENT_START_TIMEOUT, DEADLINE_GRACE, EventStream, NodeCore, wire_text
from sandfleet.daemon.node.execs import Execs
from sandfleet.daemon.node.lifecycle import CommandRun, Sandbox, Session
from sandfleet.daemon.node.pausing import Pauser
from sandfleet.daemon.node.sandbox_files import Files
from sandfleet.errors import (
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    SandboxError,
    SandboxTimeoutError,
    UnavailableError,
    UnsupportedError,
    WrongStateError,
)
from sandfleet.models import (
    MAX_COMMAND,
    ExecEvent,
    ExecRequest,
    ExecResult,
    SessionInfo,
    SessionRunRequest,
    TerminalSize,
    shown,
)
from sandfleet.runtime.agent_errors import AgentError, ChannelClosedError, ExecStartError
from sandfleet.runtime.agent_wire import (
    AGENT_VERSION,
    NONCE_LEN,
    SCOPE_DESCENDANTS,
    SCOPE_TREE,
    SESSION_FDS,
    SESSION_LOW_FDS,
    CommandExit,
    OutputChunk,
)

MAX_SESSIONS = 64  # open sessions per sandbox

SESSION_LOST_GRACE = 5.0  # the agent's wait for a shell to report after a timeout (agent.c LOST_GRACE_US)

# Whether the shell can name fd 10 (dash cannot: a syntax error, which ends it before the echo).
_HIGH_FD_PROBE = 'eval ": 2>&10" 2>/dev/null; echo ok'
# A terminal session's shell, before its first command (see the module docstring).
_PTY_PRELUDE = b"set -m; trap : INT\n"


class Sessions:
    def __init__(self, core: NodeCore, pauser: Pauser, files: Files, execs: Execs) -> None:
        self.core = core
        self.pauser = pauser
        self.files = files
        self.execs = execs
        core.table.on_stopped(self._dead)

    @staticmethod
    def _dead(sb: Sandbox) -> None:
        """Stop hook: its sessions' shells are gone."""
        for session in sb.sessions.values():
            session.dead = True

    async def create_session(
        self,
        sandbox_id: str,
        env: dict[str, str],
        cwd: str | None,
        user: str | None,
        pty: TerminalSize | None = None,
    ) -> SessionInfo:
        sb, live = await self.pauser.ready(sandbox_id)
        self.core.touch(sb)
        if len([s for s in sb.sessions.values() if not s.dead]) >= MAX_SESSIONS:
            raise ResourceExhaustedError(f"sandbox {sb.id} has {MAX_SESSIONS} sessions open: close one first")
        shell, shielded = await self._session_shell(sb, live)
        low_fds = shell != "/bin/bash" and not await self._names_high_fds(sb, live, shell)
        if (low_fds or pty is not None) and live.channel.agent_version not in (None, AGENT_VERSION):
            raise UnsupportedError(
                f"sandbox {sb.id} runs {live.channel.agent_version}, from before the daemon was upgraded; "
                f"{'terminal sessions' if pty is not None else f'sessions of its shell ({shell})'} need {AGENT_VERSION}"
            )
        req = ExecRequest(command=[shell], env=env, cwd=cwd, user=user, timeout=None, output_limit=0, pty=pty)
        try:
            # Output is capped per command by the agent (SRUN), dropped and counted between commands.
            process = await self.execs.start(
                sb,
                live,
                req,
                setsid=True,
                keep_stdin=True,
                uncapped=True,
                session=True,
                nondump=shielded,
                low_fds=low_fds,
            )
        except ExecStartError as exc:
            raise InvalidArgumentError(f"cannot start a shell in the sandbox: {exc.message}") from exc
        fds = SESSION_LOW_FDS if low_fds else SESSION_FDS
        session = Session("s-" + secrets.token_hex(6), shell, time.time(), process, pty=pty is not None, fds=fds)
        if pty is not None:
            try:
                async with asyncio.timeout(AGENT_START_TIMEOUT):
                    await process.write_stdin(_PTY_PRELUDE)
            except (TimeoutError, ChannelClosedError):
                live.channel.kill_nowait(process.id, SCOPE_TREE)
                raise UnavailableError(f"sandbox {sb.id} stopped taking a session's shell") from None
        self.add(sb, session)
        self.core.journal.record(
            sb.id, "session_created", {"session_id": session.id, "shell": shell, **({"pty": True} if pty else {})}
        )
        return self._session_info(session)

    async def _session_shell(self, sb: Sandbox, live: LiveSandbox) -> tuple[str, bool]:
        """The shell for a session, and whether it may start non-dumpable: bash and dash give up the
        differing effective gid the agent starts them with (busybox ash would keep it). Looked up the
        way the sandbox's tier reaches its files (a VM's through its agent)."""
        with contextlib.suppress(SandboxError):
            st = await self.files.stat(sb, live, "/bin/bash", follow_symlinks=True)
            if st.type == "file":
                return "/bin/bash", True
        target = ""
        with contextlib.suppress(SandboxError):
            target = (await self.files.stat(sb, live, "/bin/sh")).link_target or ""
        return "/bin/sh", posixpath.basename(target) in ("dash", "bash")

    async def _names_high_fds(self, sb: Sandbox, live: LiveSandbox, shell: str) -> bool:
        """Whether `shell` can redirect descriptors above 9 (POSIX only promises 0-9: dash cannot)."""
        try:
            async with asyncio.timeout(AGENT_START_TIMEOUT):
                proc = await live.channel.start([shell, "-c", _HIGH_FD_PROBE], out_cap=64, timeout=AGENT_START_TIMEOUT)
                out, _err, _ex = await proc.wait()
        except TimeoutError:
            raise self.core.unresponsive(sb, "it did not run a shell's probe") from None
        except ChannelClosedError as exc:
            raise UnavailableError(f"sandbox {sb.id} stopped") from exc
        except ExecStartError as exc:
            raise InvalidArgumentError(f"cannot start a shell in the sandbox: {exc.message}") from exc
        return out.strip() == b"ok"

    def add(self, sb: Sandbox, session: Session) -> None:
        sb.sessions[session.id] = session
        self.core.spawn(self.reader(sb, session), name=f"session-{sb.id}-{session.id}")

    @staticmethod
    def _session_info(s: Session) -> SessionInfo:
        return SessionInfo(id=s.id, shell=s.shell, created_at=s.created_at, busy=s.current is not None, pty=s.pty)

    async def reader(self, sb: Sandbox, session: Session) -> None:
        try:
            async for ev in session.process.events():
                cur = session.current
                if isinstance(ev, OutputChunk):
                    if cur is None:
                        continue
                    buf = cur.out if ev.stream == "stdout" else cur.err
                    buf.extend(ev.data[: max(0, cur.limit - len(buf))])  # the agent caps it too
                    if cur.stream is not None:
                        cur.stream.put_nowait(ev)
                elif isinstance(ev, CommandExit):
                    if cur is not None and ev.seq != cur.seq:
                        continue  # the end of a command given up earlier
                    if ev.dropped_before:
                        self.core.journal.record(sb.id, "session_output_dropped", {"session_id": session.id,
                                                                       "bytes": ev.dropped_before})  # fmt: skip
                    if cur is not None and cur.ended is not None and not cur.ended.done():
                        cur.ended.set_result(ev)
                    if cur is not None and cur.stream is not None:
                        cur.stream.put_nowait(ev)
        except AgentError:
            pass
        finally:
            session.dead = True
            cur = session.current
            if cur is not None:
                if cur.ended is not None and not cur.ended.done():
                    cur.ended.set_exception(WrongStateError(f"session {session.id} ended while running the command"))
                if cur.stream is not None:
                    cur.stream.put_nowait(None)

    def _session(self, sandbox_id: str, session_id: str) -> tuple[Sandbox, Session]:
        sb = self.core.sandbox(sandbox_id)
        session = sb.sessions.get(session_id)
        if session is None:
            raise NotFoundError(f"session {shown(session_id)} not found in sandbox {sandbox_id}")
        return sb, session

    async def list_sessions(self, sandbox_id: str) -> builtins.list[SessionInfo]:
        return [self._session_info(s) for s in self.core.sandbox(sandbox_id).sessions.values() if not s.dead]

    async def get_session(self, sandbox_id: str, session_id: str) -> SessionInfo:
        _sb, session = self._session(sandbox_id, session_id)
        if session.dead:
            raise WrongStateError(f"session {session_id} has exited")
        return self._session_info(session)

    @staticmethod
    def _script(session: Session, req: SessionRunRequest, nonce: str) -> bytes:
        """What the shell runs for one command: `command eval` keeps a syntax error from ending the
        shell; the status goes to the agent through the status fd, which only the shell itself may
        write (the agent checks the sender's pid), with a nonce no other process can read. The
        command sees neither of the shell's two fds (the shell puts them back after it)."""
        status, cmdin = session.fds
        typed = session.pty or req.stdin is not None or req.stdin_b64 is not None or req.keep_stdin_open
        stdin = f"<&{cmdin}" if typed else "</dev/null"
        merge = " 2>&1" if req.merge_stderr else ""
        return (
            f"command eval {shlex.quote(req.command)} {stdin}{merge} {cmdin}<&- {status}>&-\n"
            f"command printf '%s %d\\n' '{nonce}' \"$?\" >&{status}\n"
        ).encode()

    async def _session_begin(
        self, sandbox_id: str, session_id: str, req: SessionRunRequest, *, stream: bool
    ) -> tuple[Sandbox, LiveSandbox, Session, CommandRun, float]:
        """Take the session's lock and start one command in it (the caller releases the lock)."""
        sb, session = self._session(sandbox_id, session_id)
        _sb, live = await self.pauser.ready(sandbox_id)
        wait = None if req.timeout is None else req.timeout + DEADLINE_GRACE
        try:
            async with asyncio.timeout(wait):  # behind another command of the session
                await session.lock.acquire()
        except TimeoutError:
            raise SandboxTimeoutError(
                f"session {session_id} stayed busy with another command for {wait:.0f}s"
            ) from None
        try:
            if session.dead:
                raise WrongStateError(f"session {session_id} has exited")
            deadline = self.core.busy(sb, None if req.timeout is None else req.timeout + SESSION_LOST_GRACE)
            loop = asyncio.get_running_loop()
            data = req.stdin_bytes()
            session.next_seq += 1
            run = CommandRun(req.output_limit, req.encoding, ended=loop.create_future(), seq=session.next_seq)
            run.stdin_open = session.pty or data is not None or req.keep_stdin_open  # a terminal is always open
            if stream:
                run.stream = asyncio.Queue()
            session.current = run
            nonce = secrets.token_hex(NONCE_LEN // 2)
            try:
                async with asyncio.timeout(AGENT_START_TIMEOUT):  # even an agent that stopped reading
                    await session.process.run_command(
                        self._script(session, req, nonce),
                        nonce.encode(),
                        timeout=req.timeout,
                        out_cap=req.output_limit,
                        stdin=run.stdin_open,
                        seq=run.seq,
                    )
                    if data:
                        await session.process.write_command_stdin(data)
                    if data is not None and not req.keep_stdin_open:
                        await session.process.close_command_stdin()
                        run.stdin_open = False
            except BaseException as exc:
                session.current = None
                self.core.idle_done(sb)
                if isinstance(exc, ChannelClosedError):
                    raise UnavailableError(f"sandbox {sb.id} stopped") from exc
                if isinstance(exc, TimeoutError):
                    session.dead = True
                    live.channel.kill_nowait(session.process.id, SCOPE_TREE)
                    raise self.core.unresponsive(sb, "it stopped taking a session's command") from None
                # Cut off mid-script (the caller went away): the shell's input is in an unknown
                # state, so the session ends rather than run half a command later.
                session.dead = True
                live.channel.kill_nowait(session.process.id, SCOPE_TREE)
                raise
            return sb, live, session, run, deadline
        except BaseException:
            session.lock.release()
            raise

    def _session_end(self, sb: Sandbox, session: Session) -> None:
        session.current = None
        self.core.idle_done(sb)
        session.lock.release()

    async def _session_result(
        self, sb: Sandbox, session: Session, req: SessionRunRequest, run: CommandRun, ev: CommandExit
    ) -> ExecResult:
        if ev.lost:
            session.dead = True
            with contextlib.suppress(ChannelClosedError):
                await session.process.signal(signal.SIGKILL, SCOPE_TREE)
            if ev.timed_out:
                raise SandboxTimeoutError(
                    f"command timed out after {req.timeout}s and the session's shell did not recover; "
                    "the session was closed"
                )
            raise WrongStateError(f"session {session.id} exited while running the command")
        result = ExecResult(
            exit_code=ev.status,
            stdout=wire_text(bytes(run.out), req.encoding),
            stderr=wire_text(bytes(run.err), req.encoding),
            duration=ev.duration,
            timed_out=ev.timed_out,
            stdout_truncated=ev.stdout_truncated,
            stderr_truncated=ev.stderr_truncated,
            encoding=req.encoding,
        )
        as_exec = ExecRequest(
            command=req.command[: MAX_COMMAND - 1], timeout=req.timeout, output_limit=req.output_limit
        )
        return await self.execs.after_exec(sb, as_exec, result, ev.stdout_bytes, ev.stderr_bytes)

    async def session_run(self, sandbox_id: str, session_id: str, req: SessionRunRequest) -> ExecResult:
        sb, live, session, run, deadline = await self._session_begin(sandbox_id, session_id, req, stream=False)
        try:
            assert run.ended is not None
            ev = await self.core.await_agent(sb, live, asyncio.shield(run.ended), deadline)
            return await self._session_result(sb, session, req, run, ev)
        except BaseException:
            if run.ended is not None and not run.ended.done() and not live.channel.closed:
                # abandoned (client gone, agent stuck): kill what the shell runs, keep the shell
                live.channel.kill_nowait(session.process.id, SCOPE_DESCENDANTS)
            raise
        finally:
            self._session_end(sb, session)

    async def session_run_stream(
        self, sandbox_id: str, session_id: str, req: SessionRunRequest
    ) -> EventStream[ExecEvent]:
        sb, live, session, run, deadline = await self._session_begin(sandbox_id, session_id, req, stream=True)
        finished = False

        async def release() -> None:
            if not finished and not live.channel.closed and not session.dead:
                live.channel.kill_nowait(session.process.id, SCOPE_DESCENDANTS)
                with contextlib.suppress(TimeoutError, WrongStateError):
                    async with asyncio.timeout(SESSION_LOST_GRACE):
                        assert run.ended is not None
                        await asyncio.shield(run.ended)  # the shell reports; the next command may start
            self._session_end(sb, session)

        async def stream() -> AsyncGenerator[ExecEvent, None]:
            nonlocal finished
            decoders = {s: codecs.getincrementaldecoder("utf-8")("replace") for s in ("stdout", "stderr")}
            assert run.stream is not None
            try:
                while True:
                    item = await self.core.await_agent(sb, live, run.stream.get(), deadline)
                    if item is None:
                        raise WrongStateError(f"session {session.id} ended while running the command")
                    if isinstance(item, OutputChunk):
                        if req.encoding == "base64":
                            yield ExecEvent(type=item.stream, data=base64.b64encode(item.data).decode())
                        elif text := decoders[item.stream].decode(item.data):
                            yield ExecEvent(type=item.stream, data=text)
                    else:
                        result = await self._session_result(sb, session, req, run, item)
                        finished = True
                        yield ExecEvent(type="exit", result=result)
                        return
            finally:
                await wrapped.release()

        wrapped = EventStream(stream(), release)
        return wrapped

    async def write_session_stdin(self, sandbox_id: str, session_id: str, data: bytes, close: bool) -> None:
        sb, session = self._session(sandbox_id, session_id)
        run = session.current
        if session.dead or run is None or not run.stdin_open:
            raise WrongStateError(
                f"session {session_id} has no command running with an open stdin "
                "(run it with stdin or keep_stdin_open=true)"
            )
        self.core.touch(sb)
        try:
            async with asyncio.timeout(AGENT_START_TIMEOUT):
                if data:
                    await session.process.write_command_stdin(data)
                if close:
                    run.stdin_open = False
                    await session.process.close_command_stdin()
        except TimeoutError:
            raise self.core.unresponsive(sb, "it stopped reading a session command's standard input") from None
        except ChannelClosedError as exc:
            raise UnavailableError(f"sandbox {sb.id} stopped") from exc

    async def close_session(self, sandbox_id: str, session_id: str) -> None:
        sb, session = self._session(sandbox_id, session_id)
        sb.sessions.pop(session_id, None)
        if not session.dead and sb.live is not None and not sb.live.channel.closed:
            await session.process.signal(signal.SIGKILL, SCOPE_TREE)
        self.core.journal.record(sb.id, "session_closed", {"session_id": session_id})
