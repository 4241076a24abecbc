"""sandfleet.testing's fake tier served on a unix socket, as a daemon serves its node: the conformance
suite's clients (the sync SDK, raw HTTP) reach it the same way. The node (InProcessNode: the routes,
the service and its state store on the fake backend) and its uvicorn run on an event loop in a thread
of their own; no root, no sandboxes."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from sandfleet import Client
from sandfleet.testing import InProcessNode


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # not the main thread: signals stay pytest's
        yield


class FakeTierNode:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.socket = root / "sandfleet.sock"
        self.node: InProcessNode | None = None
        self._server: _Server | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fake-tier", daemon=True)

    def start(self, timeout: float = 30.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            self.stop()
            raise RuntimeError(f"the fake tier did not start: {self._error!r}")

    def stop(self) -> None:
        """Stop serving; the node stops its running sandboxes as it closes."""
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(60)
        shutil.rmtree(self.root, ignore_errors=True)
        if self._error is not None:
            raise self._error

    def client(self, **kw: object) -> Client:
        return Client(self.socket, **kw)  # type: ignore[arg-type]

    def residue(self) -> set[str]:
        """The sandbox directories the fake backend still holds."""
        assert self.node is not None
        return self.node.backend.residue()

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # noqa: BLE001 (handed to the test's thread)
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        # stopped sandboxes stay listable for a minute, as the real tiers' daemons keep them
        async with InProcessNode(self.root / "node", stopped_retention=60) as node:
            self.node = node
            config = uvicorn.Config(node.app, log_level="warning", lifespan="off", ws="wsproto")
            self._server = _Server(config)
            # listening before uvicorn starts: a client's connect waits in the backlog until it serves
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.bind(str(self.socket))
                sock.listen(128)
                self._ready.set()
                await self._server.serve(sockets=[sock])
