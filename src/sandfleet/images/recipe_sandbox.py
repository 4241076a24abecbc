"""Running a build step's commands in a build sandbox of the daemon: its labels, resources, output and cleanup."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from sandfleet.errors import NotFoundError, SandboxError
from sandfleet.models import ExecResult, Resources

from .models import (
    ImageNotFoundError,
    LayerRef,
)
from .recipe import MAX_BUILD_LAYERS, RecipeError

if TYPE_CHECKING:
    from sandfleet.client.aio import AsyncClient, AsyncSandbox

    from .recipe_context import _Ctx

log = logging.getLogger(__name__)

# Labels of build sandboxes: the recipe's ref, this build's id and the step number, so a
# caller (or a test) can find them, and cleanup can stop one whose create reply was lost.
BUILD_LABEL = "sandfleet.build"
BUILD_ID_LABEL = "sandfleet.build-id"
BUILD_STEP_LABEL = "sandfleet.build-step"
# Build sandboxes get the host's cores and room for compilers and wheels; the CPU *request*
# stays the default (0.1), so a build does not block admission of ordinary sandboxes.
BUILD_RESOURCES = Resources(cpu=float(min(os.cpu_count() or 1, 256)), memory="4GiB", disk="16GiB")
# Short: a build sandbox is only idle if this process died between requests; exec and pack
# requests in flight count as activity, so long commands are not cut off by it.
BUILD_IDLE_TTL = 120.0
OUTPUT_TAIL_LINES = 20
OUTPUT_TAIL_CHARS = 2000


def _tail(result_stdout: str, result_stderr: str) -> str:
    text = result_stderr if result_stderr.strip() else result_stdout
    tail = "\n".join(text.rstrip().splitlines()[-OUTPUT_TAIL_LINES:])
    return tail[-OUTPUT_TAIL_CHARS:]


async def _in_build_sandbox(
    ctx: _Ctx,
    i: int,
    kind: str,
    work: Callable[[AsyncSandbox], Awaitable[None]],
    *,
    exclude: list[str],
    resources: Resources | None,
    lifetime: float,
    description: str,
) -> LayerRef:
    """Run ``work`` in a sandbox on the stack so far and pack its writable layer into a new layer.

    The sandbox is stopped and the temporary pack manifest deleted whatever happens (error,
    cancellation); a sandbox whose create reply was lost is found by its build labels.
    """
    # The stack names no layer twice (_Ctx.push): the daemon takes it as it is, no dedupe rule
    # to agree on, and the packed image must sit on exactly it.
    below = ctx.below()
    if len(below) > MAX_BUILD_LAYERS:
        raise RecipeError(
            f"the stack below has {len(below)} layers; a build sandbox takes at most {MAX_BUILD_LAYERS}: "
            "merge steps (one run step with `&&`, one apt/pip step with several packages)"
        )
    client = ctx.get_client()
    labels = {BUILD_LABEL: ctx.recipe.ref, BUILD_ID_LABEL: ctx.build_id, BUILD_STEP_LABEL: str(i)}
    tmp_ref = f"sandfleet-build/{ctx.build_id}:step{i}"
    sb: AsyncSandbox | None = None
    pack_tried = False
    try:
        ctx.report(i, kind, "starting build sandbox", 0.1)
        sb = await client.create(
            layers=below,
            labels=labels,
            idle_ttl=BUILD_IDLE_TTL,
            max_lifetime=lifetime,
            resources=resources or BUILD_RESOURCES,
        )
        await work(sb)
        ctx.report(i, kind, "packing", 0.8)
        pack_tried = True
        info = await sb.pack(tmp_ref, exclude=exclude)
        if info.layers[:-1] != below:
            raise RecipeError(f"packed image has layers {info.layers[:-1]}, not the stack {below}")
        # The daemon shares this store: its manifest carries the new layer's size.
        try:
            packed = await asyncio.to_thread(ctx.store.resolve, tmp_ref)
        except ImageNotFoundError:
            raise RecipeError(
                f"the daemon packed {tmp_ref}, but it is not in {ctx.store.root}: the daemon must use this layer store"
            ) from None
        top = packed.layers[-1]
        return LayerRef(digest=top.digest, size=top.size, kind="layer", description=description)
    finally:
        await asyncio.shield(_cleanup_sandbox(client, sb, labels, tmp_ref if pack_tried else None))


async def _cleanup_sandbox(
    client: AsyncClient, sb: AsyncSandbox | None, labels: dict[str, str], tmp_ref: str | None
) -> None:
    # Errors here are logged, not raised: they must not mask the step's own outcome, and the
    # short idle_ttl stops a sandbox we failed to stop.
    try:
        if sb is not None:
            await sb.stop(reason="build step done")
        else:
            await client.stop_many(labels, reason="build step aborted")
    except SandboxError as exc:
        log.warning("stopping build sandbox (%s) failed: %s", labels, exc)
    if tmp_ref is not None:
        try:
            await client.delete_image(tmp_ref)
        except SandboxError as exc:
            if exc.code != "not_found":
                log.warning("deleting temporary image %s failed: %s", tmp_ref, exc)


def _check_exec(what: str, result: ExecResult) -> None:
    if result.timed_out:
        raise RecipeError(f"{what} timed out after {result.duration:.0f}s: {_tail(result.stdout, result.stderr)}")
    if result.signal is not None:
        raise RecipeError(f"{what} was killed by signal {result.signal}: {_tail(result.stdout, result.stderr)}")
    if result.exit_code != 0:
        raise RecipeError(f"{what} exited {result.exit_code}: {_tail(result.stdout, result.stderr)}")


async def _is_dir(sb: AsyncSandbox, path: str) -> bool:
    """Whether `path` is a directory in the sandbox (following symlinks); True when unsure, so that
    the exec reports what is wrong with it."""
    try:
        return (await sb.files.stat(path, follow_symlinks=True)).type == "dir"
    except NotFoundError:
        return False
    except SandboxError as exc:
        log.debug("stat %s in the build sandbox: %s", path, exc)
        return True


class _Lines:
    """Splits a stream's chunks into lines; keeps the last `keep` characters for error messages."""

    def __init__(self, keep: int = 64 * 1024) -> None:
        self.partial = ""
        self.tail = ""
        self.keep = keep

    def feed(self, data: str) -> list[str]:
        self.tail = (self.tail + data)[-self.keep :]
        *lines, self.partial = (self.partial + data).split("\n")
        return lines

    def flush(self) -> list[str]:
        rest, self.partial = self.partial, ""
        return [rest] if rest else []


async def _exec_streaming(
    ctx: _Ctx, i: int, sb: AsyncSandbox, command: str, *, env: dict[str, str], cwd: str, timeout: float
) -> ExecResult:
    """Run a step's command; with an output callback, streamed to it line by line."""
    if ctx.on_output is None:
        return await sb.exec(command, env=env, cwd=cwd, timeout=timeout, output_limit=1024**2)
    streams = {"stdout": _Lines(), "stderr": _Lines()}
    result: ExecResult | None = None
    async for ev in sb.exec_stream(command, env=env, cwd=cwd, timeout=timeout, output_limit=1024**2):
        if ev.type in streams:
            for line in streams[ev.type].feed(ev.data):
                ctx.output(i, ev.type, line)
        elif ev.type == "exit":
            result = ev.result
    for name, lines in streams.items():
        for line in lines.flush():
            ctx.output(i, name, line)
    if result is None:
        raise RecipeError("the command's output stream ended without its exit status")
    # What streamed is the output; the final event need not repeat it.
    return result.model_copy(update={"stdout": streams["stdout"].tail, "stderr": streams["stderr"].tail})


__all__ = ["BUILD_ID_LABEL", "BUILD_LABEL", "BUILD_STEP_LABEL"]
