"""E2B's REST control plane (sandboxes: create, connect, get, list, kill, timeout, pause, resume;
snapshots, forks, metrics, templates), each call made as sandfleet calls with the caller's API key
(X-API-Key) as its token."""

from __future__ import annotations

import datetime
import json
import re
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sandfleet.client.aio import AsyncSandbox
from sandfleet.e2b import network
from sandfleet.e2b._upstream import Upstream
from sandfleet.errors import (
    ImageNotFoundError,
    InvalidArgumentError,
    NotFoundError,
    SandboxError,
    SandboxNotFoundError,
    UnsupportedError,
    WrongStateError,
)
from sandfleet.models import MAX_SECONDS, SandboxInfo, SandboxSpec, SnapshotInfo

TEMPLATE_LABEL = "e2b.dev/template"  # the E2B template a sandbox was created from
NAME_LABEL = "e2b.dev/name"  # a snapshot's name
SNAPSHOT_PREFIX = "snap-"  # sandfleet's snapshot ids: E2B creates from them as from templates
DEFAULT_TIMEOUT = 300  # seconds: E2B's default sandbox lifetime
PAUSED_FOR = 30 * 86400.0  # seconds a sandbox paused at its timeout is kept (E2B keeps one 30 days)
CLIENT_ID = "sandfleet"


# E2B's SDKs this layer is checked against (docs/e2b.md); a call from another major version is
# refused with a clear error instead of half working (E2B's API changed between majors).
SUPPORTED = {"python": ((2, 45), (3, 0)), "js": ((2, 0), (3, 0))}
_AGENT = re.compile(r"e2b-(python|js)-sdk/(\d+)\.(\d+)")


def check_sdk(request: Request) -> None:
    """The SDK's version from its User-Agent (`e2b-python-sdk/2.63.0`); other clients pass."""
    m = _AGENT.search(request.headers.get("user-agent", ""))
    if m is None:
        return
    lang, version = m.group(1), (int(m.group(2)), int(m.group(3)))
    low, high = SUPPORTED[lang]
    if not low <= version < high:
        raise UnsupportedError(
            f"E2B's {lang} SDK {version[0]}.{version[1]} is not supported by sandfleet's E2B layer: "
            f"use {low[0]}.{low[1]} or later, before {high[0]}.0 (docs/e2b.md)"
        )


def rest_error(exc: SandboxError) -> JSONResponse:
    """E2B's error body ({code, message}); `Should-Retry: false`: sandfleet's client already retried
    what could be, and E2B's SDK would otherwise retry a 503 or 429 three more times."""
    status = exc.http_status if exc.http_status != 410 else 404
    return JSONResponse({"code": status, "message": str(exc)}, status_code=status, headers={"Should-Retry": "false"})


Handler = Callable[[Request, "Control"], Awaitable[Response]]


