"""The E2B-compatible server: E2B's control plane and envd on one address, over a node's or a
gateway's API (`sandfleet e2b`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from sandfleet.e2b._upstream import Upstream
from sandfleet.e2b.control import Control
from sandfleet.e2b.envd import Envd
from sandfleet.e2b.hosts import HostRouting
from sandfleet.e2b.interpreter import Interpreter

# envd's version as the SDK reads it: 0.6.4 is the newest its features are gated on (file metadata,
# octet-stream uploads, closing stdin), so every call of the SDK is made the current way.
ENVD_VERSION = "0.6.4"
BASE_RECIPE = Path(__file__).with_name("base.toml")  # E2B's base template: python:3.11 and its user
BASE_IMAGE = "e2b/base:1"  # the recipe's ref
# E2B's code-interpreter template: the base with numpy, pandas, matplotlib and pillow
CODE_INTERPRETER_RECIPE = Path(__file__).with_name("code_interpreter.toml")
CODE_INTERPRETER_IMAGE = "e2b/code-interpreter:1"
TEMPLATE_RECIPES = (BASE_RECIPE, CODE_INTERPRETER_RECIPE)  # in build order: each on the one before
DOCUMENT = Path(__file__).with_name("openapi.json")


class E2BConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    upstream: str = Field(description="sandfleet's API the calls go to: a node's or a gateway's http://HOST:PORT")
    templates: dict[str, str] = Field(
        default_factory=lambda: {"base": BASE_IMAGE, "code-interpreter-v1": CODE_INTERPRETER_IMAGE},
        description="E2B template names and the sandfleet images they create (another name is an image name)",
    )
    timeout: float = Field(300.0, gt=0, description="seconds a call to sandfleet may take")


async def _document(request: Request) -> Response:
    """The layer's own OpenAPI document (its REST, envd and interpreter routes; Connect's unary calls)."""
    return FileResponse(DOCUMENT, media_type="application/json")


def create_app(config: E2BConfig) -> ASGIApp:
    """E2B's REST control plane, envd's routes and the code interpreter's on one ASGI app: their
    paths do not overlap, so E2B_API_URL and E2B_SANDBOX_URL can both be its address. A sandbox's
    host (`<port>-<id>.<domain>`) reaches envd, the interpreter or that port (hosts.py)."""
    upstream = Upstream(config.upstream, config.timeout)
    control = Control(upstream, config.templates, ENVD_VERSION)
    envd = Envd(upstream)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        yield
        envd.close()
        await hosts.aclose()
        await upstream.aclose()

    routes = [*control.routes(), *envd.routes(), *Interpreter(upstream).routes(), Route("/openapi.json", _document)]
    hosts = HostRouting(Starlette(routes=routes, lifespan=lifespan), upstream)
    return hosts
