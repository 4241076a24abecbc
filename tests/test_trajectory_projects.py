"""Trajectory ids are each project's own: another project's id names one's own trajectory of that
id (or none), never theirs, and answers nothing that tells it is in use. A real daemon with
`[iam]` over TCP; logs written before ids were per project are still replayed after an upgrade."""

from __future__ import annotations

import os
import socket
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandfleet import Client, SandboxSpec
from sandfleet.errors import NotFoundError
from sandfleet.models import ExecAction, ExecRequest

from conftest import Daemon, destroy_daemon, make_daemon

TOKENS = {"a": "team-a-trajectory-secret-01", "b": "team-b-trajectory-secret-02"}
IAM = f"""
[[iam.projects]]
path = "org/team-a"

[[iam.projects]]
path = "org/team-b"

[[iam.tokens]]
name = "a"
token = "{TOKENS["a"]}"
project = "org/team-a"

[[iam.tokens]]
name = "b"
token = "{TOKENS["b"]}"
project = "org/team-b"
"""
SPEC = SandboxSpec(image="busybox", idle_ttl=300)
COUNT = "echo ran >> /ran; wc -l < /ran"  # how many times a step ran in this sandbox


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[Daemon, str]]:
    if os.geteuid() != 0:
        pytest.skip("the container tier needs root")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = make_daemon("trajproj", f'tcp = "127.0.0.1:{port}"\n' + IAM)
    try:
        d.start()
        yield d, f"http://127.0.0.1:{port}"
    finally:
        destroy_daemon(d)


def _client(url: str, name: str) -> Client:
    return Client(url=url, token=TOKENS[name], timeout=60)


def test_a_project_cannot_take_or_probe_another_projects_trajectory_ids(node: tuple[Daemon, str]) -> None:
    d, url = node
    with _client(url, "a") as a, _client(url, "b") as b, d.client() as root:
        tb = b.trajectory("rollout-1", SPEC, seed=1)
        assert tb.sandbox is not None and tb.sandbox.info.spec.project == "org/team-b"
        b_first = tb.exec(COUNT).stdout

        # A asks for B's id: answered word for word as an id nobody uses, by every call.
        step = {"step": 0, "action": ExecAction(exec=ExecRequest(command=COUNT)).model_dump(mode="json")}
        for tid in ("rollout-1", "never-used"):
            with pytest.raises(NotFoundError) as err:
                a.get_trajectory(tid)
            assert str(err.value) == f"trajectory {tid} not found"
            for method, path, body in (
                ("POST", "/steps", step),
                ("GET", "/steps", None),
                ("GET", "/record", None),
                ("POST", "/close", {}),
                ("POST", "/verify", {"command": "true"}),
                ("DELETE", "", None),
            ):
                r = a._http.request(method, f"/v1/trajectories/{tid}{path}", json=body)  # type: ignore[attr-defined]
                hidden = {"code": "not_found", "message": f"trajectory {tid} not found", "retryable": False}
                assert (r.status_code, r.json()["error"]) == (404, {**hidden, "cause": "caller"}), (method, path)
        assert a.trajectories() == []

        # A opens B's id: its own trajectory, in its own sandbox; step 0 runs there (no replay of B's).
        ta = a.trajectory("rollout-1", SPEC, seed=1)
        assert ta.sandbox is not None and ta.sandbox.id != tb.sandbox.id
        assert ta.sandbox.info.spec.project == "org/team-a"
        assert ta.exec(COUNT).stdout == "1\n" and ta.last is not None and not ta.last.replayed
        # Opened again with the same arguments: the same one (its spec's project as placed the first time).
        assert a.trajectory("rollout-1", SPEC, seed=1).sandbox.id == ta.sandbox.id  # type: ignore[union-attr]

        # B's is untouched: its step 0 replays B's answer, its step 1 runs in B's sandbox.
        again = b.trajectory("rollout-1", SPEC, seed=1)
        assert again.sandbox is not None and again.sandbox.id == tb.sandbox.id
        assert again.exec(COUNT).stdout == b_first and again.last is not None and again.last.replayed
        assert again.exec(COUNT).stdout == "2\n"

        # A takes an id first; B then opens it: B's own, not a refusal (nor A's).
        a.trajectory("first-come", SPEC).exec("true")
        tb2 = b.trajectory("first-come", SPEC)
        assert tb2.info.steps == 0 and tb2.sandbox is not None and tb2.sandbox.info.spec.project == "org/team-b"

        # Lists: each project its own; the root (the socket) is a namespace of its own too.
        assert sorted(t.id for t in a.trajectories()) == ["first-come", "rollout-1"]
        assert sorted((t.id, t.steps) for t in b.trajectories()) == [("first-come", 0), ("rollout-1", 2)]
        assert [t.id for t in root.trajectories()] == []
        with pytest.raises(NotFoundError):
            root.get_trajectory("rollout-1")

        # A deletes its own: B's stays.
        ta.delete()
        assert b.get_trajectory("rollout-1").info.steps == 2
        for traj in (a.get_trajectory("first-come"), again, tb2):
            traj.delete()


def _strip_checksums(data: bytes) -> bytes:
    """A log as a daemon before checksums and projects wrote it: JSON lines alone."""
    out = []
    for line in data.splitlines():
        body, crc = line.rsplit(b"\t", 1)
        assert int(crc, 16) == zlib.crc32(body)
        out.append(body + b"\n")
    return b"".join(out)


def test_logs_from_before_projects_are_replayed_after_an_upgrade(node: tuple[Daemon, str]) -> None:
    """A node upgraded in place: its logs, all in one directory and without checksums, go to the
    project their sandbox names (or the root's) and replay; nothing runs again."""
    d, url = node
    logs = d.state_dir / "trajectories"
    with _client(url, "a") as a, d.client() as root:
        ta, tr = a.trajectory("old-a", SPEC), root.trajectory("old-root", SPEC)
        answers = {t.id: t.exec(COUNT).stdout for t in (ta, tr)}
    d.stop()
    for folder, tid in (("org+team-a", "old-a"), ("_", "old-root")):
        (logs / f"{tid}.jsonl").write_bytes(_strip_checksums((logs / folder / f"{tid}.jsonl").read_bytes()))
        (logs / folder / f"{tid}.jsonl").unlink()
    d.start()
    assert sorted(p.relative_to(logs).as_posix() for p in logs.glob("**/old-*")) == [
        "_/old-root.jsonl",
        "org+team-a/old-a.jsonl",
    ]
    with _client(url, "a") as a, _client(url, "b") as b, d.client() as root:
        for client, tid in ((a, "old-a"), (root, "old-root")):
            again = client.trajectory(tid, SPEC)
            assert again.exec(COUNT).stdout == answers[tid] and again.last is not None and again.last.replayed
            assert again.exec(COUNT).stdout == "2\n"  # step 1: new, after step 0's single run
            again.delete()
        with pytest.raises(NotFoundError):
            b.get_trajectory("old-a")
    assert not list(Path(logs).glob("*.jsonl"))
