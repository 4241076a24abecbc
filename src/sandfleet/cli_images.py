"""`sandfleet images`: list, push, import, rm, gc and build images through the daemon."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from sandfleet.cli_common import SocketOpt, _client, _fail, _spinner, console, err_console
from sandfleet.errors import SandboxError
from sandfleet.models import BuildEvent

images_app = typer.Typer(help="List and build images.", invoke_without_command=True)


@images_app.callback()
def images_list(ctx: typer.Context, socket: SocketOpt = None) -> None:
    """List images (when no subcommand is given)."""
    if ctx.invoked_subcommand is not None:
        return
    with _client(socket) as fleet:
        try:
            imgs = fleet.images()
        except SandboxError as exc:
            raise _fail(exc) from exc
    table = Table("IMAGE", "LAYERS", "SIZE", "CREATED")
    for i in imgs:
        table.add_row(
            f"{i.name}:{i.tag}",
            str(len(i.layers)),
            f"{i.size / 1024**2:.1f}MiB" + (" (on demand)" if i.on_demand else ""),
            time.strftime("%Y-%m-%d %H:%M", time.localtime(i.created)),
        )
    console.print(table)


@images_app.command("push")
def images_push(refs: Annotated[list[str], typer.Argument(help="name:tag")], socket: SocketOpt = None) -> None:
    """Publish local images to the daemon's shared store as on-demand layers."""
    with _client(socket, timeout=3600) as fleet, _spinner() as progress:
        for ref in refs:
            task = progress.add_task(f"{ref}: pushing", total=None)
            try:
                info = fleet.push_image(ref)
            except SandboxError as exc:
                raise _fail(exc) from exc
            progress.update(task, total=1, completed=1, description=f"{ref}: {info.size / 2**20:.1f} MiB shared")


@images_app.command("import")
def images_import(
    source: Annotated[Path, typer.Argument(help="a `docker save` tarball, an OCI image layout dir, or its tar")],
    ref: Annotated[str | None, typer.Option(help="name:tag (default: the archive's own tag)")] = None,
    socket: SocketOpt = None,
) -> None:
    """Import an OCI or Docker image: each layer becomes an EROFS layer (small ones merged)."""
    with _client(socket, timeout=3600) as fleet, _spinner() as progress:
        task = progress.add_task(f"{source}: importing", total=None)
        try:
            info = fleet.import_image(str(source.resolve()), ref)
        except SandboxError as exc:
            raise _fail(exc) from exc
        progress.update(task, total=1, completed=1, description=f"{info.name}:{info.tag}: {len(info.layers)} layer(s)")


@images_app.command("rm")
def images_rm(refs: Annotated[list[str], typer.Argument(help="name:tag")], socket: SocketOpt = None) -> None:
    """Delete images (their layers go at the next `sandfleet images gc` once nothing uses them)."""
    with _client(socket) as fleet:
        for ref in refs:
            try:
                fleet.delete_image(ref)
            except SandboxError as exc:
                raise _fail(exc) from exc


@images_app.command("gc")
def images_gc(
    min_age: Annotated[float, typer.Option(help="keep layers younger than this many seconds")] = 600.0,
    socket: SocketOpt = None,
) -> None:
    """Delete layer files no image, sandbox or snapshot uses."""
    with _client(socket) as fleet:
        try:
            res = fleet.gc_images(min_age)
        except SandboxError as exc:
            raise _fail(exc) from exc
    console.print(f"removed {len(res.removed)} layers, {res.bytes / 2**20:.1f} MiB freed")


