"""The HTTP API contract: the checked-in OpenAPI document, live responses against it, the error
contract (typed, closed set of codes, no leaks on bad requests or failed creates), TCP + bearer
token, and the SDK's mapping of wire errors to the exception tree.

Raw requests go over the daemon's unix socket with plain httpx, so the SDK's own validation does not
hide what the daemon does with bad input.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import importlib.util
import json
import os
import re
import shutil
import socket
import sqlite3
import stat
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from openapi_spec_validator import validate as validate_openapi
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from sandfleet import Client, Mount
from sandfleet.client import _base as wire
from sandfleet.client.sync import Sandbox
from sandfleet.errors import (
    CAUSES,
    WIRE_CODES,
    ImageNotFoundError,
    InvalidArgumentError,
    NotFoundError,
    SandboxNotFoundError,
    UnauthenticatedError,
    UnavailableError,
    WrongStateError,
)

from conftest import IMAGES, Daemon, destroy_daemon, make_daemon

REPO = Path(__file__).resolve().parent.parent
SPEC_FILE = REPO / "docs" / "openapi.json"
GENERATOR = REPO / "scripts" / "gen_openapi.py"
SPEC_URI = "urn:sandfleet:openapi"
CODES = {
    "invalid_argument", "not_found", "wrong_state", "resource_exhausted", "timeout", "unauthenticated",
    "permission_denied", "unsupported", "unavailable", "sandbox_lost", "data_loss", "internal",
}  # fmt: skip
# What must never show up in an error message: tracebacks, source locations, dotted class paths.
LEAKY = re.compile(
    r"Traceback|File \"|<class |\b[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)+\.[A-Z][A-Za-z]+(Error|Exception)\b"
)
NO_SUCH_SANDBOX = "sb-0000000000000000"


# -- the spec ---------------------------------------------------------------------------------------


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("gen_openapi", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(SPEC_FILE.read_text())
    return doc


def _pointer(*parts: str) -> str:
    return "#/" + "/".join(p.replace("~", "~0").replace("/", "~1") for p in parts)


class Contract:
    """Validates live responses against the checked-in OpenAPI document."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        resource = Resource.from_contents(doc, default_specification=DRAFT202012)
        self.registry: Registry[Any] = Registry().with_resource(SPEC_URI, resource)
        # Literal paths first, so /v1/sandboxes/stop is not taken for /v1/sandboxes/{sandbox_id}.
        paths = sorted(doc["paths"], key=lambda p: ("{" in p, p))
        self.routes = [(re.compile("^" + re.sub(r"\{[^/}]+\}", "[^/]+", p) + "$"), p) for p in paths]

    def validate(self, instance: object, ref: str) -> None:
        validator = jsonschema.Draft202012Validator({"$ref": SPEC_URI + ref}, registry=self.registry)
        validator.validate(instance)

    def schema_ref(self, method: str, path: str, status: int) -> str:
        """Pointer to the documented JSON schema of this response (ErrorResponse off the map)."""
        template = next((t for rx, t in self.routes if rx.match(path)), None)
        if template is None or method not in self.doc["paths"][template]:
            assert status >= 400, f"{method.upper()} {path} answered {status} but is not in the spec"
            return "#/components/schemas/ErrorResponse"
        responses = self.doc["paths"][template][method]["responses"]
        assert str(status) in responses, f"{method.upper()} {template}: status {status} is not documented"
        content = responses[str(status)].get("content", {})
        assert "application/json" in content, f"{method.upper()} {template} {status}: no JSON body documented"
        return _pointer("paths", template, method, "responses", str(status), "content", "application/json", "schema")

    def check(self, resp: httpx.Response, status: int | None = None) -> Any:
        """Assert the status (if given), validate the JSON body against the spec, return it."""
        if status is not None:
            assert resp.status_code == status, f"{resp.request.method} {resp.request.url}: {resp.text[:500]}"
        body = resp.json()
        ref = self.schema_ref(resp.request.method.lower(), resp.request.url.path, resp.status_code)
        try:
            self.validate(body, ref)
        except jsonschema.ValidationError as exc:
            pytest.fail(f"{resp.request.method} {resp.request.url.path} {resp.status_code}: body does not match "
                        f"the spec: {exc.message}\nbody: {resp.text[:1000]}")  # fmt: skip
        return body

    def error(self, resp: httpx.Response, code: str, status: int | None = None) -> dict[str, Any]:
        """The error contract: exactly {"error": {code, message, retryable, cause}}, typed, no internals."""
        body = self.check(resp)
        assert set(body) == {"error"}, body
        err = body["error"]
        assert set(err) == {"code", "message", "retryable", "cause"}, body
        assert err["code"] in CODES, body
        assert err["cause"] in CAUSES, body
        assert err["code"] == code, f"{resp.request.method} {resp.request.url}: expected {code}, got {body}"
        cls = WIRE_CODES[code]
        assert resp.status_code == (status or cls.http_status), body
        assert err["retryable"] is cls.retryable, body
        assert isinstance(err["message"], str) and err["message"].strip(), body
        assert not LEAKY.search(err["message"]), f"internals leak into the message: {err['message']!r}"
        return dict(err)


@pytest.fixture(scope="module")
def contract(spec: dict[str, Any]) -> Contract:
    return Contract(spec)


def test_checked_in_spec_matches_the_code() -> None:
    generated = _generator().render()
    assert SPEC_FILE.exists(), "docs/openapi.json is missing: run `python scripts/gen_openapi.py`"
    assert SPEC_FILE.read_text() == generated, (
        "docs/openapi.json is stale (the API changed): run `python scripts/gen_openapi.py` and commit the result"
    )