class Control:
    def __init__(self, upstream: Upstream, templates: dict[str, str], envd_version: str) -> None:
        self.upstream = upstream
        self.templates = templates
        self.envd_version = envd_version

    def routes(self) -> list[Route]:
        def route(path: str, fn: Handler, method: str) -> Route:
            async def endpoint(request: Request) -> Response:
                try:
                    check_sdk(request)
                    return await fn(request, self)
                except SandboxError as exc:
                    return rest_error(exc)

            return Route(path, endpoint, methods=[method])

        return [
            route("/sandboxes", create, "POST"),
            route("/v2/sandboxes", create, "POST"),
            route("/sandboxes", list_sandboxes, "GET"),
            route("/v2/sandboxes", list_sandboxes, "GET"),
            route("/sandboxes/{sandbox_id}", get_sandbox, "GET"),
            route("/sandboxes/{sandbox_id}", kill, "DELETE"),
            route("/sandboxes/{sandbox_id}/timeout", set_timeout, "POST"),
            route("/sandboxes/{sandbox_id}/refreshes", refresh, "POST"),
            route("/sandboxes/{sandbox_id}/pause", pause, "POST"),
            route("/sandboxes/{sandbox_id}/resume", resume, "POST"),
            route("/sandboxes/{sandbox_id}/connect", connect, "POST"),
            route("/v2/sandboxes/{sandbox_id}/connect", connect, "POST"),
            route("/templates", templates, "GET"),
            route("/sandboxes/{sandbox_id}/snapshots", create_snapshot, "POST"),
            route("/snapshots", list_snapshots, "GET"),
            route("/templates/{template_id}", delete_template, "DELETE"),
            route("/sandboxes/{sandbox_id}/fork", fork, "POST"),
            route("/sandboxes/{sandbox_id}/metrics", metrics, "GET"),
            route("/sandboxes/{sandbox_id}/network", update_network, "PUT"),
        ]

    def key(self, request: Request) -> str | None:
        return request.headers.get("x-api-key")

    def sandbox(self, request: Request) -> AsyncSandbox:
        return self.upstream.sandbox(self.key(request), request.path_params["sandbox_id"])

    def created(self, request: Request, info: SandboxInfo) -> dict[str, Any]:
        """E2B's `Sandbox`: what a create or a connect answers."""
        return {
            "templateID": info.spec.labels.get(TEMPLATE_LABEL, ""),
            "sandboxID": info.id,
            "clientID": CLIENT_ID,
            "envdVersion": self.envd_version,
            # envd calls carry it back as X-Access-Token: the key itself, so they act as its project.
            "envdAccessToken": self.key(request),
            "trafficAccessToken": self.key(request),  # what the code interpreter's calls carry
            "domain": None,
        }

    def detail(self, info: SandboxInfo) -> dict[str, Any]:
        """E2B's `SandboxDetail` / `ListedSandbox`."""
        spec = info.spec
        if spec.pause_after is not None:  # pauses that many idle seconds from its last request
            end = time.time() + spec.pause_after
        elif spec.max_lifetime:
            end = info.created_at + spec.max_lifetime
        else:
            end = info.created_at + DEFAULT_TIMEOUT
        return {
            "templateID": spec.labels.get(TEMPLATE_LABEL, ""),
            "sandboxID": info.id,
            "clientID": CLIENT_ID,
            "startedAt": _rfc3339(info.created_at),
            "endAt": _rfc3339(end),
            "envdVersion": self.envd_version,
            "cpuCount": max(1, int(spec.resources.cpu)),
            "memoryMB": int(spec.resources.memory) >> 20,
            "diskSizeMB": int(spec.resources.disk) >> 20,
            "state": "paused" if info.state == "paused" else "running",
            "metadata": {k: v for k, v in spec.labels.items() if k != TEMPLATE_LABEL},
        }


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise InvalidArgumentError(f"the body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidArgumentError("the body must be a JSON object")
    return body


def _timeout(body: dict[str, Any], name: str = "timeout", default: int | None = DEFAULT_TIMEOUT) -> int | None:
    value = body.get(name, default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_SECONDS:
        raise InvalidArgumentError(f"{name} must be a whole number of seconds, at most {int(MAX_SECONDS)}")
    return value


def _rfc3339(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat().replace("+00:00", "Z")


def _strings(body: dict[str, Any], name: str) -> dict[str, str]:
    value = body.get(name) or {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise InvalidArgumentError(f"{name} must be an object of strings")
    return value


async def create(request: Request, c: Control) -> Response:
    body = await _body(request)
    template = body.get("templateID") or "base"
    if not isinstance(template, str):
        raise InvalidArgumentError("templateID must be a string")
    timeout = _timeout(body)
    egress = network.policy(body.get("network"), body.get("allow_internet_access"))
    auto_pause = body.get("autoPause") or False
    if not isinstance(auto_pause, bool):
        raise InvalidArgumentError("autoPause must be a boolean")
    # E2B's on_timeout "pause": paused (memory kept: a filesystem-only pause keeps it too) after the
    # timeout's seconds without a request, resumed by the next one, never stopped by the timeout; a
    # paused sandbox is kept PAUSED_FOR idle seconds, as E2B keeps a paused one.
    lifetime: dict[str, float | None] = (
        {"pause_after": timeout or DEFAULT_TIMEOUT, "idle_ttl": PAUSED_FOR}
        if auto_pause
        else {"max_lifetime": timeout or None, "idle_ttl": None}  # it lives its timeout, busy or idle
    )
    try:
        spec = SandboxSpec(
            image=c.templates.get(template, template),
            env=_strings(body, "envVars"),
            labels={**_strings(body, "metadata"), TEMPLATE_LABEL: template},
            **lifetime,
            **({"network": egress} if egress is not None else {}),
        )
    except ValueError as exc:  # pydantic's ValidationError: metadata that are no labels, an image name
        raise InvalidArgumentError(f"the sandbox cannot be made from this request: {exc}"[:500]) from exc
    fleet = c.upstream.client(c.key(request))
    if template.startswith(SNAPSHOT_PREFIX):  # a snapshot is a template to E2B: restored, then timed
        made = await _made(await fleet.restore(template, idempotency_key=request.headers.get("idempotency-key")))
        info = await _extend(made[0], timeout or DEFAULT_TIMEOUT)
        return JSONResponse(c.created(request, info), status_code=201)
    try:
        sb = await fleet.create(spec, idempotency_key=request.headers.get("idempotency-key"))
    except ImageNotFoundError as exc:
        raise NotFoundError(
            f"template {template} (image {spec.image}) is not on this node: build it (`sandfleet e2b "
            f"--build-templates`, or `sandfleet images build`), or map the name (`--template {template}=IMAGE`)"
        ) from exc
    return JSONResponse(c.created(request, sb.info), status_code=201)


async def update_network(request: Request, c: Control) -> Response:
    """E2B's update_network: the sandbox's egress policy replaced at once (network.py's mapping)."""
    body = await _body(request)
    egress = network.policy(body, body.pop("allow_internet_access", None))
    if egress is None:
        raise UnsupportedError("sandfleet's egress policy cannot allow all traffic: name it in allowOut")
    await c.sandbox(request).set_network(egress)
    return Response(status_code=204)


async def get_sandbox(request: Request, c: Control) -> Response:
    info = await c.sandbox(request).refresh()
    if info.state not in ("creating", "running", "paused"):
        return rest_error(_gone(info.id))
    return JSONResponse(c.detail(info))


def _gone(sandbox_id: str) -> SandboxError:
    return SandboxNotFoundError(f"sandbox {sandbox_id} not found")


async def list_sandboxes(request: Request, c: Control) -> Response:
    wanted = {"running", "paused"}
    if state := request.query_params.get("state"):
        wanted = {s.strip() for s in state.split(",") if s.strip()}
    labels = {}
    if metadata := request.query_params.get("metadata"):
        labels = {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in urllib.parse.parse_qsl(metadata)}
    fleet = c.upstream.client(c.key(request))
    found = await fleet.list(labels or None)
    # Every sandbox of the key's project (made through E2B or not), as E2B lists a team's; paged
    # (`limit`, `nextToken` in and `x-next-token` out: an offset), newest first unless `order=asc`.
    live = sorted((i for i in found if i.state in ("creating", "running", "paused")), key=lambda i: i.created_at)
    if request.query_params.get("order", "desc") != "asc":
        live.reverse()
    if template := request.query_params.get("template"):
        live = [i for i in live if i.spec.labels.get(TEMPLATE_LABEL) == template]
    if after := request.query_params.get("startedAfter"):
        try:
            since = datetime.datetime.fromisoformat(after.replace("Z", "+00:00")).timestamp()
        except ValueError as exc:
            raise InvalidArgumentError(f"startedAfter is not an ISO 8601 time: {exc}") from exc
        live = [i for i in live if i.created_at >= since - 1e-6]  # from that instant on (startedAt's rounding)
    out = [d for d in (c.detail(i) for i in live) if d["state"] in wanted]
    limit = _query_int(request, "limit", 100, 1, 1000)
    start = _query_int(request, "nextToken", 0, 0, len(out))
    page = out[start : start + limit]
    headers = {"x-next-token": str(start + limit)} if start + limit < len(out) else {}
    return JSONResponse(page, headers=headers)


def _query_int(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    if not (raw.isascii() and raw.isdigit()) or not low <= int(raw) <= high:
        raise InvalidArgumentError(f"{name} must be a whole number from {low} to {high}")
    return int(raw)


async def kill(request: Request, c: Control) -> Response:
    info = await c.sandbox(request).refresh()
    if info.state not in ("creating", "running", "paused"):
        return rest_error(_gone(info.id))
    await c.sandbox(request).stop("e2b kill")
    return Response(status_code=204)


async def _extend(sb: AsyncSandbox, seconds: int) -> SandboxInfo:
    """E2B's timeout: the sandbox ends `seconds` from now (sandfleet's limit counts from creation);
    one that pauses at its timeout pauses after that many idle seconds."""
    info = await sb.refresh()
    if info.spec.pause_after is not None:
        return await sb.set_lifetime(pause_after=max(1, seconds))
    return await sb.set_lifetime(max_lifetime=max(1.0, time.time() - info.created_at + seconds))


async def set_timeout(request: Request, c: Control) -> Response:
    seconds = _timeout(await _body(request), default=None)
    if seconds is None:
        raise InvalidArgumentError("timeout is required")
    await _extend(c.sandbox(request), seconds)
    return Response(status_code=204)


async def refresh(request: Request, c: Control) -> Response:
    seconds = _timeout(await _body(request), "duration", DEFAULT_TIMEOUT) or DEFAULT_TIMEOUT
    await _extend(c.sandbox(request), seconds)
    return Response(status_code=204)


async def pause(request: Request, c: Control) -> Response:
    sb = c.sandbox(request)
    if (await sb.refresh()).state == "paused":
        return rest_error(WrongStateError(f"sandbox {sb.id} is already paused"))
    await sb.pause()
    return Response(status_code=204)


async def resume(request: Request, c: Control) -> Response:
    sb = c.sandbox(request)
    body = await _body(request)
    if (await sb.refresh()).state != "paused":
        return rest_error(WrongStateError(f"sandbox {sb.id} is not paused"))
    await sb.resume()
    info = await _extend(sb, _timeout(body) or DEFAULT_TIMEOUT)
    return JSONResponse(c.created(request, info), status_code=201)


async def connect(request: Request, c: Control) -> Response:
    """Connect: a paused sandbox is resumed (201), a running one answered as it is (200); either way
    its timeout is set again when one is given."""
    sb = c.sandbox(request)
    body = await _body(request)
    info = await sb.refresh()
    if info.state not in ("creating", "running", "paused"):
        return rest_error(_gone(info.id))
    status = 200
    if info.state == "paused":
        await sb.resume()
        status = 201
    seconds = _timeout(body, default=None)
    limit = info.spec.max_lifetime  # None: no end to extend
    if seconds is not None and limit is not None and time.time() + seconds > info.created_at + limit:
        info = await _extend(sb, seconds)  # a connect extends the sandbox's life, never shortens it
    return JSONResponse(c.created(request, info), status_code=status)


async def templates(request: Request, c: Control) -> Response:
    c.upstream.client(c.key(request))  # authenticated like every call
    return JSONResponse(
        [{"templateID": name, "aliases": [name], "public": True, "buildStatus": "ready"} for name in c.templates]
    )


async def _made(results: list[AsyncSandbox | SandboxError]) -> list[AsyncSandbox]:
    """A restore's or fork's children, or the first child's error."""
    for r in results:
        if isinstance(r, SandboxError):
            raise r
    return [r for r in results if isinstance(r, AsyncSandbox)]


async def create_snapshot(request: Request, c: Control) -> Response:
    """E2B's snapshot: sandfleet's (processes, memory, files), kept until deleted; its name a label."""
    body = await _body(request)
    name = body.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidArgumentError("name must be a string")
    try:
        snap = await c.sandbox(request).snapshot(labels={NAME_LABEL: name} if name else None)
    except ValueError as exc:  # a name that is no label value
        raise InvalidArgumentError(f"the snapshot's name cannot be kept: {exc}"[:300]) from exc
    return JSONResponse(_snapshot(snap), status_code=201)


def _snapshot(snap: SnapshotInfo) -> dict[str, Any]:
    name = snap.labels.get(NAME_LABEL)
    return {"snapshotID": snap.id, "names": [name] if name else []}


async def list_snapshots(request: Request, c: Control) -> Response:
    fleet = c.upstream.client(c.key(request))
    found = await fleet.snapshots(request.query_params.get("sandboxID") or None)
    if name := request.query_params.get("name"):
        found = [s for s in found if s.labels.get(NAME_LABEL) == name]
    found.sort(key=lambda s: s.created_at, reverse=True)
    limit = _query_int(request, "limit", 100, 1, 1000)
    start = _query_int(request, "nextToken", 0, 0, len(found))
    headers = {"x-next-token": str(start + limit)} if start + limit < len(found) else {}
    return JSONResponse([_snapshot(s) for s in found[start : start + limit]], headers=headers)


async def delete_template(request: Request, c: Control) -> Response:
    """E2B deletes a snapshot as a template; sandfleet's templates are its images (not deleted here)."""
    template_id = request.path_params["template_id"]
    if not template_id.startswith(SNAPSHOT_PREFIX):
        raise UnsupportedError("templates are sandfleet's images here: `sandfleet images rm` deletes one")
    await c.upstream.client(c.key(request)).delete_snapshot(template_id)
    return Response(status_code=204)


async def fork(request: Request, c: Control) -> Response:
    """E2B's fork: sandfleet's (copies of the sandbox as it is now), each timed like a create."""
    body = await _body(request)
    count = body.get("count", 1)
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= 64:
        raise InvalidArgumentError("count must be a whole number from 1 to 64")
    seconds = _timeout(body) or DEFAULT_TIMEOUT
    results = await c.sandbox(request).fork(count, idempotency_key=request.headers.get("idempotency-key"))
    out: list[dict[str, Any]] = []
    for r in results:
        if isinstance(r, SandboxError):
            out.append({"error": {"code": r.http_status, "message": str(r)}})
        else:
            out.append({"sandbox": c.created(request, await _extend(r, seconds))})
    return JSONResponse(out, status_code=201)


async def metrics(request: Request, c: Control) -> Response:
    """One sample, now, from the sandbox's cgroup: CPU as its average since it started (sandfleet keeps
    no history per sandbox), memory now; disk is not measured per sandbox (0 used)."""
    sb = c.sandbox(request)
    info = await sb.refresh()
    if info.state not in ("creating", "running", "paused"):
        return rest_error(_gone(info.id))
    now = time.time()
    # The sample covers the sandbox's life so far: none if that does not meet [start, end] (seconds).
    start = _query_int(request, "start", 0, 0, 1 << 40)
    end = _query_int(request, "end", 1 << 40, 0, 1 << 40)
    if info.created_at > end + 1 or now < start:
        return JSONResponse([])
    usage = await sb.usage()
    cpus = max(1, int(info.spec.resources.cpu))
    return JSONResponse(
        [
            {
                "timestamp": _rfc3339(now),
                "timestampUnix": int(now),
                "cpuCount": cpus,
                "cpuUsedPct": round(100 * usage.cpu_seconds / max(1e-3, now - info.created_at) / cpus, 2),
                "memUsed": usage.memory_bytes,
                "memTotal": int(info.spec.resources.memory),
                "memCache": 0,
                "diskUsed": 0,
                "diskTotal": int(info.spec.resources.disk),
            }
        ]
    )
