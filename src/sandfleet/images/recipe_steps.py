"""How each kind of recipe step (copy, git, apt, run, pip) builds its layer."""

from __future__ import annotations

import asyncio
import os
import platform
import re
import sys
from collections.abc import Awaitable, Callable
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import fsutil
from .builders import debian_mirror, mounted_layers, trim_debian_rootfs
from .models import (
    ImageError,
    LayerRef,
)
from .recipe import _PIP_GUARD, _WHEELS_ONLY, AptStep, CopyStep, GitStep, PipStep, RecipeError, RunStep, _is_url
from .recipe_context import _cache_key
from .recipe_sandbox import _check_exec, _exec_streaming, _in_build_sandbox, _is_dir
from .recipe_tree import _make_parents, _normalize_checkout_modes, _own_by_root, stage_copy
from .rootfs_probe import _manylinux_platforms, drop_whiteouts, glibc_version_in, python_version_in, read_debian_info

if TYPE_CHECKING:
    from sandfleet.client.aio import AsyncSandbox

    from .recipe import Step
    from .recipe_context import _Ctx

# Where the pip step puts its wheelhouse inside the build sandbox (excluded from the layer).
PIP_DIR = "/tmp/sandfleet-pip"


async def _mmdebstrap(target: Path, suite: str, *, variant: str = "minbase", include: list[str]) -> str:
    mirror = await asyncio.to_thread(debian_mirror, suite)
    argv = ["mmdebstrap", f"--variant={variant}", "--mode=root", "--quiet"]
    if include:
        argv.append("--include=" + ",".join(include))
    argv += [suite, str(target), mirror]
    await fsutil.run(*argv, what="mmdebstrap")
    return mirror


# --------------------------------------------------------------------------- copy


async def _step_copy(ctx: _Ctx, i: int, step: Step) -> tuple[str, LayerRef, bool]:
    assert isinstance(step, CopyStep)
    spec = step.spec
    staging = ctx.scratch(f"step{i}-copy")
    ctx.report(i, "copy", f"staging {spec.src} -> {spec.dest}", 0.1)
    # Copied first and keyed by what was copied, even when the key then hits: hashing the source
    # and copying it separately would store an edit made in between under the old content's key.
    n, digest = await asyncio.to_thread(stage_copy, ctx.recipe.base_dir, spec.src, staging, spec.dest, spec.exclude)
    # No digests of the stack below: a copy layer's content does not depend on it.
    key = _cache_key("copy", tree=digest, dest=spec.dest, exclude=spec.exclude)

    async def build() -> LayerRef:
        ctx.report(i, "copy", "mkfs.erofs", 0.7)
        return await ctx.store.add_layer_from_dir(staging, f"copy {spec.src} -> {spec.dest} ({n} entries)")

    layer, hit = await ctx.cached(key, build)
    await asyncio.to_thread(fsutil.rmtree, staging)
    return key, layer, hit


# --------------------------------------------------------------------------- git


