"""The async SDK's coalescing of stateless calls (client/_batch.py), against fake senders."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from sandfleet.client._batch import CallBatcher
from sandfleet.errors import InvalidArgumentError, SandboxError, UnavailableError
from sandfleet.models import ExecResult

pytestmark = pytest.mark.unit


def _result(text: str) -> ExecResult:
    return ExecResult(exit_code=0, stdout=text, stderr="", duration=0.0)


def test_calls_made_together_go_as_one_batch_with_their_own_outcomes() -> None:
    batches: list[list[str]] = []

    async def one(body: dict[str, object]) -> ExecResult:
        batches.append([str(body["code"])])
        return _result(str(body["code"]))

    async def many(bodies: list[dict[str, object]]) -> AsyncGenerator[tuple[int, ExecResult | SandboxError], None]:
        batches.append([str(b["code"]) for b in bodies])
        for i in reversed(range(len(bodies))):  # outcomes in any order
            await asyncio.sleep(0)
            code = str(bodies[i]["code"])
            yield i, (InvalidArgumentError(code) if code == "bad" else _result(code))

    async def main() -> list[object]:
        b = CallBatcher(one, many)
        first = await b.submit({"code": "alone"})
        together = await asyncio.gather(*(b.submit({"code": c}) for c in ("x", "bad", "y")), return_exceptions=True)
        return [first, *together]

    alone, x, bad, y = asyncio.run(main())
    assert batches == [["alone"], ["x", "bad", "y"]]
    assert [getattr(r, "stdout", None) for r in (alone, x, y)] == ["alone", "x", "y"]
    assert isinstance(bad, InvalidArgumentError)


def test_a_batch_that_breaks_fails_each_of_its_calls() -> None:
    async def one(body: dict[str, object]) -> ExecResult:
        raise AssertionError("not used")

    async def many(bodies: list[dict[str, object]]) -> AsyncGenerator[tuple[int, ExecResult | SandboxError], None]:
        yield 0, _result("first")
        raise UnavailableError("connection lost")

    async def main() -> list[object]:
        b = CallBatcher(one, many)
        return await asyncio.gather(*(b.submit({"code": str(i)}) for i in range(3)), return_exceptions=True)

    first, *rest = asyncio.run(main())
    assert getattr(first, "stdout", None) == "first"
    assert all(isinstance(r, UnavailableError) for r in rest)


def test_at_most_max_in_flight_batches_then_the_rest_waits() -> None:
    gate = asyncio.Event
    seen: list[int] = []

    async def main() -> int:
        release = gate()

        async def one(body: dict[str, object]) -> ExecResult:
            seen.append(1)
            await release.wait()
            return _result("1")

        async def many(bodies: list[dict[str, object]]) -> AsyncGenerator[tuple[int, ExecResult | SandboxError], None]:
            seen.append(len(bodies))
            await release.wait()
            for i in range(len(bodies)):
                yield i, _result(str(i))

        b = CallBatcher(one, many, max_in_flight=1, linger=5.0)
        calls = [asyncio.ensure_future(b.submit({"code": "a"}))]
        await asyncio.sleep(0.01)  # the first is out alone; these wait for it, then go together
        calls += [asyncio.ensure_future(b.submit({"code": str(i)})) for i in range(5)]
        await asyncio.sleep(0.01)
        assert seen == [1]
        release.set()
        await asyncio.gather(*calls)
        return len(seen)

    assert asyncio.run(main()) == 2 and seen == [1, 5]


def test_a_call_waits_for_a_slot_no_longer_than_linger() -> None:
    """Every slot held by a long call: a short call made then still goes out after `linger`, with
    the calls made with it as one batch, and not behind the long ones."""
    seen: list[int] = []

    async def main() -> float:
        release = asyncio.Event()

        async def one(body: dict[str, object]) -> ExecResult:
            seen.append(1)
            if body["code"] == "long":
                await release.wait()
            return _result(str(body["code"]))

        async def many(bodies: list[dict[str, object]]) -> AsyncGenerator[tuple[int, ExecResult | SandboxError], None]:
            seen.append(len(bodies))
            for i in range(len(bodies)):
                yield i, _result(str(bodies[i]["code"]))

        b = CallBatcher(one, many, max_in_flight=2, linger=0.05)
        longs = []
        for _ in range(2):  # one batch each
            longs.append(asyncio.ensure_future(b.submit({"code": "long"})))
            await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        short = await asyncio.wait_for(asyncio.gather(*(b.submit({"code": c}) for c in "ab")), 2)
        waited = loop.time() - t0
        assert [r.stdout for r in short] == ["a", "b"]
        release.set()
        await asyncio.gather(*longs)
        return waited

    waited = asyncio.run(main())
    assert 0.04 <= waited < 1.0
    assert seen == [1, 1, 2]


def test_batches_sent_past_linger_stop_at_max_forced() -> None:
    """Calls that waited `linger` go out above `max_in_flight`, but never more than `max_forced`
    batches in all (each is a connection): the rest wait for one of them."""

    async def main() -> tuple[int, int]:
        release = asyncio.Event()
        out = [0, 0]  # now, most

        async def one(body: dict[str, object]) -> ExecResult:
            out[0] += 1
            out[1] = max(out[1], out[0])
            await release.wait()
            out[0] -= 1
            return _result("long")

        async def many(bodies: list[dict[str, object]]) -> AsyncGenerator[tuple[int, ExecResult | SandboxError], None]:
            assert release.is_set()  # the calls that waited, once a batch is back
            for i in range(len(bodies)):
                yield i, _result("long")

        b = CallBatcher(one, many, max_in_flight=1, linger=0.01, max_forced=3)
        calls = []
        for _ in range(6):
            calls.append(asyncio.ensure_future(b.submit({"code": "long"})))
            await asyncio.sleep(0.03)
        held = out[0]
        release.set()
        await asyncio.gather(*calls)
        return held, out[1]

    assert asyncio.run(main()) == (3, 3)


def test_calls_a_full_flush_leaves_behind_still_go_after_linger() -> None:
    """A turn's calls beyond what the free slots take (batches of `max_batch`) wait `linger` for a
    slot like any other, not for a long call to end."""

    async def main() -> list[str]:
        release = asyncio.Event()

        async def one(body: dict[str, object]) -> ExecResult:
            raise AssertionError("every batch here holds two calls or more")

        async def many(bodies: list[dict[str, object]]) -> AsyncGenerator[tuple[int, ExecResult | SandboxError], None]:
            if bodies[0]["code"] == "long":
                await release.wait()
            for i in range(len(bodies)):
                yield i, _result(str(bodies[i]["code"]))

        b = CallBatcher(one, many, max_in_flight=1, max_batch=2, linger=0.02)
        calls = [asyncio.ensure_future(b.submit({"code": c})) for c in ("long", "long", "a", "b")]
        done = await asyncio.wait_for(asyncio.gather(*calls[2:]), 2)
        release.set()
        await asyncio.gather(*calls[:2])
        return [r.stdout for r in done]

    assert asyncio.run(main()) == ["a", "b"]