class _BuildReport:
    """What `images build` shows of one recipe's build: each step as it finishes, its commands'
    output before it, and the progress bar on a terminal."""

    def __init__(
        self, target: str, total: int, say: Callable[[str], None], progress: Progress | None, task: TaskID | None
    ) -> None:
        self.target, self.total, self.say, self.progress, self.task = target, total, say, progress, task
        self.steps = self.hits = 0

    def __call__(self, ev: BuildEvent) -> None:
        if ev.type == "progress" and self.progress is not None and self.task is not None:
            self.progress.update(self.task, completed=ev.fraction or 0.0, description=f"{self.target}: {ev.stage}")
        elif ev.type == "step":
            self.steps, self.hits = self.steps + 1, self.hits + bool(ev.cache_hit)
            what = "cache hit" if ev.cache_hit else "built"
            named = f" -> {ev.name}" if ev.name else ""
            head = f"{self.target}: step {ev.index}/{self.total} {ev.kind}"
            self.say(f"{head}: {what} {ev.layer} ({ev.seconds or 0.0:.2f}s){named}")
        elif ev.type == "output":
            self.say(f"  [{ev.index}{'' if ev.stream == 'stdout' else ' stderr'}] {ev.line}")


@images_app.command("build")
def images_build(
    targets: Annotated[
        list[str],
        typer.Argument(help="recipe files (TOML), or built-in images: busybox, debian:bookworm, python:3.11"),
    ],
    config: Annotated[
        Path | None,
        typer.Option(help="the daemon's config file (as for `sandfleet serve --config`): its socket is used"),
    ] = None,
    socket: Annotated[
        Path | None,
        typer.Option(
            "--socket",
            help="daemon socket (default: the config's, else $SANDFLEET_SOCKET, else /run/sandfleet/sandfleet.sock)",
        ),
    ] = None,
) -> None:
    """Build images in the daemon's layer store: one cached layer per recipe step.

    The recipe goes to the daemon (the one way into its store), which reads the recipe's `copy` and
    `git` sources from the recipe's directory and runs `run` and `pip` steps in build sandboxes.
    Each step is printed as it finishes (index, kind, cache hit or built, layer digest, seconds),
    with the output of `run` steps as it comes; on a terminal, with a progress bar as well.
    """
    from sandfleet.daemon.config import DEFAULT_SOCKET, DaemonConfig
    from sandfleet.images import ImageError

    if socket is None:
        try:
            cfg = DaemonConfig.load(config)
        except (OSError, ValueError) as exc:  # unreadable file, bad TOML, invalid settings
            raise typer.BadParameter(f"--config {config}: {exc}") from exc
        env_socket = os.environ.get("SANDFLEET_SOCKET")
        if config is not None and "socket" in cfg.model_fields_set:
            socket = cfg.socket
        else:
            socket = Path(env_socket) if env_socket else DEFAULT_SOCKET
    interactive = console.is_terminal

    def build_all(out: Console, progress: Progress | None) -> None:
        def say(text: str) -> None:
            out.print(text, markup=False, highlight=False, soft_wrap=True)

        with _client(socket) as fleet:
            for target in targets:
                task = progress.add_task(target, total=1.0) if progress is not None else None
                if not target.endswith(".toml"):
                    m = fleet.build_image(target)
                    done = f"{target}: {len(m.layers)} layer(s) ready"
                else:
                    from sandfleet.images.recipe import Recipe

                    recipe = Recipe.load(Path(target))  # its errors here, before the daemon is asked
                    if not interactive:
                        say(f"{target}: building {recipe.ref} ({len(recipe.steps)} step(s))")
                    report = _BuildReport(target, len(recipe.steps), say, progress, task)
                    m = fleet.build_recipe(target, on_event=report)
                    done = f"{m.name}:{m.tag}: {len(m.layers)} layer(s), {report.hits}/{report.steps} from cache"
                if progress is not None and task is not None:
                    progress.update(task, completed=1.0, description=done)
                else:
                    say(done)

    try:
        if interactive:
            with Progress(
                SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console
            ) as progress:
                build_all(progress.console, progress)
        else:
            build_all(console, None)
    except SandboxError as exc:
        raise _fail(exc) from exc
    except (OSError, ValueError, ImageError) as exc:  # an unreadable or invalid recipe file
        err_console.print(f"[red]error[/red]: {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from exc