_SHA_RE = re.compile(r"^[0-9a-f]{40}$|^[0-9a-f]{64}$")
_GIT_ENV = {"GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "/bin/true", "LC_ALL": "C"}


async def _git(*args: str) -> str:
    try:
        return await fsutil.run("git", *args, what=f"git {args[0]}", env={**os.environ, **_GIT_ENV})
    except ImageError as exc:
        raise RecipeError(str(exc)) from None


async def _ls_remote(url: str, rev: str) -> str | None:
    """The commit ``rev`` names on the remote if it is a branch, tag or HEAD; None otherwise
    (an abbreviated sha, say, which only a clone can resolve)."""
    out = await _git("ls-remote", "--", url)
    refs: dict[str, str] = {}
    for line in out.splitlines():
        sha, _, ref = line.partition("\t")
        refs[ref] = sha
    for cand in (rev, f"refs/tags/{rev}", f"refs/heads/{rev}"):
        # Annotated tags: the peeled entry names the commit, the plain one the tag object.
        for name in (cand + "^{}", cand):
            if name in refs:
                return refs[name]
    return None


async def _step_git(ctx: _Ctx, i: int, step: Step) -> tuple[str, LayerRef, bool]:
    assert isinstance(step, GitStep)
    spec = step.git
    url = spec.url if _is_url(spec.url) else str((ctx.recipe.base_dir / spec.url).resolve())
    ctx.report(i, "git", f"resolving {spec.rev}", 0.05)
    remote = spec.rev if _SHA_RE.match(spec.rev) else await _ls_remote(url, spec.rev)
    repo = ctx.scratch(f"step{i}-git")

    async def clone() -> None:
        ctx.report(i, "git", f"cloning {spec.url}", 0.2)
        await _git("clone", "--quiet", "--no-checkout", "--", url, str(repo))

    if remote is None:
        # e.g. an abbreviated sha: only the repository itself can expand it.
        await clone()
        commit = (await _git("-C", str(repo), "rev-parse", "--verify", f"{spec.rev}^{{commit}}")).strip()
    else:
        commit = remote

    async def build() -> LayerRef:
        if not repo.exists():
            await clone()
        ctx.report(i, "git", f"checking out {commit[:12]}", 0.5)
        await _git("-C", str(repo), "-c", "advice.detachedHead=false", "checkout", "--quiet", "--detach", commit)
        staging = ctx.scratch(f"step{i}-git-layer")

        def stage() -> None:
            if not spec.keep_git:
                fsutil.rmtree(repo / ".git")
            dest_rel = spec.dest.lstrip("/")
            if dest_rel:
                _make_parents(staging, dest_rel)
                os.rename(repo, staging / dest_rel)
                os.chmod(staging / dest_rel, 0o755)
            else:
                os.rename(repo, staging)
                os.chmod(staging, 0o755)
            _normalize_checkout_modes(staging / dest_rel)
            _own_by_root(staging)

        await asyncio.to_thread(stage)
        ctx.report(i, "git", "mkfs.erofs", 0.7)
        layer = await ctx.store.add_layer_from_dir(staging, f"git {spec.url} @ {commit} -> {spec.dest}")
        await asyncio.to_thread(fsutil.rmtree, staging)
        return layer

    # No digests of the stack below: the checkout does not depend on it. Nor the URL: the commit
    # names the content wherever it was fetched from; only a kept .git records its origin.
    key = _cache_key("git", commit=commit, dest=spec.dest, keep_git=spec.keep_git, url=url if spec.keep_git else None)
    layer, hit = await ctx.cached(key, build)
    await asyncio.to_thread(fsutil.rmtree, repo)
    return key, layer, hit


# --------------------------------------------------------------------------- apt


async def _step_apt(ctx: _Ctx, i: int, step: Step) -> tuple[str, LayerRef, bool]:
    assert isinstance(step, AptStep)
    key = _cache_key("apt", below=ctx.below(), packages=sorted(step.apt))

    async def build() -> LayerRef:
        store = ctx.store
        native = (await fsutil.run("dpkg", "--print-architecture", what="dpkg --print-architecture")).strip()
        full = ctx.scratch(f"step{i}-apt-full")
        out = ctx.scratch(f"step{i}-apt-layer")
        paths = [store.layer_path(x.digest) for x in ctx.stack]
        async with mounted_layers(paths, ctx.scratch(f"step{i}-apt-lower")) as lower:
            info = await asyncio.to_thread(read_debian_info, lower, native)
            if info is None:
                raise RecipeError(
                    "the stack below is not Debian-based (no /var/lib/dpkg/status or Debian /etc/os-release); "
                    "apt steps need a base such as debian:bookworm or { mmdebstrap = { ... } }"
                )
            # Bootstrap what the stack already has plus the new packages, so the full tree's dpkg
            # database and shared files describe the whole system, then keep only the difference.
            ctx.report(i, "apt", f"mmdebstrap {info.suite} + {', '.join(step.apt)}", 0.1)
            include = sorted(set(info.packages) | set(step.apt))
            await _mmdebstrap(full, info.suite, include=include)
            ctx.report(i, "apt", "diffing against the stack", 0.7)
            await asyncio.to_thread(trim_debian_rootfs, full)
            # Stored layers are id-shifted; shift the full tree alike so the diff compares like
            # with like, then pack without shifting again.
            await asyncio.to_thread(fsutil.shift_ownership, full, store.uid_base)
            stats = await asyncio.to_thread(fsutil.diff_trees, lower, full, out)
        await asyncio.to_thread(drop_whiteouts, out)
        await asyncio.to_thread(fsutil.rmtree, full)
        ctx.report(i, "apt", "mkfs.erofs", 0.85)
        layer = await store.add_layer_from_dir(
            out, f"apt install {' '.join(step.apt)} (+{stats.added} ~{stats.changed})", shift_ids=False
        )
        await asyncio.to_thread(fsutil.rmtree, out)
        return layer

    layer, hit = await ctx.cached(key, build)
    return key, layer, hit


# --------------------------------------------------------------------------- run


async def _step_run(ctx: _Ctx, i: int, step: Step) -> tuple[str, LayerRef, bool]:
    assert isinstance(step, RunStep)
    env = {**ctx.env, **step.env}
    cwd = step.cwd or ctx.image_workdir or "/"
    key = _cache_key("run", below=ctx.below(), command=step.run, env=env, cwd=cwd, exclude=step.exclude)

    async def work(sb: AsyncSandbox) -> None:
        ctx.report(i, "run", step.run.splitlines()[0][:80], 0.2)
        # The image's workdir until a step has made it: /, so that a step can make it.
        run_cwd = cwd if step.cwd is not None or cwd == "/" or await _is_dir(sb, cwd) else "/"
        result = await _exec_streaming(ctx, i, sb, step.run, env=env, cwd=run_cwd, timeout=step.timeout)
        _check_exec("command", result)

    async def build() -> LayerRef:
        return await _in_build_sandbox(
            ctx,
            i,
            "run",
            work,
            exclude=step.exclude,
            resources=step.resources,
            lifetime=step.timeout + 600,
            description=f"run: {step.run[:200]}",
        )

    layer, hit = await ctx.cached(key, build)
    return key, layer, hit


# --------------------------------------------------------------------------- pip


async def _step_pip(ctx: _Ctx, i: int, step: Step) -> tuple[str, LayerRef, bool]:
    assert isinstance(step, PipStep)
    # Keyed on the requirement strings, not on what they resolve to today: a warm cache then
    # builds offline and fast. Pin versions (==) to make the result reproducible.
    key = _cache_key("pip", below=ctx.below(), requirements=step.pip)

    async def build() -> LayerRef:
        store = ctx.store
        paths = [store.layer_path(x.digest) for x in ctx.stack]
        async with mounted_layers(paths, ctx.scratch(f"step{i}-pip-lower")) as lower:
            target = await asyncio.to_thread(python_version_in, lower)
            glibc = await asyncio.to_thread(glibc_version_in, lower)
        if target is None:
            raise RecipeError(
                "no python3 in the stack below; use a base such as python:3.11 or an apt step with python3"
            )
        ctx.get_client()  # fail fast, before downloading, if there is no daemon
        host_dir = ctx.scratch(f"step{i}-pip")
        wheels, boot, cwd = host_dir / "wheels", host_dir / "bootstrap", ctx.scratch(f"step{i}-pip-cwd")
        await asyncio.to_thread(cwd.mkdir, parents=True)
        # Wheels only, whatever the image's Python: building an sdist (or a source tree, a VCS
        # URL) runs its setup.py / build backend, which must not happen as root on the node.
        # --only-binary=:all: alone does not stop pip from building a direct URL, even one in a
        # wheel's dependencies; the guard does. Run from an empty directory, so that no name is
        # taken for a file there.
        pip = [sys.executable, "-c", _PIP_GUARD, str(cwd), "--disable-pip-version-check"]
        python = f"{target[0]}.{target[1]}"
        # The image's libc decides which manylinux wheels run in it, not the host's; without a
        # glibc found, pip's default is the host's platform.
        platforms = _manylinux_platforms(glibc, platform.machine()) if glibc else []
        ctx.report(i, "pip", f"fetching wheels for python {python}", 0.1)
        try:
            await fsutil.run(
                *pip, "download", "--quiet", "--only-binary=:all:", "--dest", str(wheels),
                "--python-version", python, "--implementation", "cp",
                "--abi", f"cp{target[0]}{target[1]}", "--abi", "abi3", "--abi", "none",
                *[arg for tag in platforms for arg in ("--platform", tag)],
                "--", *step.pip, what="pip download",
            )  # fmt: skip
        except ImageError as exc:
            where = f"python {python}" + (f", glibc {glibc[0]}.{glibc[1]}" if glibc else "")
            raise RecipeError(f"{exc}\nA requirement without a wheel for {where}? {_WHEELS_ONLY}") from None
        # pip only ever downloads here: anything but wheels would mean the guard failed.
        others = sorted(p.name for p in wheels.iterdir() if not p.name.endswith(".whl"))
        if others:
            raise RecipeError(f"pip download fetched non-wheels {others}: {_WHEELS_ONLY}")
        try:
            # The image need not have pip: the host's pip version, as a wheel, runs straight from
            # the zip (`python3 pip.whl/pip install`) and is not installed into the layer.
            await fsutil.run(
                *pip, "download", "--quiet", "--no-deps", "--only-binary=:all:", "--dest", str(boot),
                f"pip=={metadata.version('pip')}", what="pip download pip",
            )  # fmt: skip
        except ImageError as exc:
            raise RecipeError(str(exc)) from None
        boot_wheel = sorted(p.name for p in boot.glob("pip-*.whl"))
        if not boot_wheel:
            raise RecipeError("pip download pip produced no wheel")

        async def work(sb: AsyncSandbox) -> None:
            ctx.report(i, "pip", "uploading wheels", 0.3)
            await sb.files.upload(host_dir, PIP_DIR)
            ctx.report(i, "pip", f"pip install {' '.join(step.pip)}", 0.4)
            argv = [
                "python3", f"{PIP_DIR}/bootstrap/{boot_wheel[0]}/pip", "install", "--no-index",
                "--find-links", f"{PIP_DIR}/wheels", "--no-cache-dir", "--no-warn-script-location",
                "--root-user-action=ignore", "--disable-pip-version-check", "--", *step.pip,
            ]  # fmt: skip
            # PIP_BREAK_SYSTEM_PACKAGES: Debian marks its Python EXTERNALLY-MANAGED; an image
            # layer is exactly where we do want the packages (other Pythons ignore it).
            # PIP_CONFIG_FILE: a pip.conf in the image (index URLs) would be useless offline.
            env = {**ctx.env, "PIP_BREAK_SYSTEM_PACKAGES": "1", "PIP_CONFIG_FILE": os.devnull}
            result = await sb.exec(argv, env=env, timeout=1800, output_limit=1024**2)
            _check_exec("pip install", result)

        layer = await _in_build_sandbox(
            ctx,
            i,
            "pip",
            work,
            exclude=[PIP_DIR, "/root/.cache"],
            resources=step.resources,
            lifetime=2400,
            description=f"pip install {' '.join(step.pip)}"[:300],
        )
        await asyncio.to_thread(fsutil.rmtree, host_dir)
        return layer

    layer, hit = await ctx.cached(key, build)
    return key, layer, hit


_STEP_BUILDERS: dict[str, Callable[[_Ctx, int, Any], Awaitable[tuple[str, LayerRef, bool]]]] = {
    "apt": _step_apt,
    "pip": _step_pip,
    "copy": _step_copy,
    "git": _step_git,
    "run": _step_run,
}
