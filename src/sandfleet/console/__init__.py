"""The web console: a single-page app the daemon serves at /console/, over its own JSON API.

Plain files, no build step: `static/index.html`, `app.js` (ES modules) and `app.css`, and the npm
libraries `scripts/vendor_console.sh` copies into `static/vendor/` at setup (xterm.js, its fit addon,
uPlot; pinned by `package-lock.json`), which only the sandbox page loads, when it is shown. Nothing is
loaded from anywhere else: the pages' Content Security Policy allows scripts from this origin only.
The page asks for a bearer token and sends it on every call; serving the page itself needs none (it
holds no data).

The files are served from memory: read once (in a worker thread, at the first request), each with a
strong ETag (304 to an If-None-Match that has it) and, for text over 1 KiB, a gzip of it made once.
Their references to each other (index.html's `static/...`, the modules' `"./x.js"`) get `?v=<version>`
on the way: the app's files the hash of all of them, the vendored ones their `vendor/.stamp`; a file
asked for with its current version is `immutable`, so a reload revalidates index.html alone. A
request of index.html stats the files (no reads) and reloads them when one changed (an upgrade, a
setup run after the daemon started, an edit).
"""

from __future__ import annotations

import gzip
import hashlib
import html
import os
import posixpath
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from anyio import to_thread
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from sandfleet import __version__

STATIC = Path(__file__).with_name("static")
VENDOR = STATIC / "vendor"
# What the sandbox page loads from vendor/ (scripts/vendor_console.sh copies these, and their licenses).
VENDORED = ("xterm.js", "xterm.css", "addon-fit.js", "uPlot.iife.min.js", "uPlot.min.css")

CSP = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "connect-src 'self' ws: wss:",
        "img-src 'self' data:",
        "style-src 'self' 'unsafe-inline'",  # xterm.js adds <style> elements of its own
        "font-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    )
)
PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}
STATIC_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
IMMUTABLE = "public, max-age=31536000, immutable"  # a file asked for with its current ?v=
GZIP_MIN = 1024  # smaller text is sent as it is

