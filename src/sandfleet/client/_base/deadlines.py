"""How long calls wait: a call's own timeout, a command's, the silence a stream may keep, and the
backoff and deadline of retried calls (see the package's docstring)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Iterator

import httpx

from sandfleet.client._base.wire import Call
from sandfleet.errors import InvalidArgumentError, SandboxTimeoutError

DEFAULT_TIMEOUT = 60.0
# Extra HTTP time on top of a command's own timeout, so the daemon's answer wins: its timed_out=true,
# or its typed error once its own deadline (the command's timeout + 15 s) passes.
EXEC_MARGIN = 20.0
# Image builds, imports, pushes and pack: their own, longer default (seconds).
BUILD_TIMEOUT = 1800.0
# The daemon sends a heartbeat line this often while a stream has nothing else to say...
HEARTBEAT_INTERVAL = 5.0
# ...so a stream silent for the client's timeout, but never less than this, is a daemon gone quiet.
MIN_SILENCE = 2 * HEARTBEAT_INTERVAL + 2.0
# Retried calls: backoff from BACKOFF_FIRST doubling to BACKOFF_MAX (with jitter); another attempt is
# only made when at least MIN_ATTEMPT seconds of the call's deadline are left for it.
BACKOFF_FIRST = 0.05
BACKOFF_MAX = 1.0
MIN_ATTEMPT = 0.5


def check_timeout(timeout: float | None, default: float) -> float:
    """A call's own `timeout=` (None: the client's), refused unless positive."""
    seconds = default if timeout is None else timeout
    if not seconds > 0:
        raise InvalidArgumentError(f"timeout must be a positive number of seconds, not {seconds!r}")
    return float(seconds)


def exec_timeout(timeout: float | None, default: float) -> float | None:
    if timeout is None:
        return None
    return max(default, timeout + EXEC_MARGIN)


def one_response(command_timeout: float | None, client_timeout: float) -> bool:
    """Whether a command runs through the one-response endpoint (its timeout fits in the client's)
    rather than a stream whose heartbeats prove the daemon alive however long the command runs."""
    return command_timeout is not None and command_timeout <= client_timeout


def request_timeout(call: Call, client_timeout: float) -> float:
    """Seconds a one-response call waits for its answer."""
    return client_timeout if call.timeout is None or call.timeout == "default" else call.timeout


def silence_limit(client_timeout: float) -> float:
    """How long a stream may go without a line before the daemon counts as gone."""
    return max(client_timeout, MIN_SILENCE)


def stream_timeouts(client_timeout: float) -> httpx.Timeout:
    """httpx timeouts of a streamed call: each read may wait for the silence limit (heartbeats
    arrive well within it), the rest the client's timeout."""
    return httpx.Timeout(client_timeout, read=silence_limit(client_timeout))


def stream_deadline(call: Call, start: float) -> float | None:
    """The monotonic time a streamed call must be over by (None: no limit but the silence one)."""
    return None if call.timeout is None or call.timeout == "default" else start + call.timeout


def _silence_error(waited: float, deadline_passed: bool) -> SandboxTimeoutError:
    if deadline_passed:
        return SandboxTimeoutError("the daemon's stream outlasted the call's deadline")
    return SandboxTimeoutError(
        f"the daemon sent nothing for {waited:.1f} s (not even a heartbeat): it stopped answering"
    )


async def next_line(lines: AsyncIterator[str], silence: float, deadline: float | None) -> str | None:
    """The next line of a stream (None at its end), or SandboxTimeoutError once it has been silent
    for `silence` seconds or runs past `deadline` (the caller then closes the connection)."""
    wait = silence if deadline is None else min(silence, deadline - time.monotonic())
    if wait <= 0:
        raise _silence_error(0.0, True)
    try:
        async with asyncio.timeout(wait):
            return await anext(lines, None)
    except TimeoutError as exc:
        raise _silence_error(wait, wait < silence) from exc


def next_line_sync(lines: Iterator[str], silence: float, deadline: float | None) -> str | None:
    """The blocking counterpart of `next_line`: httpx's read timeout (the silence limit, see
    `stream_timeouts`) bounds each read on the socket; a line that comes too late still counts as
    silence, and the deadline is checked between lines."""
    start = time.monotonic()
    if deadline is not None and start >= deadline:
        raise _silence_error(0.0, True)
    line = next(lines, None)
    now = time.monotonic()
    if now - start > silence:
        raise _silence_error(now - start, False)
    if deadline is not None and now > deadline:
        raise _silence_error(now - start, True)
    return line


class Deadline:
    """The time a retried call may take in all, and the backoff between its attempts."""

    def __init__(self, seconds: float, *, retry_refusals_for: float | None = None) -> None:
        now = time.monotonic()
        self.end = now + seconds
        self.refusals_end = self.end if retry_refusals_for is None else min(self.end, now + retry_refusals_for)
        self._backoff = BACKOFF_FIRST
        self.delay = self._jittered()

    def _jittered(self) -> float:
        return self._backoff * random.uniform(0.5, 1.0)

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def attempt_timeout(self, per_request: float) -> float:
        """An attempt waits the client's timeout, or what is left of the deadline if less."""
        return max(0.001, min(per_request, self.remaining()))

    def _room(self, refused: bool) -> float:
        """Seconds left to wait before the last attempt that still gets MIN_ATTEMPT seconds."""
        return (self.refusals_end if refused else self.end) - time.monotonic() - MIN_ATTEMPT

    def allows(self, refused: bool) -> bool:
        """Whether another attempt fits (a refusal's retries may stop sooner: `retry_refusals_for`)."""
        return self._room(refused) > 0

    def backoff(self, refused: bool = False) -> float:
        """The delay to sleep before the next attempt (cut so that attempt still fits); the next one
        is longer."""
        delay = min(self.delay, max(0.0, self._room(refused)))
        self._backoff = min(self._backoff * 2, BACKOFF_MAX)
        self.delay = self._jittered()
        return delay
