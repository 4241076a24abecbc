"""What every `sandfleet` command shares: the consoles, the --socket option, a client, error exits."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from sandfleet.client import Client
from sandfleet.errors import SandboxError

console = Console()
err_console = Console(stderr=True)
SocketOpt = Annotated[Path | None, typer.Option("--socket", envvar="SANDFLEET_SOCKET", help="daemon socket")]


def _client(socket: Path | None, timeout: float | None = None) -> Client:
    return Client(socket) if timeout is None else Client(socket, timeout=timeout)


def _spinner() -> Progress:
    """Progress for long daemon calls that report no fraction (push, import)."""
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console)


def _pairs(items: list[str] | None, what: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"{what} must be KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def _fail(exc: SandboxError) -> typer.Exit:
    err_console.print(f"[red]error[/red] ({exc.code}): {exc.message}")
    return typer.Exit(2)