def test_spec_is_a_valid_openapi_3_document(spec: dict[str, Any]) -> None:
    validate_openapi(spec)
    assert spec["openapi"].startswith("3.")
    # Every component schema is itself a valid JSON Schema (2020-12, as OpenAPI 3.1 uses).
    for name, schema in spec["components"]["schemas"].items():
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            pytest.fail(f"components/schemas/{name}: {exc.message}")


def test_spec_covers_the_api(spec: dict[str, Any]) -> None:
    ops = {(m.upper(), p) for p, item in spec["paths"].items() for m in item}
    for op in [("GET", "/v1/health"), ("POST", "/v1/sandboxes"), ("GET", "/v1/sandboxes"),
               ("GET", "/v1/sandboxes/{sandbox_id}"), ("DELETE", "/v1/sandboxes/{sandbox_id}"),
               ("POST", "/v1/sandboxes/{sandbox_id}/exec"), ("GET", "/v1/sandboxes/{sandbox_id}/events"),
               ("GET", "/v1/sandboxes/{sandbox_id}/files/stat"), ("GET", "/v1/sandboxes/{sandbox_id}/files/list"),
               ("POST", "/v1/sandboxes/{sandbox_id}/sessions"), ("GET", "/v1/images")]:  # fmt: skip
        assert op in ops
    # The error body is the closed set of codes, nothing more.
    body = spec["components"]["schemas"]["ErrorBody"]
    assert set(body["properties"]["code"]["enum"]) == CODES
    assert body["additionalProperties"] is False
    assert set(body["required"]) == {"code", "message", "retryable", "cause"}


def test_spec_documents_only_the_real_error_body(spec: dict[str, Any]) -> None:
    wrong = [f"{m.upper()} {p} {status}" for p, item in spec["paths"].items() for m, op in item.items()
             for status, r in op["responses"].items()
             if int(status) >= 400 and r.get("content", {}).get("application/json", {}).get("schema")
             != {"$ref": "#/components/schemas/ErrorResponse"}]  # fmt: skip
    assert not wrong, f"error responses not documented as ErrorResponse: {wrong[:5]} ..."


def test_spec_admits_the_size_strings_the_api_accepts(contract: Contract) -> None:
    contract.validate({"image": "busybox", "resources": {"memory": "512MiB", "disk": "64MiB"}},
                      "#/components/schemas/SandboxSpec")  # fmt: skip


# -- raw access -------------------------------------------------------------------------------------


@contextlib.contextmanager
def raw(d: Daemon) -> Iterator[httpx.Client]:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(d.socket)), base_url="http://sandfleet",
                      timeout=120) as c:  # fmt: skip
        yield c


@pytest.fixture(scope="module")
def http(daemon: Daemon) -> Iterator[httpx.Client]:
    with raw(daemon) as c:
        yield c


@pytest.fixture(scope="module")
def target(daemon: Daemon) -> Iterator[Sandbox]:
    """One busybox sandbox the bad requests aim at."""
    with daemon.client() as c, c.create(image="busybox", idle_ttl=600, labels={"suite": "api"}) as sb:
        yield sb


def _running(http: httpx.Client) -> set[str]:
    r = http.get("/v1/sandboxes", params={"state": "running"})
    assert r.status_code == 200, r.text
    return {s["id"] for s in r.json()["sandboxes"]}


def _all_ids(http: httpx.Client) -> set[str]:
    r = http.get("/v1/sandboxes")
    assert r.status_code == 200, r.text
    return {s["id"] for s in r.json()["sandboxes"]}


def _mount_points(d: Daemon) -> list[str]:
    return [line.split()[4].replace("\\040", " ") for line in d.mountinfo().splitlines()]


def _cgroup_children(d: Daemon) -> set[str]:
    parent = f"sandfleet-test-{d.root.name}"
    return {Path(p).name for p in glob.glob(f"/sys/fs/cgroup/*/{parent}/*") if os.path.isdir(p)}


def assert_no_leftovers(d: Daemon, live: set[str]) -> None:
    """Nothing on the node belongs to a sandbox that is not running: dirs, mounts, cgroups, runtime state."""
    sdir = d.run_dir / "sandboxes"
    dirs = {p.name for p in sdir.iterdir()} if sdir.exists() else set()
    assert dirs <= live, f"leftover sandbox dirs: {sorted(dirs - live)}"
    prefix = str(sdir) + "/"
    owners = {m[len(prefix) :].split("/")[0] for m in _mount_points(d) if m.startswith(prefix)}
    assert owners <= live, f"leftover mounts of sandboxes {sorted(owners - live)}"
    cgroups = _cgroup_children(d)
    assert cgroups <= live, f"leftover cgroups: {sorted(cgroups - live)}"
    crun = d.run_dir / "crun"
    state = {p.name for p in crun.iterdir()} if crun.exists() else set()
    assert state <= live, f"leftover runtime state: {sorted(state - live)}"


# -- live responses against the spec ----------------------------------------------------------------


