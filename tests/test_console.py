"""The web console (src/sandfleet/console) in a real browser: headless Chromium (Playwright) against a
real daemon on TCP with two tokens (an admin, a read-only one) and real sandboxes made with the SDK.

Screenshots of each page go to the test's tmp_path (printed). Skips without root, Playwright or
/usr/bin/chromium; the routes themselves (headers, the page without its vendored libraries) are
checked without any of them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

import sandfleet
from sandfleet import Client, console

from conftest import Daemon, destroy_daemon, make_daemon, serve_http, wait_until

CHROMIUM = Path("/usr/bin/chromium")
ADMIN = "console-admin-secret-00001"
READ_ONLY = "console-read-only-secret-2"
IAM_TOML = f"""
[[iam.tokens]]
name = "console-admin"
token = "{ADMIN}"
role = "admin"

[[iam.tokens]]
name = "console-ro"
token_sha256 = "{hashlib.sha256(READ_ONLY.encode()).hexdigest()}"
role = "read-only"
"""
TIMEOUT_MS = 30_000


# -- the routes, without a browser or a daemon ------------------------------------------------------


@pytest.fixture
def routes_client() -> Iterator[TestClient]:
    with TestClient(Starlette(routes=console.routes())) as c:
        yield c


@pytest.mark.unit
def test_console_routes_serve_the_page_with_a_strict_policy(
    routes_client: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vendor = tmp_path / "vendor"  # as scripts/vendor_console.sh leaves it (the browser tests load the real ones)
    vendor.mkdir()
    for name in console.VENDORED:
        (vendor / name).write_text("")
    monkeypatch.setattr(console, "VENDOR", vendor)
    r = routes_client.get("/console", follow_redirects=False)
    assert r.status_code in (307, 308) and r.headers["location"] == "/console/"
    r = routes_client.get("/console/")
    assert r.status_code == 200 and "<title>sandfleet console</title>" in r.text
    assert r.headers["cache-control"] == "no-cache"
    csp = r.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp and "connect-src 'self' ws: wss:" in csp
    assert "http" not in csp  # no other origin, no CDN
    for script in re.findall(r'src="([^"]+)"', r.text):  # every script from here, by a relative path
        assert script.startswith("static/"), script
    r = routes_client.get("/console/static/app.js")
    assert r.status_code == 200 and "javascript" in r.headers["content-type"]
    assert r.headers["cache-control"] == "no-cache" and r.headers["x-content-type-options"] == "nosniff"
    assert routes_client.get("/console/static/nothing.js").status_code == 404


@pytest.mark.unit
def test_console_files_are_served_from_memory_versioned_revalidated_and_gzipped(routes_client: TestClient) -> None:
    if console.missing_vendored():
        pytest.skip("not vendored (bash scripts/vendor_console.sh)")
    page = routes_client.get("/console/")
    assert page.status_code == 200 and page.headers["cache-control"] == "no-cache"
    # index.html: every file it names carries its version; a second ask with the ETag: 304, no body.
    refs = re.findall(r'(?:src|href)="static/([^"?]+)\?v=([0-9a-f]{16})"', page.text)
    assert {"app.js", "app.css", "api.js"} <= {path for path, _ in refs}, page.text
    again = routes_client.get("/console/", headers={"If-None-Match": page.headers["etag"]})
    assert again.status_code == 304 and again.content == b"" and again.headers["etag"] == page.headers["etag"]
    assert not re.search(r'(?:src|href)="static/vendor/', page.text)  # the sandbox page loads those, if shown
    # A file asked for with its version: cached for good; without it (or with another): revalidated.
    path, version = next(ref for ref in refs if ref[0] == "app.js")
    r = routes_client.get(f"/console/static/{path}?v={version}", headers={"Accept-Encoding": "identity"})
    assert r.status_code == 200 and "immutable" in r.headers["cache-control"]
    assert r.headers["x-content-type-options"] == "nosniff" and "content-encoding" not in r.headers
    assert r.headers["vary"] == "Accept-Encoding" and r.headers["etag"].startswith('"')
    assert routes_client.get(f"/console/static/{path}?v=0000").headers["cache-control"] == "no-cache"
    # gzipped once when the client takes it; its ETag is its own, and answers 304 too.
    gz = routes_client.get(f"/console/static/{path}?v={version}", headers={"Accept-Encoding": "gzip, br"})
    assert gz.headers["content-encoding"] == "gzip" and gz.content == r.content  # (httpx inflates it)
    assert gz.headers["etag"] != r.headers["etag"]
    for etag, enc in ((r.headers["etag"], "identity"), (gz.headers["etag"], "gzip")):
        not_modified = routes_client.get(
            f"/console/static/{path}", headers={"If-None-Match": f'"x", {etag}', "Accept-Encoding": enc}
        )
        assert not_modified.status_code == 304 and not_modified.content == b"", enc
    refused = routes_client.get(f"/console/static/{path}", headers={"Accept-Encoding": "gzip;q=0, br"})
    assert "content-encoding" not in refused.headers
    head = routes_client.head(f"/console/static/{path}", headers={"Accept-Encoding": "identity"})
    assert head.status_code == 200 and head.content == b"" and head.headers["content-length"] == str(len(r.content))
    # The modules' imports carry the version too (one wave of fetches, all cached for good) ...
    assert f'from "./api.js?v={version}"' in r.text
    # ... and libs.js names the vendored files with the vendor stamp: those are immutable as well.
    libs = routes_client.get("/console/static/libs.js").text
    stamp = (console.VENDOR / ".stamp").read_text().strip()[:16]
    assert f'"./vendor/xterm.js?v={stamp}"' in libs, libs
    xterm = routes_client.get(f"/console/static/vendor/xterm.js?v={stamp}", headers={"Accept-Encoding": "gzip"})
    assert xterm.status_code == 200 and "immutable" in xterm.headers["cache-control"]
    assert xterm.headers["content-encoding"] == "gzip" and "javascript" in xterm.headers["content-type"]
    assert routes_client.get("/console/static/vendor/.stamp").status_code == 404  # no dotfiles
    assert routes_client.get("/console/static/index.html").status_code == 404  # the page is /console/


@pytest.mark.unit
def test_index_preloads_every_module_the_app_imports() -> None:
    """One wave of module fetches: index.html names (modulepreload) every module app.js reaches."""
    static = Path(console.__file__).with_name("static")
    reached: set[str] = set()
    todo = ["app.js"]
    while todo:
        name = todo.pop()
        text = (static / name).read_text()
        for spec in re.findall(r'^\s*(?:import|export)\b[^;]*?\bfrom\s+"(\.{1,2}/[^"]+)"', text, re.M | re.S):
            target = os.path.normpath(os.path.join(os.path.dirname(name), spec))
            if target not in reached:
                reached.add(target)
                todo.append(target)
    index = (static / "index.html").read_text()
    preloaded = set(re.findall(r'<link rel="modulepreload" href="static/([^"]+)">', index))
    assert reached and preloaded == reached, (sorted(reached - preloaded), sorted(preloaded - reached))


@pytest.mark.unit
def test_console_without_its_vendored_libraries_says_how_to_set_up(
    routes_client: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(console, "VENDOR", tmp_path / "vendor")
    r = routes_client.get("/console/")
    assert r.status_code == 503
    assert "run scripts/setup.sh (vendors the console's npm libraries)" in r.text
    assert "xterm.js" in r.text and r.headers["cache-control"] == "no-store"


# -- a daemon and a browser -------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def console_daemon() -> Iterator[tuple[Daemon, str]]:
    if os.geteuid() != 0:
        pytest.skip("the container tier needs root")
    port = _free_port()
    d = make_daemon("console", f'tcp = "127.0.0.1:{port}"\n' + IAM_TOML)
    try:
        d.start()
        yield d, f"http://127.0.0.1:{port}"
    finally:
        destroy_daemon(d)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip(f"no {CHROMIUM} (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    if console.missing_vendored():
        pytest.fail(f"vendored files missing ({console.missing_vendored()}): run bash scripts/vendor_console.sh")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def admin(console_daemon: tuple[Daemon, str]) -> Iterator[Client]:
    with Client(url=console_daemon[1], token=ADMIN, timeout=60) as c:
        yield c


class Console:
    """One browser tab on the console; what it did that a test should not see (page errors, CSP
    refusals, requests to another origin) is collected for `check()`."""

    def __init__(self, browser: Any, url: str, shots: Path) -> None:
        self.url = url
        self.shots = shots
        self.context = browser.new_context(viewport={"width": 1440, "height": 1000})
        self.page = self.context.new_page()
        self.page.set_default_timeout(TIMEOUT_MS)
        self.problems: list[str] = []
        self.requests: list[str] = []  # the URLs asked for, in order
        self.page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        self.page.on("console", self._console)
        self.page.on("request", self._request)

    def _console(self, msg: Any) -> None:
        if msg.type == "error" and ("Content Security Policy" in msg.text or "Refused to" in msg.text):
            self.problems.append(f"console: {msg.text}")

    def _request(self, req: Any) -> None:
        self.requests.append(req.url)
        if not req.url.startswith((self.url, self.url.replace("http", "ws", 1), "data:")):
            self.problems.append(f"a request outside the daemon: {req.url}")

    def sign_in(self, token: str, hash_: str = "#/") -> None:
        self.page.goto(f"{self.url}/console/{hash_}")
        self.page.locator("#token").fill(token)
        self.page.locator("#login-form button[type=submit]").click()
        self.page.locator("#whoami").wait_for(state="visible")

    def go(self, hash_: str) -> None:
        self.page.evaluate("h => { location.hash = h }", hash_)

    def wait_text(self, selector: str, pattern: str) -> None:
        """Until the text of `selector` (once there) matches the regular expression `pattern`."""
        self.page.wait_for_function(
            "([s, p]) => new RegExp(p).test(document.querySelector(s)?.textContent ?? '')", arg=[selector, pattern]
        )

    def text(self, selector: str) -> str:
        return str(self.page.locator(selector).inner_text())

    def row_ids(self) -> set[str]:
        return set(self.page.locator("#sandboxes tbody tr[data-id]").evaluate_all("rs => rs.map(r => r.dataset.id)"))

    def screenshot(self, name: str) -> Path:
        path = self.shots / f"console-{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        print(f"screenshot: {path}")  # noqa: T201
        return path

    def check(self) -> None:
        assert not self.problems, self.problems
        assert self.page.locator("#error").is_hidden(), self.text("#error")

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def tab(browser: Any, console_daemon: tuple[Daemon, str], tmp_path: Path) -> Iterator[Console]:
    c = Console(browser, console_daemon[1], tmp_path)
    try:
        yield c
    finally:
        c.close()


def _state(fleet: Client, sandbox_id: str) -> str:
    return fleet.get(sandbox_id).info.state


def test_every_page_renders_for_an_admin(tab: Console, admin: Client) -> None:
    with admin.create(image="busybox", labels={"job": "pages"}, idle_ttl=300) as sb:
        tab.sign_in(ADMIN)
        assert tab.text("#whoami-name") == "console-admin"
        assert tab.page.locator("#readonly-badge").is_hidden()
        tab.page.locator("#node-version").wait_for()
        assert tab.text("#node-version") == sandfleet.__version__
        assert "container" in tab.text("#tiers")
        tab.screenshot("node")
        for hash_, ready, name, shows in (
            ("#/sandboxes", f"#sandboxes tr[data-id='{sb.id}']", "sandboxes", ("#sandboxes", "job=pages")),
            ("#/jobs", "#jobs-table tr[data-job='pages']", "jobs", ("#jobs-table", "pages")),
            ("#/images", "#images-table tbody tr", "images", ("#images-table", "busybox")),
            ("#/audit", "#audit-table tbody tr", "audit", ("#audit-table", "/v1/sandboxes")),
        ):
            tab.go(hash_)
            tab.page.locator(ready).first.wait_for()
            assert shows[1] in tab.text(shows[0]), hash_
            tab.screenshot(name)
        tab.check()


def test_sandboxes_made_with_the_sdk_are_listed_and_a_label_filter_narrows(tab: Console, admin: Client) -> None:
    run = uuid.uuid4().hex[:8]
    a = [admin.create(image="busybox", labels={"job": f"list-a-{run}", "n": str(i)}, idle_ttl=300) for i in range(3)]
    b = admin.create(image="busybox", labels={"job": f"list-b-{run}"}, idle_ttl=300)
    try:
        tab.sign_in(ADMIN, "#/sandboxes")
        tab.page.locator(f"#sandboxes tr[data-id='{b.id}']").wait_for()
        assert {s.id for s in a} | {b.id} <= tab.row_ids()
        # The label filter: only job list-a's three.
        tab.page.locator("#filter-labels").fill(f"job=list-a-{run}")
        tab.page.locator("#filters button[type=submit]").click()
        tab.page.wait_for_function("() => location.hash.includes('label=')")
        tab.page.locator(f"#sandboxes tr[data-id='{b.id}']").wait_for(state="detached")
        assert wait_until(lambda: tab.row_ids() == {s.id for s in a}, timeout=10)
        assert tab.text("#list-summary").endswith("of 3 matching")
        tab.screenshot("sandboxes-filtered")
        # Pages of two: newest first, Next, then Prev back.
        tab.go(f"#/sandboxes?label=job%3Dlist-a-{run}&limit=2")
        assert wait_until(lambda: tab.row_ids() == {a[2].id, a[1].id}, timeout=10)
        tab.page.locator("#next-page").click()
        assert wait_until(lambda: tab.row_ids() == {a[0].id}, timeout=10)
        assert tab.page.locator("#next-page").is_disabled()
        tab.page.locator("#prev-page").click()
        assert wait_until(lambda: tab.row_ids() == {a[2].id, a[1].id}, timeout=10)
        # A row leads to its sandbox.
        tab.page.locator(f"#sandboxes tr[data-id='{a[1].id}'] a.sb-link").click()
        tab.page.locator("#sb-id").wait_for()
        assert tab.text("#sb-id") == a[1].id
        tab.check()
    finally:
        for s in (*a, b):
            s.stop()


def test_the_terminal_runs_what_is_typed_and_stop_stops(tab: Console, admin: Client) -> None:
    with admin.create(image="busybox", idle_ttl=300) as sb:
        tab.sign_in(ADMIN, f"#/sandboxes/{sb.id}")
        tab.wait_text("#term-status", "^connected")
        tab.page.locator("#terminal").click()
        tab.page.keyboard.type("echo hello-$((6*7))")
        tab.page.keyboard.press("Enter")
        tab.wait_text(".xterm-rows", "hello-42")
        # The usage chart has had a few samples by now: a screenshot worth keeping.
        tab.page.wait_for_timeout(4500)
        tab.screenshot("sandbox")
        # Stop (a second click confirms), the terminal open.
        tab.page.locator("#btn-stop").click()
        tab.page.locator("#btn-stop").click()
        assert wait_until(lambda: sb.id not in {s.id for s in admin.list()}, timeout=30)
        tab.wait_text("#term-status", "^disconnected")
        tab.page.locator("#sb-state .state-stopped").wait_for()
        tab.check()


def test_pause_and_resume_from_the_sandbox_page(tab: Console, admin: Client) -> None:
    with admin.create(image="busybox", idle_ttl=300) as sb:
        tab.sign_in(ADMIN, f"#/sandboxes/{sb.id}")
        tab.page.locator("#sb-state .state-running").wait_for()
        tab.wait_text("#term-status", "^connected")
        tab.page.locator("#btn-pause").click()
        assert wait_until(lambda: _state(admin, sb.id) == "paused", timeout=30)
        tab.page.locator("#sb-state .state-paused").wait_for()
        assert tab.page.locator("#btn-pause").is_disabled()
        tab.screenshot("sandbox-paused")
        tab.page.locator("#btn-resume").click()
        assert wait_until(lambda: _state(admin, sb.id) == "running", timeout=30)
        tab.page.locator("#sb-state .state-running").wait_for()
        # The terminal (closed for the pause: a sandbox with a request in flight is not paused) is back.
        tab.wait_text("#term-status", "^connected")
        tab.check()


def test_a_read_only_token_cannot_act(tab: Console, admin: Client) -> None:
    with admin.create(image="busybox", labels={"job": "read-only"}, idle_ttl=300) as sb:
        tab.sign_in(READ_ONLY, f"#/sandboxes/{sb.id}")
        assert tab.text("#whoami-name") == "console-ro"
        assert tab.page.locator("#readonly-badge").is_visible()
        tab.page.locator("#sb-state .state-running").wait_for()
        for button in ("#btn-pause", "#btn-resume", "#btn-stop", "#term-connect"):
            assert tab.page.locator(button).is_disabled(), button
        # The API refuses anyway: a direct call ...
        status, body = tab.page.evaluate(
            """async (id) => {
                const r = await fetch(`/v1/sandboxes/${id}`, {method: "DELETE",
                    headers: {Authorization: `Bearer ${sessionStorage.getItem("sandfleet.token")}`}});
                return [r.status, await r.json()];
            }""",
            sb.id,
        )
        assert status == 403 and body["error"]["code"] == "permission_denied", body
        # ... and the button, forced on: the refusal shows in the error banner.
        tab.page.locator("#btn-stop").evaluate("b => { b.dataset.readonly = ''; b.disabled = false }")
        tab.page.locator("#btn-stop").click()  # arms it
        tab.page.locator("#btn-stop").click()  # acts
        tab.page.locator("#error").wait_for(state="visible")
        assert "permission_denied" in tab.text("#error")
        tab.screenshot("read-only")
        assert _state(admin, sb.id) == "running"
        # The jobs page: its actions are disabled too.
        tab.go("#/jobs")
        row = tab.page.locator("#jobs-table tr[data-job='read-only']")
        row.wait_for()
        assert all(row.locator("button.action").evaluate_all("bs => bs.map(b => b.disabled)"))


def test_stopping_a_job_from_the_jobs_page_stops_exactly_its_sandboxes(tab: Console, admin: Client) -> None:
    run = uuid.uuid4().hex[:8]
    doomed = [admin.create(image="busybox", labels={"job": f"doomed-{run}"}, idle_ttl=300) for _ in range(2)]
    kept = admin.create(image="busybox", labels={"job": f"kept-{run}"}, idle_ttl=300)
    try:
        tab.sign_in(ADMIN, "#/jobs")
        row = tab.page.locator(f"#jobs-table tr[data-job='doomed-{run}']")
        row.wait_for()
        assert row.locator("td").nth(1).inner_text() == "2"
        tab.screenshot("jobs")
        stop = row.locator("button.action", has_text="Stop")
        stop.click()  # arms it
        stop.click()  # stops the job
        tab.page.locator("#notice").wait_for(state="visible")
        assert f"2 sandboxes of job=doomed-{run}" in tab.text("#notice")
        assert wait_until(lambda: not admin.list(labels={"job": f"doomed-{run}"}), timeout=30)
        row.wait_for(state="detached")
        assert _state(admin, kept.id) == "running"
        tab.check()
    finally:
        for s in (*doomed, kept):
            s.stop()


def test_only_the_sandbox_page_loads_the_terminal_and_chart_libraries(tab: Console, admin: Client) -> None:
    with admin.create(image="busybox", labels={"job": "libs"}, idle_ttl=300) as sb:
        tab.sign_in(ADMIN, "#/")
        tab.page.locator("#node-live").wait_for()
        for hash_, ready in (
            ("#/images", "#images-table tbody tr"),
            ("#/sandboxes", f"#sandboxes tr[data-id='{sb.id}']"),
            ("#/jobs", "#jobs-table tr[data-job='libs']"),
            ("#/audit", "#audit-table tbody tr"),
        ):
            tab.go(hash_)
            tab.page.locator(ready).first.wait_for()
        assert not [u for u in tab.requests if "/vendor/" in u]
        # Every module in one wave: those index.html preloads, each asked for once (with its version).
        modules = [u for u in tab.requests if re.search(r"/console/static/.*\.js\?v=", u)]
        assert len(modules) == len(set(modules)) >= 13, modules
        tab.go(f"#/sandboxes/{sb.id}")
        tab.wait_text("#term-status", "^connected")
        tab.page.locator("#usage-chart .uplot").wait_for()
        vendored = {u.split("/vendor/")[1].split("?")[0] for u in tab.requests if "/vendor/" in u}
        assert vendored == set(console.VENDORED)
        tab.check()


def test_a_second_load_asks_for_the_page_only(tab: Console, admin: Client) -> None:
    with admin.create(image="busybox", idle_ttl=300) as sb:
        url = f"{tab.url}/console/#/sandboxes/{sb.id}"
        tab.sign_in(ADMIN, f"#/sandboxes/{sb.id}")
        tab.wait_text("#term-status", "^connected")
        tab.page.locator("#usage-chart .uplot").wait_for()
        tab.page.goto("about:blank")
        tab.page.goto(url)  # the token is still in the tab's sessionStorage
        tab.wait_text("#term-status", "^connected")
        tab.page.locator("#usage-chart .uplot").wait_for()
        # What went over the wire (Resource Timing): for the page, its headers only (revalidated: a
        # 304); for every file it names, modules and vendored libraries, nothing (from the cache
        # without a request: their URLs carry their version, they are immutable).
        page, *files = tab.page.evaluate(
            """() => [...performance.getEntriesByType("navigation"), ...performance.getEntriesByType("resource")]
                .filter((e) => e.name.includes("/console/"))
                .map((e) => [e.name, e.transferSize, e.encodedBodySize])"""
        )
        assert 0 < page[1] < page[2], page
        assert len(files) >= 18 and any("/vendor/xterm.js" in name for name, _, _ in files), files
        assert all(size == 0 for _, size, _ in files), files
        tab.check()


def test_the_jobs_page_shows_the_counts_of_v1_jobs(tab: Console, admin: Client) -> None:
    run = uuid.uuid4().hex[:8]
    made = [
        admin.create(image="busybox", labels={"job": f"count-{run}", f"shard-{run}": s}, idle_ttl=300)
        for s in ("a", "a", "b")
    ]
    try:
        made[0].pause()
        tab.sign_in(ADMIN, "#/jobs")
        row = tab.page.locator(f"#jobs-table tr[data-job='count-{run}']")
        row.wait_for()

        def cells(row: Any) -> dict[str, str]:
            heads = tab.page.locator("#jobs-table thead th").all_inner_texts()
            return dict(zip(heads, row.locator("td").all_inner_texts(), strict=True))

        assert {k: v for k, v in cells(row).items() if k in ("sandboxes", "running", "paused")} == {
            "sandboxes": "3",
            "running": "2",
            "paused": "1",
        }
        calls = [u.split("/v1/", 1)[1] for u in tab.requests if "/v1/" in u]
        assert "jobs?key=job&state=live" in calls and not [c for c in calls if c.startswith("sandboxes")], calls
        # Another key: its values are the rows.
        tab.page.locator("#job-key").fill(f"shard-{run}")
        tab.page.locator("#job-key").press("Enter")
        tab.page.locator("#jobs-table tr[data-job='b']").wait_for()
        assert cells(tab.page.locator("#jobs-table tr[data-job='a']"))["sandboxes"] == "2"
        assert cells(tab.page.locator("#jobs-table tr[data-job='b']"))["sandboxes"] == "1"
        assert tab.text("#jobs-summary").startswith(f'2 values of label "shard-{run}" over 3 live sandboxes')
        tab.check()
    finally:
        for s in made:
            s.stop()


def test_signing_in_with_a_wrong_token_is_refused(tab: Console) -> None:
    tab.page.goto(f"{tab.url}/console/")
    tab.page.locator("#login").wait_for(state="visible")
    tab.page.locator("#token").fill("not-a-token-of-this-node")
    tab.page.locator("#login-form button[type=submit]").click()
    tab.page.locator("#login-message").wait_for(state="visible")
    assert "refused" in tab.text("#login-message")
    assert tab.page.locator("#whoami").is_hidden()


# A page a sandbox serves on an exposed port, going for the console's origin: its token, its storage,
# a cookie, a service worker over the whole origin, the API with the browser's credentials.
ATTACK_PAGE = """<!doctype html><meta charset="utf-8"><title>port page</title><body>
<script>
(async () => {
  const out = {};
  const attempt = async (name, fn) => {
    try { out[name] = String(await fn()); } catch (e) { out[name] = "refused: " + e.name; }
  };
  await attempt("token", () => sessionStorage.getItem("sandfleet.token"));
  await attempt("wipe", () => { sessionStorage.clear(); localStorage.clear(); return "wiped"; });
  await attempt("cookie", () => { document.cookie = "planted=by-script; path=/"; return document.cookie; });
  await attempt("worker", () => navigator.serviceWorker.register("sw.js", {scope: "/"}).then(() => "registered"));
  await attempt("api", () => fetch("/v1/whoami", {credentials: "include"}).then(r => r.text()));
  document.body.dataset.out = JSON.stringify(out);
  document.title = "done";
})();
</script>
"""
# ... and the headers it answers with (on every file, the page and its worker script alike).
ATTACK_HEADERS = 'Clear-Site-Data: "*"\nSet-Cookie: planted=by-header; Path=/\nService-Worker-Allowed: /\n'


def test_a_page_on_an_exposed_port_cannot_touch_the_console(tab: Console, admin: Client) -> None:
    """Issue 26 item 5: a page served from an exposed port shares the console's origin by URL. It gets
    an opaque origin (no storage, cookies or service workers of the daemon's), and the headers that act
    on the origin whatever the page's policy (Clear-Site-Data, Set-Cookie, Service-Worker-Allowed)
    are dropped: the console's token and data outlive a visit to it."""
    with admin.create(image="python", idle_ttl=300) as sb:
        sb.files.write("/srv/sw.js", b"self.addEventListener('fetch', () => {});\n")
        serve_http(sb, 8000, ATTACK_PAGE, ATTACK_HEADERS)
        tab.sign_in(ADMIN)
        tab.page.evaluate("localStorage.setItem('console.probe', 'kept')")
        # The browser reaches the port with the token (as a user's bookmarked port would, by HTTP Basic).
        tab.context.route(
            "**/ports/**",
            lambda route: route.continue_(headers={**route.request.headers, "authorization": f"Bearer {ADMIN}"}),
        )
        tab.page.goto(f"{tab.url}/v1/sandboxes/{sb.id}/ports/8000/index.html")
        tab.page.wait_for_function("document.title === 'done'")
        out = json.loads(tab.page.evaluate("document.body.dataset.out"))
        for name in ("token", "wipe", "cookie", "worker", "api"):
            assert out[name].startswith("refused"), out
        # Back on the console, in the same tab: still signed in, its data kept, nothing planted.
        tab.page.goto(f"{tab.url}/console/")
        tab.page.wait_for_selector("#whoami:not([hidden]), #login:not([hidden])")
        assert tab.page.evaluate("sessionStorage.getItem('sandfleet.token')") == ADMIN, "signed out"
        assert tab.page.locator("#whoami").is_visible()
        assert tab.page.evaluate("localStorage.getItem('console.probe')") == "kept"
        assert tab.context.cookies() == []
        assert tab.page.evaluate("navigator.serviceWorker.getRegistrations().then(r => r.length)") == 0
