"""A `sandfleet serve` child process, started and waited on until it serves, then stopped.

One handle for everything that runs a daemon of its own: `sandfleet demo` (the embedded daemon), the
benchmark and the test fixtures. Readiness is the daemon's `--ready-file`, written once it listens.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path


class DaemonStartError(RuntimeError):
    """The daemon exited, or did not become ready in time; the message carries its log's tail."""


class DaemonProcess:
    def __init__(
        self, args: Sequence[str], *, workdir: Path, log: Path | None = None, env: Mapping[str, str] | None = None
    ) -> None:
        """`args` follow `sandfleet serve`; `log` receives its output (None: stdout dropped, stderr ours);
        `env`: the daemon's environment (default: ours), e.g. a PYTHONPATH naming another source tree."""
        self.args = list(args)
        self.env = dict(env) if env is not None else None
        self.ready_file = workdir / "ready"
        self.log_path = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        self.ready_file.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "sandfleet", "serve", *self.args, "--ready-file", str(self.ready_file)]
        if self.log_path is None:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=self.env)
        else:
            with open(self.log_path, "ab") as log:  # the child keeps its own copy
                self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self.env)
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            if self.proc.poll() is not None:
                raise DaemonStartError(f"daemon exited ({self.proc.returncode}): {self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise DaemonStartError(f"daemon did not become ready within {timeout:.0f}s")
            time.sleep(0.02)

    @property
    def pid(self) -> int:
        assert self.proc is not None, "daemon not started"
        return self.proc.pid

    @property
    def started(self) -> bool:
        return self.proc is not None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for it to exit (it may have been dying)."""
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)

    def log(self) -> str:
        if self.log_path is None:
            return ""
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")
        return ""

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (the daemon stops its pools and closes cleanly), SIGKILL after `timeout`."""
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
