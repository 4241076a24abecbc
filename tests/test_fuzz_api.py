"""Schemathesis against docs/openapi.json: every operation fuzzed on its own (stateless), then chained
through the links schemathesis infers from the response schemas (stateful; the document has no
explicit OpenAPI links, and needs none: `as_state_machine()` infers 160+ of them, e.g. POST
/v1/sandboxes -> {sandbox_id}, POST .../sessions -> {session_id}, POST .../snapshots -> {snapshot_id}).

What must hold, for inputs the document allows and for inputs it forbids (negative mode):
  - no 5xx, and no `internal` / `data_loss` error inside a 200 (batch, fork, restore items);
  - the status code is one the document lists, with its content type and a body matching its schema;
  - afterwards GET /v1/sandboxes answers, `Client.list()` decodes it, and the daemon logged no traceback.

Bounded: SANDFLEET_FUZZ_EXAMPLES examples per operation (default 50), SANDFLEET_FUZZ_SCENARIOS stateful
scenarios (default 40) of at most 8 steps: ~2 minutes on a 2-core node when all pass. A daemon of its
own: TCP + bearer token (schemathesis talks HTTP over TCP), its own layer store (fuzzed image deletes
and `gc?min_age=0` must not touch the shared one), imports confined to an empty directory, at most 16
sandboxes; the waits a request asks for are capped (WAIT_CAPS). Path parameters are, half the time,
those of real resources: seed sandboxes with a finished background process, an open session and a
snapshot, replaced when fuzzing stops them; sandboxes the fuzzer creates are stopped once 10 s old,
and every live or paused one at the end.
"""

from __future__ import annotations

import io
import os
import secrets
import shutil
import socket
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import FlakyStrategyDefinition  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from conftest import Daemon, destroy_daemon, make_daemon  # noqa: E402

SPEC = Path(__file__).resolve().parent.parent / "docs" / "openapi.json"
TOKEN = secrets.token_hex(16)
MAX_EXAMPLES = int(os.environ.get("SANDFLEET_FUZZ_EXAMPLES", "50"))
SCENARIOS = int(os.environ.get("SANDFLEET_FUZZ_SCENARIOS", "40"))
SEEDS = 2
FUZZ_SANDBOX_AGE = 10.0  # seconds before a sandbox the fuzzer created is stopped

# A watch (and the followed audit stream) streams ndjson until the client leaves: `requests`
# (schemathesis' transport) would wait forever (it cuts only text/event-stream short). Covered by
# their own tests, not here.
ENDLESS = r"/files/watch$|^/v1/audit/follow$"
# Node-wide switches: a fuzzed drain would make every later create answer `unavailable` (503, as it
# should), a fence stops every sandbox of the node; both are tested in tests/test_cluster.py.
NODE_WIDE = r"^/v1/node/drain$|^/v1/node/fence$"
SCHEMA = schemathesis.openapi.from_path(SPEC).exclude(path_regex=f"{ENDLESS}|{NODE_WIDE}")
# Pooled calls: each new `resources` value starts a worker (a sandbox plus its interpreter, at that
# CPU quota: ~10 s at cpu=0.01), so they get fewer examples than the rest.
CALLS = r"^/v1/run"
CALL_EXAMPLES = max(1, MAX_EXAMPLES // 10)
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HYPOTHESIS = {
    "deadline": None,
    "database": None,  # no .hypothesis/ in the tree; a failure prints its minimal example and a curl line
    "suppress_health_check": list(HealthCheck),
}


# -- checks -----------------------------------------------------------------------------------------


@schemathesis.check
def no_internal_error_items(ctx: Any, response: Any, case: Any) -> bool | None:
    """Batch, fork and restore answer 200 with one item per sandbox: an item's internal error is a 5xx
    in disguise (`not_a_server_error` cannot see it)."""
    content_type = (response.headers.get("content-type") or [""])[0].split(";")[0].strip()
    if response.status_code == 200 and content_type == "application/json":
        body = response.json()
        if isinstance(body, dict) and isinstance(body.get("results"), list):
            bad = [
                item["error"]
                for item in body["results"]
                if isinstance(item, dict) and (item.get("error") or {}).get("code") in ("internal", "data_loss")
            ]
            assert not bad, f"server error inside a 200: {bad[0]}"
    return None


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    no_internal_error_items,
]


# -- request bodies schemathesis cannot make itself ------------------------------------------------


