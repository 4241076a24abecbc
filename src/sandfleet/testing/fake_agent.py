"""The agent's side of the wire protocol (runtime/agent.py) in Python, for the fake tier.

It serves one end of a SOCK_SEQPACKET socketpair inside the daemon's own event loop: commands run
as host processes of the caller (no isolation, no user switch), with a directory standing for the
sandbox's root as the base of their working directory. What the daemon sees is the real protocol:
HELLO, STARTED or ERROR, STDOUT/STDERR chunks under the output cap, EXIT with the wait status, flags
and byte counts, PONG, and a timeout that kills the command's process group. Session shells and
file watches are refused (ERROR / WEND): tests of those use a real tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
import struct
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, Literal

from sandfleet.runtime import agent_wire as wire

_READ = 32 * 1024


class FakeAgent:
    def __init__(self, sock: socket.socket, root: Path) -> None:
        sock.setblocking(False)
        self._sock = sock
        self.root = root
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._send_lock = asyncio.Lock()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs.values() if p.returncode is None]

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await self._send(wire.encode_hello())
            while True:
                data = await loop.sock_recv(self._sock, wire.MAX_DATAGRAM)
                if not data:
                    return
                mtype, msg_id, payload = wire.decode_message(data)
                self._dispatch(mtype, msg_id, payload)
        except (ConnectionError, OSError):
            return
        finally:
            self.kill_all(signal.SIGKILL)
            for task in list(self._tasks):
                task.cancel()
            self._sock.close()

    def kill_all(self, signo: int) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signo)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _dispatch(self, mtype: int, msg_id: int, payload: bytes) -> None:
        if mtype == wire.MSG_EXEC:
            self._spawn(self._exec(msg_id, wire.decode_exec(payload)), f"fake-exec-{msg_id}")
        elif mtype == wire.MSG_PING:
            self._spawn(self._send(wire.encode_pong(msg_id)), "fake-pong")
        elif mtype == wire.MSG_STDIN:
            self._spawn(self._stdin(msg_id, payload), f"fake-stdin-{msg_id}")
        elif mtype == wire.MSG_SIGNAL:
            signo, _scope = wire.decode_signal(payload)
            proc = self._procs.get(msg_id)
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signo)
        elif mtype == wire.MSG_WATCH:
            reason = b"file watches need a real tier"
            self._spawn(
                self._send(wire.encode_message(wire.MSG_WEND, msg_id, struct.pack("<i", errno.ENOSYS) + reason)),
                "fake-wend",
            )
        elif mtype in (wire.MSG_SRUN, wire.MSG_CMDIN):
            self._spawn(self._send(wire.encode_error(msg_id, errno.ENOSYS, "sessions need a real tier")), "fake-err")
        # REOPEN, FORGET, UNWATCH: nothing to do for processes that die with the daemon

    async def _send(self, data: bytes) -> None:
        async with self._send_lock:
            await asyncio.get_running_loop().sock_sendall(self._sock, data)

    async def _stdin(self, exec_id: int, data: bytes) -> None:
        proc = self._procs.get(exec_id)
        if proc is None or proc.stdin is None:
            return
        with contextlib.suppress(ConnectionError, OSError):
            if data:
                proc.stdin.write(data)
                await proc.stdin.drain()
            else:
                proc.stdin.close()

    async def _exec(self, exec_id: int, req: wire.ExecRequest) -> None:
        if req.flags & wire.EXEC_SESSION:
            await self._send(wire.encode_error(exec_id, errno.ENOSYS, "sessions need a real tier"))
            return
        if req.flags & wire.EXEC_PTY:
            await self._send(wire.encode_error(exec_id, errno.ENOSYS, "terminals need a real tier"))
            return
        cwd = self.root / req.cwd.lstrip("/")
        if not cwd.is_dir():
            await self._send(wire.encode_error(exec_id, errno.ENOENT, f"chdir to {req.cwd}: no such directory"))
            return
        merge = bool(req.flags & wire.EXEC_MERGE)
        t0 = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *req.argv,
                cwd=cwd,
                env=req.env,
                stdin=asyncio.subprocess.PIPE if req.flags & wire.EXEC_STDIN_PIPE else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT if merge else asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            await self._send(wire.encode_error(exec_id, exc.errno or errno.EIO, f"{req.argv[0]}: {exc.strerror}"))
            return
        self._procs[exec_id] = proc
        await self._send(wire.encode_started(exec_id, proc.pid))
        counts: dict[str, int] = {"stdout": 0, "stderr": 0}
        pumps = [self._pump(exec_id, proc.stdout, "stdout", req.out_cap, counts)]
        if proc.stderr is not None:
            pumps.append(self._pump(exec_id, proc.stderr, "stderr", req.out_cap, counts))
        flags = 0
        try:
            async with asyncio.timeout(req.timeout_ms / 1000 if req.timeout_ms else None):
                await asyncio.gather(*pumps, proc.wait())
        except TimeoutError:
            flags |= wire.EXIT_TIMED_OUT
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        finally:
            self._procs.pop(exec_id, None)
        if counts["stdout"] > req.out_cap:
            flags |= wire.EXIT_STDOUT_TRUNCATED
        if counts["stderr"] > req.out_cap:
            flags |= wire.EXIT_STDERR_TRUNCATED
        rc = proc.returncode or 0
        status = -rc if rc < 0 else rc << 8  # a wait status: the signal, or the code in the high byte
        duration_us = int((time.monotonic() - t0) * 1e6)
        out, err = min(counts["stdout"], 2**63), min(counts["stderr"], 2**63)
        await self._send(wire.encode_exit(exec_id, status, flags, out, err, duration_us))

    async def _pump(
        self,
        exec_id: int,
        stream: asyncio.StreamReader | None,
        name: Literal["stdout", "stderr"],
        cap: int,
        counts: dict[str, int],
    ) -> None:
        if stream is None:
            return
        while chunk := await stream.read(_READ):
            forward = chunk[: max(0, cap - counts[name])]
            counts[name] += len(chunk)
            if forward:
                await self._send(wire.encode_output(exec_id, name, forward))
