"""The hot JSON operations answered without FastAPI's layers (issue 30, H1).

An `exec` spent a third of the daemon's CPU in uvicorn, Starlette and FastAPI: the included
routers' dispatch, solving dependencies, serializing the answer through FastAPI's field. An
operation whose handler takes its path parameters and one JSON body model, and answers one model,
(or a response of its own: the ndjson streams) is served here instead, ahead of the router
(`route_cache.RouteCache.ahead`), doing what FastAPI would do for it and nothing else: the same
body checks (`checked_json`), the caller's project admitted as the route's dependency does it, the
body validated into the same model, the same handler called, its answer written as FastAPI writes
a response model (by alias, JSON mode), or its response sent as it is.

Everything it cannot do just as FastAPI would goes to the router as before, the body replayed:
a body that is not `application/json`, is not JSON, or fails validation (its 400 then says what
FastAPI's says). An exception from the handler leaves as it would from the route, to the app's
exception handlers.
"""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandfleet.operations import Operation

if TYPE_CHECKING:
    from sandfleet.daemon.security.tenancy import Tenancy

JSON = b"application/json"  # the one body type answered here
Check = Callable[[Request], Awaitable[tuple[bytes, Any]]]


def body_model(op: Operation, fn: Callable[..., Any], extra: set[str]) -> tuple[str, type[BaseModel]] | None:
    """(parameter, model) when `fn` can be served lean: a POST answering its declared model, or a
    response of its own (a stream), whose parameters are the path's (plain strings) and one body
    model, registered with nothing lean would not do as FastAPI does (`extra`: the route's options;
    a response class and responses only shape the OpenAPI document of a handler that returns a
    response of its own); else None."""
    if op.methods != ("POST",):
        return None
    hints = typing.get_type_hints(fn, include_extras=True)  # (Annotated limits: not lean)
    answer = hints.get("return")
    own = op.answer is None and type(answer) is type and issubclass(answer, Response)
    if answer is not op.answer and not own:
        return None
    if not extra <= ({"tags", "response_class", "responses", "summary"} if own else {"tags"}):
        return None
    body: tuple[str, type[BaseModel]] | None = None
    in_path = set(compile_path(op.path)[2])
    for name, param in inspect.signature(fn).parameters.items():
        kind = hints.get(name)
        if param.default is not inspect.Parameter.empty:
            return None
        if name in in_path and kind is str:
            in_path.discard(name)
            continue
        if body is None and type(kind) is type(BaseModel) and issubclass(kind, BaseModel):  # (a bare model)
            body = (name, kind)
            continue
        return None
    return body if not in_path else None  # (each path parameter is the handler's)


def overlaps(a: str, b: str) -> bool:
    """Whether some path matches both route templates (a `:path` parameter: assumed so)."""
    if ":path}" in a or ":path}" in b:
        return True
    sa, sb = a.split("/"), b.split("/")
    if len(sa) != len(sb):
        return False
    return all(x == y or "{" in x or "{" in y for x, y in zip(sa, sb, strict=True))


def lean_app(
    op: Operation,
    fn: Callable[..., Awaitable[Any]],
    body: tuple[str, type[BaseModel]],
    tenancy: Tenancy,
    check: Check,
) -> Callable[[ASGIApp], ASGIApp]:
    """The operation's lean answer, given the router's own dispatch (`routed`) to fall back on."""
    name, model = body
    status = op.status
    serializer = op.answer.__pydantic_serializer__ if op.answer is not None else None

    def make(routed: ASGIApp) -> ASGIApp:
        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            request = Request(scope, receive)
            if media_type(request.headers.get("content-type", "")) != "application/json":
                await routed(scope, receive, send)
                return
            data, parsed = await check(request)  # (a bad body: its 400 raised here)
            try:
                if parsed is NOT_JSON:
                    raise ValueError("not JSON")
                req = model.model_validate(parsed)
            except ValueError:  # (pydantic's ValidationError is one)
                await routed(scope, _replay(data, receive), send)
                return
            params: dict[str, Any] = scope["path_params"]
            if tenancy.iam is not None:
                await tenancy.admit(op, params)
            answer = await fn(**params, **{name: req})
            if serializer is None:  # a response of its own: FastAPI sends it as it is
                await answer(scope, receive, send)
                return
            out = serializer.to_json(answer, by_alias=True)  # as the declared model (FastAPI's response_model)
            headers = [(b"content-length", str(len(out)).encode()), (b"content-type", JSON)]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": out})

        return app

    return make


def _replay(data: bytes, receive: Receive) -> Receive:
    """`receive` with the body already read given again first."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": data, "more_body": False}

    return again


NOT_JSON = object()  # a body that is no JSON: the router says what is wrong


def json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return NOT_JSON


def media_type(content_type: str) -> str:
    """A Content-Type's media type, as FastAPI reads it (case aside, parameters dropped)."""
    return content_type.split(";", 1)[0].strip().lower()


def is_json(content_type: str) -> bool:
    """Whether FastAPI parses a body of this Content-Type as JSON (application/json, application/*+json)."""
    kind = media_type(content_type)
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))
