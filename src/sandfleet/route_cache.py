"""Which route answers a call, remembered: the node's API and the gateway share it.

Starlette finds a request's route by asking each route in turn whether it matches; FastAPI's
included routers ask each of theirs. For `POST /v1/sandboxes/{id}/exec` on a node that was ten
routers and ~60 us of the daemon's CPU, a tenth of an exec's. The first route to match a method and
path fully does not change while the routes do not, so it is remembered and asked alone next time:
the router's own dispatch then runs over that one route (a copy of the router holding only it), so
whatever the router does around a match (FastAPI's scope merging and form limits) is done as
before. Sandbox and snapshot ids in a path are one key (no route names an id), so a node's
thousands of sandboxes share a handful of entries; the latest 4,096 keys are kept, each up to 256
characters: what a caller sends cannot grow it. Anything else (no full match: 404, 405, a redirect;
WebSockets and lifespan) goes through the router as before, and a change in the router's routes
empties the cache.
"""

from __future__ import annotations

import copy
import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from starlette.convertors import Convertor
from starlette.routing import BaseRoute, Match, Router, compile_path
from starlette.types import ASGIApp, Receive, Scope, Send

SIZE = 4096
LONGEST = 256
_ID = re.compile(r"(?<=/)(?:sb|snap)-[0-9a-f]{16}(?=/|$)")  # sandfleet/ids.py's sandbox and snapshot ids


def _key(scope: Scope) -> tuple[str, str]:
    path: str = scope["path"]
    return scope["method"], _ID.sub("*", path) if "-" in path else path


_Ahead = tuple[re.Pattern[str], dict[str, "Convertor[Any]"], ASGIApp]


class RouteCache:
    """In front of `router` (`install`): a call answered by the route that answered its key last."""

    def __init__(self, router: Router, inner: ASGIApp) -> None:
        self.router = router
        self.inner = inner  # the router's own dispatch
        self._seen: OrderedDict[tuple[str, str], BaseRoute] = OrderedDict()
        self._alone: dict[int, ASGIApp] = {}  # id(route) -> the router's dispatch over it alone
        self._routes = len(router.routes)
        # answers ahead of the routes, by (method, "/"s in the path, its last segment or "" for a
        # parameter there): found in one or two lookups, not by trying each pattern in turn
        self._ahead: dict[tuple[str, int, str], list[_Ahead]] = {}

    def _fresh(self) -> None:
        if len(self.router.routes) != self._routes:  # routes added or removed: start again
            self._seen.clear()
            self._alone.clear()
            self._ahead.clear()  # (judged against the routes as they were)
            self._routes = len(self.router.routes)

    def find(self, scope: Scope) -> BaseRoute | None:
        """The route that answers this HTTP call (the router's first full match), or None."""
        self._fresh()
        key = _key(scope)
        route = self._seen.get(key)
        if route is not None:
            self._seen.move_to_end(key)
            return route if route.matches(scope)[0] is Match.FULL else None
        for route in self.router.routes:
            if route.matches(scope)[0] is Match.FULL:
                if len(key[1]) <= LONGEST:
                    self._seen[key] = route
                    if len(self._seen) > SIZE:
                        self._seen.popitem(last=False)
                return route
        return None

    def ahead(self, method: str, path: str, make: Callable[[ASGIApp], ASGIApp]) -> None:
        """Answer `method` on `path` (a route's template) with `make(dispatch)` ahead of every route,
        `dispatch` being the cache's own (for what that answer leaves to the router). A parameter
        of `path` is one whole segment, not a `:path` one, and no two paths answered ahead may
        both match a call (the node's lean answers never do: `Api.route`)."""
        if ":path}" in path:
            raise ValueError(f"{path}: a parameter spanning segments cannot be answered ahead")
        regex, _format, convertors = compile_path(path)
        last = path.rsplit("/", 1)[1]
        key = (method, path.count("/"), "" if "{" in last else last)
        self._ahead.setdefault(key, []).append((regex, convertors, make(self.dispatch)))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._fresh()
        if self._ahead and scope["type"] == "http" and not scope.get("root_path"):
            method, path = scope["method"], scope["path"]
            depth, last = path.count("/"), path.rsplit("/", 1)[-1]
            for candidates in (self._ahead.get((method, depth, last)), self._ahead.get((method, depth, ""))):
                for regex, convertors, app in candidates or ():
                    if (match := regex.match(path)) is not None:
                        scope["path_params"] = {k: convertors[k].convert(v) for k, v in match.groupdict().items()}
                        await app(scope, receive, send)
                        return
        await self.dispatch(scope, receive, send)

    async def dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.find(scope) if scope["type"] == "http" else None
        if route is None:
            await self.inner(scope, receive, send)
            return
        alone = self._alone.get(id(route))
        if alone is None:
            single = copy.copy(self.router)
            single.routes = [route]
            alone = self._alone[id(route)] = single.app
        scope.setdefault("router", self.router)  # (the whole router, for url_for)
        await alone(scope, receive, send)


def install(router: Router) -> RouteCache:
    """Put a route cache in front of `router`'s dispatch (once its routes are all added). A router with
    middleware of its own is refused: the cache would pass it by."""
    if router.middleware_stack != router.app:
        raise ValueError("a router with middleware of its own cannot take a route cache")
    cache = RouteCache(router, router.middleware_stack)
    router.middleware_stack = cache
    return cache