@st.composite
def tar_archives(draw: st.DrawFn) -> bytes:
    """Small archives of files, dirs and links (absolute and `..` names included), or plain junk."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=512))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for _ in range(draw(st.integers(0, 3))):
            info = tarfile.TarInfo(draw(st.sampled_from(["a", "d/b", "../x", "/abs", ".", "d"])))
            info.type = draw(st.sampled_from([tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE]))
            info.mode = draw(st.integers(0, 0o7777))
            data = draw(st.binary(max_size=128)) if info.type == tarfile.REGTYPE else b""
            info.size = len(data)
            if info.type in (tarfile.SYMTYPE, tarfile.LNKTYPE):
                info.linkname = draw(st.sampled_from(["/etc/passwd", "../..", "a"]))
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


schemathesis.openapi.media_type("application/x-tar", tar_archives())


# -- real resources for path parameters ------------------------------------------------------------


class SeedPool:
    """A few live sandboxes, each with a finished background process, a session and a snapshot, so
    {sandbox_id}, {process_id}, {session_id}, {snapshot_id} can be real; checked at most once a second
    (fuzzing stops and pauses them), and the fuzzer's own sandboxes stopped once FUZZ_SANDBOX_AGE old."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, headers=AUTH, timeout=120)
        self.resources: list[dict[str, str]] = []
        self.checked = 0.0
        self.lock = threading.Lock()

    def _seed(self) -> dict[str, str] | None:
        r = self.http.post("/v1/sandboxes", json={"image": "busybox", "idle_ttl": 300, "labels": {"fuzz": "seed"}})
        if r.status_code != 201:
            return None
        sid = r.json()["id"]
        res = {"sandbox_id": sid}
        # Finished, so GET .../processes/{id}?wait=3600 answers at once instead of blocking.
        for key, path, body in (
            ("process_id", "processes", {"command": "true", "background": True}),
            ("session_id", "sessions", {}),
            ("snapshot_id", "snapshots", None),
        ):
            made = self.http.post(f"/v1/sandboxes/{sid}/{path}", json=body)
            if made.status_code == 201:
                res[key] = made.json()["id"]
        return res

    def refresh(self) -> list[dict[str, str]]:
        with self.lock:
            if time.monotonic() - self.checked < 1.0:
                return self.resources
            self.checked = time.monotonic()
            seeds = {res["sandbox_id"] for res in self.resources}
            listed = self.http.get("/v1/sandboxes")
            live = set()
            if listed.status_code == 200:
                for sb in listed.json()["sandboxes"]:
                    if sb["state"] not in ("running", "paused"):
                        continue
                    if sb["id"] in seeds:
                        live.add(sb["id"])
                    elif time.time() - sb["created_at"] > FUZZ_SANDBOX_AGE:
                        self.http.delete(f"/v1/sandboxes/{sb['id']}")
            self.resources = [res for res in self.resources if res["sandbox_id"] in live]
            while len(self.resources) < SEEDS and (res := self._seed()) is not None:
                self.resources.append(res)
            return self.resources


POOL: SeedPool | None = None


@SCHEMA.hook
def flatmap_path_parameters(context: Any, path_parameters: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """The generated values, or those of one real resource (image refs stay generated: the fuzzer
    must not delete the images the seeds run on)."""
    if POOL is None or not path_parameters or "ref" in path_parameters:
        return st.just(path_parameters)
    pool = POOL

    def real(i: int) -> dict[str, Any]:
        # Looked up when drawn, after the index: what Hypothesis draws never depends on the pool's state
        # (a strategy shaped by server state fails its replay as FlakyStrategyDefinition).
        seeds = pool.refresh()
        res = seeds[i] if i < len(seeds) else {}
        return {k: res.get(k, v) for k, v in path_parameters.items()}

    return st.one_of(st.just(path_parameters), st.integers(0, SEEDS - 1).map(real))


# -- the daemon -------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def fuzz_daemon() -> Iterator[Daemon]:
    global POOL
    if os.geteuid() != 0:
        pytest.skip("the container tier needs root")
    port = _free_port()
    own = Path(tempfile.mkdtemp(prefix="sandfleet-fuzz-store-"))
    (own / "images").mkdir()
    (own / "imports").mkdir()
    # A layer store of its own (fuzzed deletes and gc must not touch the shared one), no imports from the host.
    extra = f'tcp = "127.0.0.1:{port}"\ntoken = "{TOKEN}"\nmax_sandboxes = 16\nimport_dirs = ["{own / "imports"}"]\n'
    d = make_daemon("fuzz", extra, images=own / "images")
    d.start()
    url = f"http://127.0.0.1:{port}"
    # For the state machine (built after this); `parametrize()` fixed its copy at import: passed per call.
    SCHEMA.config.update(base_url=url, headers=AUTH, request_timeout=120)
    POOL = SeedPool(url)
    POOL.refresh()  # builds busybox into the private store (seconds) and makes the seeds
    try:
        yield d
    finally:
        listed = POOL.http.get("/v1/sandboxes")
        for sb in listed.json()["sandboxes"] if listed.status_code == 200 else []:
            if sb["state"] in ("running", "paused"):
                POOL.http.delete(f"/v1/sandboxes/{sb['id']}")
        POOL.http.close()
        POOL = None
        destroy_daemon(d)
        shutil.rmtree(own, ignore_errors=True)


# Waits a request may ask for, capped so that each answer fits in the client's 120 s: a verification
# on a node full of the fuzzer's sandboxes rightly waits for room up to its queue_timeout (an hour by
# default), and the state machine stops those sandboxes only between its requests.
WAIT_CAPS = {"queue_timeout": 30.0, "timeout": 60.0, "compile_timeout": 30.0, "run_timeout": 30.0, "wait": 30.0}
VERIFY_WAITS = {"queue_timeout": 30.0, "timeout": 60.0}  # in place of its defaults, an hour and 10 minutes


def _bound_waits(case: Any) -> None:
    if isinstance(case.body, dict) and case.path.endswith("/verify"):
        for name, cap in VERIFY_WAITS.items():
            case.body.setdefault(name, cap)
    for fields in (case.body, case.query):
        if not isinstance(fields, dict):
            continue
        for name, cap in WAIT_CAPS.items():
            value = fields.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool) and value > cap:
                fields[name] = cap