def test_live_responses_match_the_spec(http: httpx.Client, contract: Contract) -> None:
    health = contract.check(http.get("/v1/health"), 200)
    assert health["status"] == "ok" and "container" in health["backends"]
    built = contract.check(http.post("/v1/images/build", params={"ref": "busybox"}), 200)
    assert (built["name"], built["tag"]) == ("busybox", "latest") and built["layers"]
    images = contract.check(http.get("/v1/images"), 200)["images"]
    assert ("busybox", "latest") in {(i["name"], i["tag"]) for i in images}

    info = contract.check(http.post("/v1/sandboxes", json={
        "image": "busybox", "labels": {"suite": "api-live"}, "env": {"GREETING": "hi"}, "idle_ttl": 120,
        "resources": {"memory": "64MiB", "pids": 64, "disk": "16MiB", "cpu": 0.5},
    }), 201)  # fmt: skip
    sid = info["id"]
    try:
        assert info["state"] == "running" and info["spec"]["resources"]["memory"] == 64 * 1024**2
        contract.check(http.get(f"/v1/sandboxes/{sid}"), 200)
        listed = contract.check(http.get("/v1/sandboxes", params={"label": "suite=api-live"}), 200)
        assert [s["id"] for s in listed["sandboxes"]] == [sid]
        contract.check(http.get("/v1/sandboxes", params={"state": "running"}), 200)

        # exec: success, failure exit, argv, stdin, start failure, truncation, timeout
        r = contract.check(http.post(f"/v1/sandboxes/{sid}/exec", json={"command": "echo $GREETING; echo e >&2"}), 200)
        assert (r["exit_code"], r["stdout"], r["stderr"]) == (0, "hi\n", "e\n")
        r = contract.check(http.post(f"/v1/sandboxes/{sid}/exec", json={"command": "exit 3"}), 200)
        assert r["exit_code"] == 3
        r = contract.check(http.post(f"/v1/sandboxes/{sid}/exec", json={"command": ["cat"], "stdin": "in"}), 200)
        assert r["stdout"] == "in"
        r = contract.check(http.post(f"/v1/sandboxes/{sid}/exec", json={"command": ["/no/such/binary"]}), 200)
        assert r["exit_code"] == 127
        r = contract.check(http.post(f"/v1/sandboxes/{sid}/exec",
                                     json={"command": "head -c 5000 /dev/zero", "output_limit": 10}), 200)  # fmt: skip
        assert r["stdout_truncated"] is True and len(r["stdout"]) == 10
        r = contract.check(http.post(f"/v1/sandboxes/{sid}/exec", json={"command": "sleep 30", "timeout": 0.3}), 200)
        assert r["timed_out"] is True
        contract.error(http.post(f"/v1/sandboxes/{sid}/exec", json={"command": "true", "user": "nosuchuser"}),
                       "invalid_argument")  # fmt: skip

        # files
        w = http.put(f"/v1/sandboxes/{sid}/files/content", params={"path": "/tmp/api.txt"}, content=b"payload",
                     headers={"content-type": "application/octet-stream"})  # fmt: skip
        assert contract.check(w, 200)["size"] == 7
        st = contract.check(http.get(f"/v1/sandboxes/{sid}/files/stat", params={"path": "/tmp/api.txt"}), 200)
        assert st["type"] == "file" and st["size"] == 7
        contract.check(http.get(f"/v1/sandboxes/{sid}/files/stat", params={"path": "/bin/sh"}), 200)
        files = contract.check(http.get(f"/v1/sandboxes/{sid}/files/list", params={"path": "/tmp"}), 200)
        assert "api.txt" in {f["name"] for f in files["files"]}
        contract.check(http.post(f"/v1/sandboxes/{sid}/files/mkdir", params={"path": "/tmp/d/e"}), 200)
        rd = http.get(f"/v1/sandboxes/{sid}/files/content", params={"path": "/tmp/api.txt"})
        assert rd.status_code == 200 and rd.content == b"payload"
        contract.check(http.delete(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/d", "recursive": "true"}), 200)
        contract.error(http.get(f"/v1/sandboxes/{sid}/files/stat", params={"path": "/tmp/d"}), "not_found")

        # sessions
        sess = contract.check(http.post(f"/v1/sandboxes/{sid}/sessions"), 201)
        contract.check(http.post(f"/v1/sandboxes/{sid}/sessions", json={"env": {"X": "1"}, "cwd": "/tmp"}), 201)
        listed_s = contract.check(http.get(f"/v1/sandboxes/{sid}/sessions"), 200)
        assert sess["id"] in {s["id"] for s in listed_s["sessions"]}
        run = f"/v1/sandboxes/{sid}/sessions/{sess['id']}/run"
        contract.check(http.post(run, json={"command": "cd /tmp; V=42"}), 200)
        r = contract.check(http.post(run, json={"command": "echo $V $(pwd)"}), 200)
        assert r["stdout"] == "42 /tmp\n"
        contract.check(http.delete(f"/v1/sandboxes/{sid}/sessions/{sess['id']}"), 200)
        contract.error(http.post(run, json={"command": "true"}), "not_found")

        # background processes
        p = contract.check(http.post(f"/v1/sandboxes/{sid}/processes", json={"command": "sleep 60"}), 201)
        contract.check(http.get(f"/v1/sandboxes/{sid}/processes"), 200)
        contract.check(http.get(f"/v1/sandboxes/{sid}/processes/{p['id']}"), 200)
        contract.check(http.delete(f"/v1/sandboxes/{sid}/processes/{p['id']}"), 200)
        done = contract.check(http.get(f"/v1/sandboxes/{sid}/processes/{p['id']}", params={"wait": 30}), 200)
        assert done["running"] is False and done["result"]["signal"] == 9

        # events
        ev = contract.check(http.get(f"/v1/sandboxes/{sid}/events"), 200)
        kinds = [e["kind"] for e in ev["events"]]
        assert kinds[0] == "created" and "exec" in kinds and "session_created" in kinds
        later = contract.check(http.get(f"/v1/sandboxes/{sid}/events", params={"after": ev["events"][0]["seq"]}), 200)
        assert [e["seq"] for e in later["events"]] == [e["seq"] for e in ev["events"][1:]]

        # metrics are text, not JSON
        m = http.get("/metrics")
        assert m.status_code == 200 and "sandfleet_sandboxes_running" in m.text
        # usage added up by state and QoS (no series per sandbox by default), and the admission's view of the node
        for family in ("sandfleet_sandboxes", "sandfleet_sandboxes_memory_bytes", "sandfleet_sandboxes_tasks"):
            assert f'{family}{{qos="latency_sensitive",state="running"}}' in m.text
        assert 'sandfleet_sandboxes_cpu_seconds_total{qos="latency_sensitive"}' in m.text
        assert f'sandbox="{sid}"' not in m.text
        assert "sandfleet_admission_cpu_requests" in m.text and "sandfleet_admission_cpu_load" in m.text

        # snapshots, restore, fork
        snap = contract.check(http.post(f"/v1/sandboxes/{sid}/snapshots"), 201)
        assert contract.check(http.get("/v1/snapshots", params={"sandbox_id": sid}), 200)["snapshots"] == [snap]
        contract.check(http.get(f"/v1/snapshots/{snap['id']}"), 200)
        restored = contract.check(http.post(f"/v1/snapshots/{snap['id']}/restore", json={"count": 1}), 200)
        forked = contract.check(http.post(f"/v1/sandboxes/{sid}/fork", json={"count": 1, "labels": {"k": "v"}}), 200)
        for item in [*restored["results"], *forked["results"]]:
            assert item["error"] is None, item
            contract.check(http.delete(f"/v1/sandboxes/{item['sandbox']['id']}"), 200)
        contract.check(http.delete(f"/v1/snapshots/{snap['id']}"), 200)
        contract.error(http.get(f"/v1/snapshots/{snap['id']}"), "not_found")
        contract.error(http.post(f"/v1/sandboxes/{sid}/fork", json={"count": 0}), "invalid_argument")
        packed = contract.check(http.post(f"/v1/sandboxes/{sid}/pack", json={"image": "api-packed:v1"}), 201)
        assert packed["name"] == "api-packed" and len(packed["layers"]) >= 2
        contract.check(http.delete("/v1/images/api-packed:v1"), 200)
        contract.error(http.delete("/v1/images/api-packed:v1"), "not_found")
        contract.check(http.post("/v1/images/gc", params={"min_age": 3600}), 200)
        contract.error(
            http.post(f"/v1/sandboxes/{sid}/pack", json={"image": "x", "exclude": ["rel"]}), "invalid_argument"
        )
    finally:
        stopped = contract.check(http.request("DELETE", f"/v1/sandboxes/{sid}", json={"reason": "api-test"}), 200)
    assert stopped["state"] == "stopped" and stopped["stop_reason"] == "api-test"
    contract.error(http.get(f"/v1/sandboxes/{sid}"), "not_found")  # stopped_retention = 0
    contract.check(http.post("/v1/sandboxes/stop", json={"labels": {"suite": "api-live"}}), 200)


# -- the error contract -----------------------------------------------------------------------------

# (id, method, path ("{sb}" = a live sandbox), request kwargs, expected wire code)
BAD: list[Any] = [
    ("malformed-json", "POST", "/v1/sandboxes", {"content": b'{"image": "busybox",'}, "invalid_argument"),
    ("json-not-an-object", "POST", "/v1/sandboxes", {"json": ["busybox"]}, "invalid_argument"),
    (
        "wrong-content-type",
        "POST",
        "/v1/sandboxes",
        {"content": b"image=busybox", "headers": {"content-type": "text/plain"}},
        "invalid_argument",
    ),
    ("unknown-field", "POST", "/v1/sandboxes", {"json": {"image": "busybox", "gpus": 8}}, "invalid_argument"),
    ("unknown-nested-field", "POST", "/v1/sandboxes", {"json": {"resources": {"gpu": 1}}}, "invalid_argument"),
    ("memory-1KiB", "POST", "/v1/sandboxes", {"json": {"resources": {"memory": "1KiB"}}}, "invalid_argument"),
    ("memory-negative", "POST", "/v1/sandboxes", {"json": {"resources": {"memory": -1}}}, "invalid_argument"),
    ("memory-garbage", "POST", "/v1/sandboxes", {"json": {"resources": {"memory": "lots"}}}, "invalid_argument"),
    ("disk-1KiB", "POST", "/v1/sandboxes", {"json": {"resources": {"disk": "1KiB"}}}, "invalid_argument"),
    ("cpu-0", "POST", "/v1/sandboxes", {"json": {"resources": {"cpu": 0}}}, "invalid_argument"),
    ("cpu-negative", "POST", "/v1/sandboxes", {"json": {"resources": {"cpu": -2}}}, "invalid_argument"),
    ("cpu-absurd", "POST", "/v1/sandboxes", {"json": {"resources": {"cpu": 100000}}}, "invalid_argument"),
    ("pids-1", "POST", "/v1/sandboxes", {"json": {"resources": {"pids": 1}}}, "invalid_argument"),
    ("pids-absurd", "POST", "/v1/sandboxes", {"json": {"resources": {"pids": 10**9}}}, "invalid_argument"),
    ("memory-beyond-int64", "POST", "/v1/sandboxes", {"json": {"resources": {"memory": 2**64}}}, "invalid_argument"),
    ("disk-absurd", "POST", "/v1/sandboxes", {"json": {"resources": {"disk": 2**70}}}, "invalid_argument"),
    ("idle-ttl-0", "POST", "/v1/sandboxes", {"json": {"idle_ttl": 0}}, "invalid_argument"),
    ("image-upper-case", "POST", "/v1/sandboxes", {"json": {"image": "UPPER CASE"}}, "invalid_argument"),
    ("image-dotdot", "POST", "/v1/sandboxes", {"json": {"image": "a/../b"}}, "invalid_argument"),
    ("image-unknown", "POST", "/v1/sandboxes", {"json": {"image": "no-such-image:v9"}}, "not_found"),
    ("backend-unavailable", "POST", "/v1/sandboxes", {"json": {"backend": "microvm"}}, "invalid_argument"),
    ("env-name-with-equals", "POST", "/v1/sandboxes", {"json": {"env": {"A=B": "1"}}}, "invalid_argument"),
    ("env-name-with-nul", "POST", "/v1/sandboxes", {"json": {"env": {"A\0B": "1"}}}, "invalid_argument"),
    ("env-value-with-nul", "POST", "/v1/sandboxes", {"json": {"env": {"A": "x\0y"}}}, "invalid_argument"),
    ("workdir-relative", "POST", "/v1/sandboxes", {"json": {"workdir": "tmp"}}, "invalid_argument"),
    ("hostname-invalid", "POST", "/v1/sandboxes", {"json": {"hostname": "-bad_host-"}}, "invalid_argument"),
    ("user-invalid", "POST", "/v1/sandboxes", {"json": {"user": "Root User"}}, "invalid_argument"),
    ("user-unknown", "POST", "/v1/sandboxes", {"json": {"user": "nosuchuser"}}, "invalid_argument"),
    ("label-key-invalid", "POST", "/v1/sandboxes", {"json": {"labels": {"": "x"}}}, "invalid_argument"),
    (
        "mount-target-relative",
        "POST",
        "/v1/sandboxes",
        {"json": {"mounts": [{"source": "/tmp", "target": "mnt"}]}},
        "invalid_argument",
    ),
    (
        "mount-outside-allowlist",
        "POST",
        "/v1/sandboxes",
        {"json": {"mounts": [{"source": "/etc", "target": "/mnt"}]}},
        "invalid_argument",
    ),
    ("unknown-sandbox-get", "GET", f"/v1/sandboxes/{NO_SUCH_SANDBOX}", {}, "not_found"),
    ("unknown-sandbox-stop", "DELETE", f"/v1/sandboxes/{NO_SUCH_SANDBOX}", {}, "not_found"),
    (
        "unknown-sandbox-exec",
        "POST",
        f"/v1/sandboxes/{NO_SUCH_SANDBOX}/exec",
        {"json": {"command": "true"}},
        "not_found",
    ),
    ("unknown-sandbox-events", "GET", f"/v1/sandboxes/{NO_SUCH_SANDBOX}/events", {}, "not_found"),
    (
        "unknown-sandbox-files",
        "GET",
        f"/v1/sandboxes/{NO_SUCH_SANDBOX}/files/stat",
        {"params": {"path": "/"}},
        "not_found",
    ),
    ("unknown-route", "GET", "/v1/nope", {}, "not_found"),
    ("unknown-route-root", "GET", "/", {}, "not_found"),
    ("wrong-method", "PATCH", "/v1/sandboxes", {}, "invalid_argument"),
    ("wrong-method-health", "DELETE", "/v1/health", {}, "invalid_argument"),
    ("label-filter-no-equals", "GET", "/v1/sandboxes", {"params": {"label": "suite"}}, "invalid_argument"),
    ("stop-many-no-labels", "POST", "/v1/sandboxes/stop", {"json": {"labels": {}}}, "invalid_argument"),
    ("stop-reason-not-a-string", "DELETE", "/v1/sandboxes/{sb}", {"json": {"reason": 5}}, "invalid_argument"),
    ("events-limit-0", "GET", "/v1/sandboxes/{sb}/events", {"params": {"limit": 0}}, "invalid_argument"),
    ("events-after-absurd", "GET", "/v1/sandboxes/{sb}/events", {"params": {"after": 2**70}}, "invalid_argument"),
    ("exec-empty-string", "POST", "/v1/sandboxes/{sb}/exec", {"json": {"command": ""}}, "invalid_argument"),
    ("exec-empty-argv", "POST", "/v1/sandboxes/{sb}/exec", {"json": {"command": []}}, "invalid_argument"),
    ("exec-nul-in-command", "POST", "/v1/sandboxes/{sb}/exec", {"json": {"command": "echo a\0b"}}, "invalid_argument"),
    ("exec-no-command", "POST", "/v1/sandboxes/{sb}/exec", {"json": {}}, "invalid_argument"),
    (
        "exec-output-limit-too-large",
        "POST",
        "/v1/sandboxes/{sb}/exec",
        {"json": {"command": "true", "output_limit": 2**40}},
        "invalid_argument",
    ),
    (
        "exec-output-limit-negative",
        "POST",
        "/v1/sandboxes/{sb}/exec",
        {"json": {"command": "true", "output_limit": -1}},
        "invalid_argument",
    ),
    (
        "exec-timeout-0",
        "POST",
        "/v1/sandboxes/{sb}/exec",
        {"json": {"command": "true", "timeout": 0}},
        "invalid_argument",
    ),
    (
        "exec-timeout-absurd",
        "POST",
        "/v1/sandboxes/{sb}/exec",
        {"json": {"command": "true", "timeout": 1e9}},
        "invalid_argument",
    ),
    (
        "exec-env-name-with-equals",
        "POST",
        "/v1/sandboxes/{sb}/exec",
        {"json": {"command": "true", "env": {"A=B": "1"}}},
        "invalid_argument",
    ),
    (
        "exec-env-name-with-nul",
        "POST",
        "/v1/sandboxes/{sb}/exec",
        {"json": {"command": "true", "env": {"A\0": "1"}}},
        "invalid_argument",
    ),
    (
        "exec-env-value-with-nul",
        "POST",
        "/v1/sandboxes/{sb}/exec",
        {"json": {"command": "true", "env": {"A": "\0"}}},
        "invalid_argument",
    ),
    (
        "exec-background-on-exec",
        "POST",
        "/v1/sandboxes/{sb}/exec",
        {"json": {"command": "true", "background": True}},
        "invalid_argument",
    ),
    (
        "exec-unknown-field",
        "POST",
        "/v1/sandboxes/{sb}/exec",
        {"json": {"command": "true", "shell": "bash"}},
        "invalid_argument",
    ),
    ("stream-empty-command", "POST", "/v1/sandboxes/{sb}/exec/stream", {"json": {"command": ""}}, "invalid_argument"),
    (
        "session-unknown-field",
        "POST",
        "/v1/sandboxes/{sb}/sessions",
        {"json": {"shell": "/bin/zsh"}},
        "invalid_argument",
    ),
    (
        "session-unknown",
        "POST",
        "/v1/sandboxes/{sb}/sessions/s-000000000000/run",
        {"json": {"command": "true"}},
        "not_found",
    ),
    ("process-unknown", "GET", "/v1/sandboxes/{sb}/processes/p-000000000000", {}, "not_found"),
    (
        "process-bad-signal",
        "DELETE",
        "/v1/sandboxes/{sb}/processes/p-000000000000",
        {"params": {"signal": 0}},
        "invalid_argument",
    ),
    ("files-dotdot", "GET", "/v1/sandboxes/{sb}/files/stat", {"params": {"path": "/../../etc"}}, "invalid_argument"),
    ("files-missing-path", "GET", "/v1/sandboxes/{sb}/files/stat", {}, "invalid_argument"),
    (
        "files-write-bad-mode",
        "PUT",
        "/v1/sandboxes/{sb}/files/content",
        {"params": {"path": "/tmp/x", "mode": 99999}, "content": b"x"},
        "invalid_argument",
    ),
    (
        "files-read-negative-offset",
        "GET",
        "/v1/sandboxes/{sb}/files/content",
        {"params": {"path": "/etc/passwd", "offset": -1}},
        "invalid_argument",
    ),
    (
        "files-read-absurd-offset",
        "GET",
        "/v1/sandboxes/{sb}/files/content",
        {"params": {"path": "/etc/passwd", "offset": 2**70}},
        "invalid_argument",
    ),
    (
        "files-read-missing",
        "GET",
        "/v1/sandboxes/{sb}/files/content",
        {"params": {"path": "/no/such/file"}},
        "not_found",
    ),
    (
        "files-remove-root",
        "DELETE",
        "/v1/sandboxes/{sb}/files",
        {"params": {"path": "/", "recursive": "true"}},
        "invalid_argument",
    ),
    ("image-build-bad-ref", "POST", "/v1/images/build", {"params": {"ref": "UPPER CASE"}}, "invalid_argument"),
    ("image-build-unknown", "POST", "/v1/images/build", {"params": {"ref": "no-such-image"}}, "not_found"),
    ("image-build-no-ref", "POST", "/v1/images/build", {}, "invalid_argument"),
]


def _ids(case: Any) -> str:
    return str(case.values[0] if hasattr(case, "values") else case[0])


@pytest.mark.parametrize(("name", "method", "path", "kwargs", "code"), BAD, ids=[_ids(c) for c in BAD])
def test_bad_request_gets_a_typed_error_and_leaks_nothing(
    daemon: Daemon, http: httpx.Client, contract: Contract, target: Sandbox,
    name: str, method: str, path: str, kwargs: dict[str, Any], code: str,
) -> None:  # fmt: skip
    before = _all_ids(http)
    kw = dict(kwargs)
    if "content" in kw:
        kw.setdefault("headers", {"content-type": "application/json"})
    with raw(daemon) as once:
        resp = once.request(method, path.replace("{sb}", target.id), **kw)
    contract.error(resp, code)
    assert _all_ids(http) == before, f"{name}: the set of sandboxes changed"
    assert target.refresh().state == "running"
    assert_no_leftovers(daemon, _running(http))


def test_no_leftovers_after_all_bad_requests(daemon: Daemon, http: httpx.Client, target: Sandbox) -> None:
    """The same bad requests again, back to back on one connection; then the node is as before."""
    before = _all_ids(http)
    for case in BAD:
        _name, method, path, kwargs, _code = case
        kw = dict(kwargs)
        if "content" in kw:
            kw.setdefault("headers", {"content-type": "application/json"})
        resp = http.request(method, path.replace("{sb}", target.id), **kw)
        assert 400 <= resp.status_code < 500, resp.text
    assert _all_ids(http) == before
    assert target.exec("echo alive").stdout == "alive\n"
    assert_no_leftovers(daemon, _running(http))


# -- failed creates leak nothing ----------------------------------------------------------------------


@pytest.mark.parametrize("resources", [
    pytest.param({"memory": 2**64}, id="memory-beyond-int64-fails-in-crun"),
    pytest.param({"disk": 2**70}, id="disk-absurd-fails-in-tmpfs"),
])  # fmt: skip
def test_create_failing_deep_in_the_backend_leaks_nothing(
    daemon: Daemon, http: httpx.Client, contract: Contract, resources: dict[str, int]
) -> None:
    """Whatever code these get, the half-built sandbox must be gone."""
    before = _all_ids(http)
    resp = http.post("/v1/sandboxes", json={"image": "busybox", "resources": resources})
    assert resp.status_code >= 400, f"accepted {resources}: {resp.text}"
    contract.error(resp, resp.json()["error"]["code"])
    assert _all_ids(http) == before
    assert_no_leftovers(daemon, _running(http))


def test_mount_outside_allowlist_leaks_nothing(daemon: Daemon, http: httpx.Client, contract: Contract,
                                               tmp_path: Path) -> None:  # fmt: skip
    before = _all_ids(http)
    outside = tmp_path / "outside"
    outside.mkdir()
    # A symlink inside the allowlisted dir that points outside it must not get through either.
    link = daemon.root / "shared" / "escape"
    link.symlink_to(outside)
    try:
        for source in (str(outside), str(link), str(daemon.root / "shared" / ".." / "config.toml")):
            err = contract.error(
                http.post("/v1/sandboxes", json={"image": "busybox", "mounts": [{"source": source, "target": "/mnt"}]}),
                "invalid_argument",
            )
            assert source in err["message"]
    finally:
        link.unlink()
    assert _all_ids(http) == before
    assert_no_leftovers(daemon, _running(http))


@contextlib.contextmanager
def own(name: str, extra: str = "", prepare: Callable[[Daemon], None] | None = None) -> Iterator[Daemon]:
    if os.geteuid() != 0:
        pytest.skip("the container tier needs root")
    d = make_daemon(name, extra)
    try:
        if prepare is not None:
            prepare(d)
        d.start()
        yield d
    finally:
        destroy_daemon(d)


def _state_rows(d: Daemon) -> list[tuple[str, str]]:
    with contextlib.closing(sqlite3.connect(d.state_dir / "state.db")) as db:
        return [(str(a), str(b)) for a, b in db.execute("SELECT id, state FROM sandboxes")]


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_image_create_fails_typed_and_leaks_nothing(daemon: Daemon, fleet: Client, contract: Contract,
                                                            damage: str) -> None:  # fmt: skip
    fleet.build_image("busybox")  # the shared store has it; we copy it, never touch it
    manifest_file = IMAGES / "images" / "busybox" / "latest.json"
    manifest = json.loads(manifest_file.read_text())

    def isolated_store(d: Daemon) -> None:
        store = d.root / "images"
        (store / "images" / "busybox").mkdir(parents=True)
        (store / "layers").mkdir()
        shutil.copyfile(manifest_file, store / "images" / "busybox" / "latest.json")
        for layer in manifest["layers"]:
            name = "sha256-" + layer["digest"].removeprefix("sha256:") + ".erofs"
            shutil.copyfile(IMAGES / "layers" / name, store / "layers" / name)
        top = store / "layers" / ("sha256-" + manifest["layers"][-1]["digest"].removeprefix("sha256:") + ".erofs")
        size = top.stat().st_size
        if damage == "truncated":
            os.truncate(top, size // 2)
        else:  # same size, not an EROFS image any more
            top.write_bytes(b"\0" * size)
        text = d.config.read_text().replace(f'image_dir = "{IMAGES}"\n', f'image_dir = "{store}"\n')
        d.config.write_text(text.replace("[container]\n", "build_missing_images = false\n[container]\n", 1))

    with own("corrupt", prepare=isolated_store) as d, raw(d) as http:
        assert [i["name"] for i in contract.check(http.get("/v1/images"), 200)["images"]] == ["busybox"]
        err = contract.error(http.post("/v1/sandboxes", json={"image": "busybox"}), "data_loss")
        assert "corrupt" in err["message"] and manifest["layers"][-1]["digest"] in err["message"], err
        assert contract.check(http.get("/v1/sandboxes"), 200)["sandboxes"] == []
        assert contract.check(http.get("/v1/health"), 200)["sandboxes_running"] == 0
        assert _state_rows(d) == []
        run = str(d.run_dir)
        # (the launcher's shared read-only sysfs and empty tmpfs are one per daemon, not per sandbox)
        shared = f"{run}/shared/"
        sandbox_mounts = [
            m for m in _mount_points(d) if (m == run or m.startswith(run + "/")) and not m.startswith(shared)
        ]
        assert sandbox_mounts == [], f"mounts left under the run dir: {sandbox_mounts}"
        assert list((d.run_dir / "sandboxes").iterdir()) == []
        cg = Path("/sys/fs/cgroup/memory") / f"sandfleet-test-{d.root.name}"
        assert not cg.exists() or [p for p in cg.iterdir() if p.is_dir()] == []
        assert_no_leftovers(d, set())
        # The daemon is fine afterwards: still answers, the same request fails the same way.
        contract.error(http.post("/v1/sandboxes", json={"image": "busybox"}), "data_loss")
        assert _state_rows(d) == []


# -- TCP + bearer token -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


TOKEN = "s3cret-token-for-the-api-test"


@pytest.fixture(scope="module")
def tcp_daemon() -> Iterator[tuple[Daemon, str]]:
    port = _free_port()
    with own("tcp", f'tcp = "127.0.0.1:{port}"\ntoken = "{TOKEN}"\n') as d:
        yield d, f"http://127.0.0.1:{port}"


def test_tcp_requires_the_bearer_token(tcp_daemon: tuple[Daemon, str], contract: Contract) -> None:
    d, url = tcp_daemon
    with httpx.Client(base_url=url, timeout=30) as http:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN},
                        {"authorization": f"Bearer {TOKEN}x"}, {"authorization": f"Basic {TOKEN}"}):  # fmt: skip
            for method, path in (("GET", "/v1/health"), ("GET", "/v1/sandboxes"), ("POST", "/v1/sandboxes"),
                                 ("GET", "/v1/nope")):  # fmt: skip
                resp = http.request(method, path, headers=headers, json={"image": "busybox"})
                contract.error(resp, "unauthenticated", 401)
        assert _running_tcp(http) == set()
        ok = http.get("/v1/health", headers={"authorization": f"Bearer {TOKEN}"})
        assert contract.check(ok, 200)["status"] == "ok"
    # The SDK maps a refused token to UnauthenticatedError.
    with Client(url=url, token="wrong") as bad, pytest.raises(UnauthenticatedError):
        bad.health()
    with Client(url=url) as none, pytest.raises(UnauthenticatedError):
        none.list()


def _running_tcp(http: httpx.Client) -> set[str]:
    r = http.get("/v1/sandboxes", headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200, r.text
    return {s["id"] for s in r.json()["sandboxes"]}


def test_tcp_with_the_right_token_works(tcp_daemon: tuple[Daemon, str]) -> None:
    d, url = tcp_daemon
    with Client(url=url, token=TOKEN) as fleet:
        with fleet.create(image="busybox", idle_ttl=60) as sb:
            r = sb.exec("echo over-tcp; id -u")
            assert (r.exit_code, r.stdout) == (0, "over-tcp\n0\n")
            assert [s.id for s in fleet.list(state="running")] == [sb.id]
        assert sb.info.state == "stopped"
        assert fleet.list(state="running") == []
    assert_no_leftovers(d, set())


def test_unix_socket_is_root_only(tcp_daemon: tuple[Daemon, str], daemon: Daemon) -> None:
    for d in (tcp_daemon[0], daemon):
        st = os.stat(d.socket)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
        assert st.st_uid == 0


def test_sdk_maps_wire_errors_to_the_exception_tree(fleet: Client, target: Sandbox) -> None:
    with pytest.raises(SandboxNotFoundError) as nf:
        fleet.get(NO_SUCH_SANDBOX)
    assert nf.value.code == "not_found" and nf.value.retryable is False and NO_SUCH_SANDBOX in str(nf.value)
    with pytest.raises(SandboxNotFoundError):
        fleet._send(wire.Call("POST", f"/v1/sandboxes/{NO_SUCH_SANDBOX}/exec", json={"command": "true"}))

    with pytest.raises(ImageNotFoundError) as inf:
        fleet.create(image="no-such-image:v9")
    assert inf.value.code == "not_found"
    assert not isinstance(inf.value, SandboxNotFoundError)

    with pytest.raises(InvalidArgumentError, match="allowlist"):
        fleet.create(image="busybox", mounts=[Mount(source="/etc", target="/mnt")])
    with pytest.raises(InvalidArgumentError, match="'..' components"):
        target.files.stat("/etc/../etc/passwd")
    with pytest.raises(InvalidArgumentError, match="nosuchuser"):
        target.exec("true", user="nosuchuser")
    with pytest.raises(InvalidArgumentError, match="key=value"):
        fleet._send(wire.Call("GET", "/v1/sandboxes", params={"label": "nokey"}))  # a filter the SDK can't build
    with pytest.raises(NotFoundError) as missing:
        target.files.read("/no/such/file")
    assert type(missing.value) is NotFoundError

    # A session whose shell exited is in the wrong state; a closed one is gone.
    sess = target.session()
    with pytest.raises(WrongStateError):
        sess.run("exit 3")
    with pytest.raises(WrongStateError) as ws:
        sess.run("echo again")
    assert ws.value.code == "wrong_state" and ws.value.retryable is False
    sess.close()
    closed = target.session()
    assert closed.run("echo ok").stdout == "ok\n"
    closed.close()
    with pytest.raises(NotFoundError) as gone:
        closed.run("echo again")
    assert not isinstance(gone.value, SandboxNotFoundError | ImageNotFoundError)
    # The sandbox itself is untouched by all of the above.
    assert target.exec("echo fine").stdout == "fine\n"


def test_sdk_unreachable_daemon_is_unavailable(tmp_path: Path) -> None:
    # httpcore 1.0.x leaks the AF_UNIX socket of a failed connect (connect_unix_socket never closes it):
    # an upstream bug, not ours. Collect it here, with ResourceWarning ignored, so it can't fail a later test.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        with Client(tmp_path / "no-daemon-here.sock", timeout=5) as c:
            with pytest.raises(UnavailableError) as exc:
                c.health()
            assert exc.value.retryable is True and exc.value.code == "unavailable"
            assert "no-daemon-here.sock" in str(exc.value)
            del exc  # its traceback holds the leaked socket
            with pytest.raises(UnavailableError):
                c.list()
        gc.collect()
    with Client(url=f"http://127.0.0.1:{_free_port()}", token="t", timeout=5) as c, pytest.raises(UnavailableError):
        c.health()


def test_sdk_client_side_validation_is_in_the_tree(fleet: Client, target: Sandbox) -> None:
    with pytest.raises(InvalidArgumentError):
        fleet.create(image="UPPER CASE")
    with pytest.raises(InvalidArgumentError):
        target.exec("")


async def test_unexpected_exception_is_a_wire_error_not_a_dropped_connection() -> None:
    """A bug in a handler answers 500 {code: internal} (a response, so keep-alive survives)."""
    from types import SimpleNamespace

    from sandfleet.daemon.api import create_app
    from sandfleet.daemon.node.metrics import Metrics

    async def broken_get(_sandbox_id: str) -> None:
        raise RuntimeError("boom")

    node = SimpleNamespace(core=SimpleNamespace(get=broken_get))
    app = create_app(node, SimpleNamespace(iam=None), Metrics())  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sandfleet") as client:
        resp = await client.get("/v1/sandboxes/sb-0123")
        assert resp.status_code == 500
        assert resp.json() == {
            "error": {"code": "internal", "message": "internal error: boom", "retryable": False, "cause": "infra"}
        }
        assert (await client.get("/v1/sandboxes/sb-0123")).status_code == 500