NOT_VENDORED = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>sandfleet console: not set up</title></head>
<body style="font-family: sans-serif; max-width: 40rem; margin: 4rem auto; line-height: 1.5">
<h1>The console is not set up on this node</h1>
<p>Its browser libraries are missing ({missing}). On the node, from the sandfleet checkout,
<strong>run scripts/setup.sh (vendors the console's npm libraries)</strong>, or just
<code>bash scripts/vendor_console.sh</code>.</p>
<p>sandfleet {version}</p>
</body></html>
"""


def routes() -> list[BaseRoute]:
    """`GET /console` (a redirect), `GET /console/` (the app's page), `/console/static/...` (its files)."""
    return [
        Route("/console", _redirect, methods=["GET", "HEAD"]),
        Route("/console/", _index, methods=["GET", "HEAD"]),
        Route("/console/static/{path:path}", _static, methods=["GET", "HEAD"]),
    ]


def missing_vendored() -> list[str]:
    """The vendored files the sandbox page needs that are not there."""
    return [name for name in VENDORED if not (VENDOR / name).is_file()]


async def _redirect(_request: Request) -> Response:
    return RedirectResponse("/console/", status_code=308)


async def _index(request: Request) -> Response:
    files = _files_now()
    if files is None:
        files = await to_thread.run_sync(_load)
    if files.missing:
        missing = html.escape(", ".join(files.missing))
        page = NOT_VENDORED.format(missing=missing, version=html.escape(__version__))
        return HTMLResponse(page, status_code=503, headers={**PAGE_HEADERS, "Cache-Control": "no-store"})
    if files.index is None:  # a broken install
        return Response("no static/index.html", status_code=404, media_type="text/plain")
    return files.index.response(request, PAGE_HEADERS)


async def _static(request: Request) -> Response:
    files = _loaded
    if files is None or files.key[:2] != (str(STATIC), str(VENDOR)):  # (no stat: index.html's ask does that)
        files = await to_thread.run_sync(_load)
    f = files.files.get(request.path_params["path"])
    if f is None:
        return Response("Not Found", status_code=404, media_type="text/plain")
    headers = STATIC_HEADERS
    if request.query_params.get("v") == f.version:
        headers = {**STATIC_HEADERS, "Cache-Control": IMMUTABLE}
    return f.response(request, headers)


# -- the files, in memory ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _File:
    body: bytes
    gzipped: bytes | None  # None: sent as it is
    etag: str  # strong, of `body`; the gzip's has "-gz" added
    media_type: str
    version: str  # the ?v= that makes it immutable

    def response(self, request: Request, headers: dict[str, str]) -> Response:
        body, etag = self.body, self.etag
        extra = {}
        if self.gzipped is not None:
            extra["Vary"] = "Accept-Encoding"
            if _accepts_gzip(request.headers.get("accept-encoding", "")):
                body, etag = self.gzipped, f'{self.etag[:-1]}-gz"'
                extra["Content-Encoding"] = "gzip"
        if _matches(request.headers.get("if-none-match"), etag):
            # no Content-Type or Content-Length: those of the representation the client has
            keep = ("cache-control", "vary", "x-content-type-options")
            kept = {k: v for k, v in {**headers, **extra}.items() if k.lower() in keep}
            return Response(status_code=304, headers={**kept, "ETag": etag})
        out = Response(body, media_type=self.media_type, headers={**headers, **extra, "ETag": etag})
        if request.method == "HEAD":
            out.body = b""  # the length stays that of the body
        return out


@dataclass(frozen=True)
class _Files:
    paths: list[str]  # what they were read from: the files and their directories
    key: tuple[object, ...]  # of those paths: they are read again when it changes
    files: dict[str, _File]  # by path under static/ ("app.js", "pages/jobs.js", "vendor/xterm.js")
    index: _File | None
    missing: list[str]  # vendored files not there


_loaded: _Files | None = None
_load_lock = threading.Lock()


def _files_now() -> _Files | None:
    """The files in memory, when they are still those on disk (a stat of each, no read)."""
    files = _loaded
    return files if files is not None and files.key == _key(files.paths) else None


def _key(paths: list[str]) -> tuple[object, ...]:
    """Where the files are and a stat of each (and of the directories: a file added or renamed)."""

    def stat(path: str) -> object:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    return (str(STATIC), str(VENDOR), *paths, *(stat(p) for p in paths))


def _load() -> _Files:
    """Read static/ (and VENDOR) into memory, unless another thread just did."""
    global _loaded
    with _load_lock:
        files = _files_now()
        if files is not None:
            return files
        files = _read()
        _loaded = files
        return files


def _read() -> _Files:
    own = _walk(STATIC, skip=VENDOR)
    vendor = _walk(VENDOR, skip=None)
    paths = [str(p) for p in (*own.dirs, *own.files.values(), *vendor.dirs, *vendor.files.values())]
    key = _key(paths)  # before the reads: a change while reading is seen at the next request
    vendor_version = _stamp(VENDOR) or _digest(p.read_bytes() for p in vendor.files.values())
    raw = {name: path.read_bytes() for name, path in own.files.items()}
    app_version = _digest([vendor_version.encode(), *(name.encode() + b"\0" + body for name, body in raw.items())])
    versions = {name: app_version for name in raw} | {f"vendor/{name}": vendor_version for name in vendor.files}
    index_html = raw.pop("index.html", None)
    files = {name: _file(name, _with_versions(name, body, versions), app_version) for name, body in raw.items()}
    for name, path in vendor.files.items():
        files[f"vendor/{name}"] = _file(name, path.read_bytes(), vendor_version)
    index = None if index_html is None else _file("index.html", _with_versions("", index_html, versions), "")
    missing = [name for name in VENDORED if name not in vendor.files]
    return _Files(paths=paths, key=key, files=files, index=index, missing=missing)


@dataclass
class _Tree:
    files: dict[str, Path]  # by path under the root, sorted
    dirs: list[Path]


def _walk(root: Path, skip: Path | None) -> _Tree:
    """The files under `root` (not dotfiles, not under `skip`)."""
    files: dict[str, Path] = {}
    dirs = [root]
    for top, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith(".") and Path(top, d) != skip)
        dirs += [Path(top, d) for d in subdirs]
        for name in sorted(names):
            if not name.startswith("."):
                path = Path(top, name)
                files[path.relative_to(root).as_posix()] = path
    return _Tree(files=files, dirs=dirs)


def _stamp(vendor: Path) -> str:
    """The version of the vendored files: scripts/vendor_console.sh's stamp (of the lock they came from)."""
    try:
        return vendor.joinpath(".stamp").read_text().strip()[:16]
    except OSError:
        return ""


def _digest(parts: Iterable[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.hexdigest()[:16]


# index.html's references to its files; a module's string literals that are relative paths (its imports).
_HTML_REF = re.compile(r'(?P<attr>(?:src|href)=")static/(?P<path>[^"?#]+)(?=")')
_JS_REF = re.compile(r"""(?P<q>["'])(?P<path>\.\.?/[^"'?#\s]+)(?P=q)""")


def _with_versions(name: str, body: bytes, versions: dict[str, str]) -> bytes:
    """`body` (of the file `name` under static/; "" for index.html) with `?v=<version>` on each
    reference to a file served here. Other files are left as they are."""
    if name == "":
        text = body.decode()

        def page_ref(m: re.Match[str]) -> str:
            v = versions.get(m["path"])
            return f"{m['attr']}static/{m['path']}" + (f"?v={v}" if v else "")

        return _HTML_REF.sub(page_ref, text).encode()
    if not name.endswith(".js"):
        return body
    here = posixpath.dirname(name)

    def module_ref(m: re.Match[str]) -> str:
        v = versions.get(posixpath.normpath(posixpath.join(here, m["path"])))
        return f"{m['q']}{m['path']}?v={v}{m['q']}" if v else m[0]

    return _JS_REF.sub(module_ref, body.decode()).encode()


_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".json": "application/json",
    ".map": "application/json",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".woff2": "font/woff2",
    ".txt": "text/plain; charset=utf-8",
    "": "text/plain; charset=utf-8",  # LICENSE.xterm and the like
}


def _file(name: str, body: bytes, version: str) -> _File:
    ext = posixpath.splitext(name)[1].lower()
    if name.rsplit("/", 1)[-1].startswith("LICENSE"):
        ext = ""
    media_type = _TYPES.get(ext, "application/octet-stream")
    gzipped = None
    if len(body) > GZIP_MIN and (media_type.startswith("text/") or media_type in ("application/json", "image/svg+xml")):
        packed = gzip.compress(body, compresslevel=9, mtime=0)
        gzipped = packed if len(packed) < len(body) * 0.9 else None
    etag = f'"{hashlib.sha256(body).hexdigest()[:32]}"'
    return _File(body=body, gzipped=gzipped, etag=etag, media_type=media_type, version=version)


def _accepts_gzip(accept_encoding: str) -> bool:
    """Whether an Accept-Encoding allows gzip (named, or `*`, with a q above 0)."""
    star = False
    for item in accept_encoding.split(","):
        coding, _, params = item.strip().partition(";")
        q = 1.0
        for param in params.split(";"):
            k, _, v = param.strip().partition("=")
            if k.lower() == "q":
                try:
                    q = float(v)
                except ValueError:
                    q = 0.0
        coding = coding.strip().lower()
        if coding in ("gzip", "x-gzip"):
            return q > 0
        if coding == "*":
            star = q > 0
    return star


def _matches(if_none_match: str | None, etag: str) -> bool:
    """Whether an If-None-Match names `etag` (weakly compared, as RFC 9110 has it for this header)."""
    if not if_none_match:
        return False
    if if_none_match.strip() == "*":
        return True
    return any(tag.strip().removeprefix("W/") == etag for tag in if_none_match.split(","))
