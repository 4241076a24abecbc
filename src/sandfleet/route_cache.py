"""Which route answers a call, remembered: the node's API and the gateway share it.

Starlette finds a request's route by asking each route in turn whether it matches; FastAPI's
included routers ask each of theirs. For `POST /v1/sandboxes/{id}/exec` on a node that was ten
routers and ~60 us of the daemon's CPU, a tenth of an exec's. The first route to match a method and
path fully never changes while the routes do not, so it is remembered (the latest 4,096 calls,
paths up to 256 characters: what a caller sends cannot grow it) and asked alone next time. Anything
else (no full match: 404, 405, a redirect; WebSockets) goes through the router as before.
"""

from __future__ import annotations

from collections import OrderedDict

from starlette.routing import BaseRoute, Match, Router
from starlette.types import ASGIApp, Receive, Scope, Send

SIZE = 4096
LONGEST = 256


class RouteCache:
    """In front of `router` (`install`): a (method, path) answered by the route that answered it last."""

    def __init__(self, router: Router, inner: ASGIApp) -> None:
        self.router = router
        self.inner = inner  # the router's own dispatch
        self._seen: OrderedDict[tuple[str, str], BaseRoute] = OrderedDict()

    def find(self, scope: Scope) -> tuple[BaseRoute, Scope] | None:
        """The route that answers this HTTP call and its part of the scope, or None: no full match."""
        key = (scope["method"], scope["path"])
        route = self._seen.get(key)
        if route is not None:
            self._seen.move_to_end(key)
            match, child = route.matches(scope)
            return (route, child) if match is Match.FULL else None
        for route in self.router.routes:  # as Router.app: the first full match
            match, child = route.matches(scope)
            if match is Match.FULL:
                if len(key[1]) <= LONGEST:
                    self._seen[key] = route
                    if len(self._seen) > SIZE:
                        self._seen.popitem(last=False)
                return route, child
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = self.find(scope) if scope["type"] == "http" else None
        if found is None:
            await self.inner(scope, receive, send)
            return
        route, child = found
        scope.setdefault("router", self.router)
        scope["route"] = route
        scope.update(child)
        await route.handle(scope, receive, send)


def install(router: Router) -> RouteCache:
    """Put a route cache in front of `router`'s dispatch (once its routes are all added). A router with
    middleware of its own is refused: the cache would pass it by."""
    if router.middleware_stack != router.app:
        raise ValueError("a router with middleware of its own cannot take a route cache")
    cache = RouteCache(router, router.middleware_stack)
    router.middleware_stack = cache
    return cache