# -- the tests --------------------------------------------------------------------------------------


@SCHEMA.exclude(path_regex=CALLS).parametrize()
@settings(max_examples=MAX_EXAMPLES, **HYPOTHESIS)
def test_stateless(case: Any, fuzz_daemon: Daemon) -> None:
    assert POOL is not None
    _bound_waits(case)
    case.call_and_validate(base_url=POOL.url, headers=AUTH, checks=CHECKS, timeout=120)


@SCHEMA.include(path_regex=CALLS).parametrize()
@settings(max_examples=CALL_EXAMPLES, **HYPOTHESIS)
def test_stateless_calls(case: Any, fuzz_daemon: Daemon) -> None:
    assert POOL is not None
    _bound_waits(case)
    case.call_and_validate(base_url=POOL.url, headers=AUTH, checks=CHECKS, timeout=120)


def test_stateful(fuzz_daemon: Daemon) -> None:
    """Scenarios through the inferred links. Which rules can run depends on what the daemon answered
    (a create refused at max_sandboxes leaves its bundle empty), so the same choices can take another
    path when Hypothesis replays them: it then stops with `FlakyStrategyDefinition`, which says nothing
    about the daemon. Hence failed checks are recorded, not raised (nothing to replay), and a run a
    replay stopped is followed by another until SCENARIOS scenarios have run."""
    failures: list[str] = []
    ran = 0

    class Workflow(SCHEMA.as_state_machine()):  # type: ignore[misc]
        def validate_response(self, response: Any, case: Any, additional_checks: Any = None, **kwargs: Any) -> None:
            try:
                case.validate_response(response, checks=CHECKS, transport_kwargs=kwargs or None)
            except Exception as exc:  # noqa: BLE001 - every failed check is reported below, with its request
                failures.append(f"{exc}\n{case.as_curl_command(headers=AUTH)}")

        def call(self, case: Any, **kwargs: Any) -> Any:
            _bound_waits(case)
            try:
                return super().call(case, **kwargs)
            except requests.exceptions.Timeout:  # a hung request: say which (a replay would only say "flaky")
                failures.append(f"no answer in 120 s\n{case.as_curl_command(headers=AUTH)}")
                raise

        def teardown(self) -> None:
            nonlocal ran
            ran += 1

    for _ in range(10):  # measured: a replay diverges about once per 40-100 scenarios
        if ran >= SCENARIOS or failures:
            break
        try:
            Workflow.run(settings=settings(max_examples=SCENARIOS - ran, stateful_step_count=8, **HYPOTHESIS))
        except FlakyStrategyDefinition:
            pass
        except Exception:
            if not failures:  # else reported below, with the request
                raise
    assert not failures, f"{len(failures)} failed checks; the first:\n{failures[0]}"
    assert ran >= SCENARIOS, f"only {ran} of {SCENARIOS} scenarios ran"


def test_list_still_decodes(fuzz_daemon: Daemon) -> None:
    """Whatever the fuzzing stored, listing still works end to end, and nothing crashed on the side."""
    assert POOL is not None
    r = POOL.http.get("/v1/sandboxes")
    assert r.status_code == 200, r.text[:500]
    with fuzz_daemon.client(timeout=120) as c:
        c.list()
        c.list(state="stopped")
    log = fuzz_daemon.log()
    assert "Traceback" not in log, log[max(0, log.index("Traceback") - 300) :][:3000]
