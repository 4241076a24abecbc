"""`sandfleet e2b`: serve E2B's API over a node's or a gateway's."""

from __future__ import annotations

from typing import Annotated

import typer

from sandfleet.cli_common import _pairs


def serve(
    upstream: Annotated[str, typer.Option(help="sandfleet's API: a node's or a gateway's http://HOST:PORT")],
    listen: Annotated[str, typer.Option(help="HOST:PORT to serve E2B's API on")] = "127.0.0.1:3000",
    template: Annotated[
        list[str] | None, typer.Option(help="NAME=IMAGE: an E2B template name and the image it creates")
    ] = None,
    build_templates: Annotated[
        bool,
        typer.Option(
            help="first build E2B's templates (e2b/base:1, e2b/code-interpreter:1) through the upstream "
            "(a token that may build)"
        ),
    ] = False,
    token: Annotated[
        str | None, typer.Option(envvar="SANDFLEET_TOKEN", help="the token --build-templates uses")
    ] = None,
) -> None:
    """Serve E2B's API (control plane and envd) over sandfleet's: point an E2B program at it with
    E2B_API_URL and E2B_SANDBOX_URL set to http://LISTEN and E2B_API_KEY to a sandfleet token."""
    import uvicorn

    from sandfleet.e2b import E2BConfig, create_app

    if build_templates:
        from sandfleet import Client
        from sandfleet.e2b import TEMPLATE_RECIPES

        with Client(url=upstream, token=token) as fleet:
            for recipe in TEMPLATE_RECIPES:
                built = fleet.build_recipe(recipe)
                typer.echo(f"built {built.name}:{built.tag}")
    host, _, port = listen.rpartition(":")
    config = E2BConfig(upstream=upstream)
    if template:
        config.templates.update(_pairs(template, "--template"))
    # Streams (a followed command, a PTY) may last: a stop gives them 5 s, then ends them.
    uvicorn.run(
        create_app(config), host=host or "127.0.0.1", port=int(port), log_level="warning", timeout_graceful_shutdown=5
    )
