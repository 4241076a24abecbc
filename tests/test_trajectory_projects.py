"""Trajectory ids are each project's own: another project's id names one's own trajectory of that
id (or none), never theirs, and answers nothing that tells it is in use. A real daemon with
`[iam]` over TCP; logs written before ids were per project are still replayed (and verified) after
an upgrade, by whoever reached them then."""

from __future__ import annotations

import hashlib
import json
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


# What sandfleet before per-default digests hashed for `COUNT` and for `verify("true")`: its models'
# whole JSON (verbatim from that version: no `cpu_time`, `allow`, `queue_timeout`; exit codes [1]).
OLD_COUNT = (
    '{"kind":"exec","exec":{"stdin":null,"stdin_b64":null,"keep_stdin_open":false,"command":"echo ran >> /ran; '
    'wc -l < /ran","env":{},"cwd":null,"user":null,"timeout":60.0,"output_limit":1048576,"merge_stderr":false,'
    '"encoding":"utf-8","background":false,"pty":null}}'
)
OLD_VERIFY = (
    '{"command":"true","layers":[],"protect":[],"cwd":null,"env":{},"timeout":600.0,"resources":null,'
    '"reward_file":null,"agent_exit_codes":[1],"output_limit":262144,"keep":false}'
)


def _as_an_old_daemon_wrote_it(data: bytes) -> bytes:
    """The log of a trajectory whose one step ran `COUNT` and was verified with "true", as the
    daemon before this version wrote it: no checksums, no `verifying` record, the old digests."""

    def old(dumped: str) -> str:
        return hashlib.sha256(dumped.encode()).hexdigest()[:32]

    out = []
    for line in _strip_checksums(data).splitlines():
        rec = json.loads(line)
        if rec["k"] == "begin":
            rec["action"], rec["digest"] = json.loads(OLD_COUNT), old(OLD_COUNT)
        elif rec["k"] == "done":
            rec["digest"] = old(OLD_COUNT)
        elif rec["k"] == "verify":
            rec["digest"] = old(OLD_VERIFY)
        elif rec["k"] == "verifying":
            continue
        out.append(json.dumps(rec, separators=(",", ":")).encode() + b"\n")
    return b"".join(out)


def _upgrade(d: Daemon, logs: Path, moved: dict[str, str], old_digests: bool = False) -> None:
    """Stop the node, put the logs `moved` ({id: its folder}) back as the layout before projects had
    them (one directory, no checksums; `old_digests`: as that daemon hashed), start it again."""
    d.stop()
    for tid, folder in moved.items():
        data = (logs / folder / f"{tid}.jsonl").read_bytes()
        (logs / f"{tid}.jsonl").write_bytes(_as_an_old_daemon_wrote_it(data) if old_digests else _strip_checksums(data))
        (logs / folder / f"{tid}.jsonl").unlink()
    d.start()


def test_steps_and_verdicts_an_older_daemon_logged_replay_after_an_upgrade(node: tuple[Daemon, str]) -> None:
    """Digests logged before this version (of the whole JSON, as its models were) still match the
    same step and the same verification asked again: replayed, not `invalid_argument`."""
    d, url = node
    with _client(url, "a") as a, d.client() as root:
        ta, tr = a.trajectory("old-digests-a", SPEC), root.trajectory("old-digests-root", SPEC)
        answers = {t.id: (t.exec(COUNT).stdout, t.verify("true")) for t in (ta, tr)}
    _upgrade(d, d.state_dir / "trajectories", {"old-digests-a": "org+team-a", "old-digests-root": "_"}, True)
    with _client(url, "a") as a, d.client() as root:
        for client, tid in ((a, "old-digests-a"), (root, "old-digests-root")):
            again = client.trajectory(tid, SPEC)
            assert again.exec(COUNT).stdout == answers[tid][0] and again.last is not None and again.last.replayed
            verdict = again.verify("true")
            assert verdict.replayed and verdict.model_copy(update={"replayed": False}) == answers[tid][1]
            assert again.exec(COUNT).stdout == "2\n"  # step 1: new, after step 0's single run
            again.delete()


def test_a_log_the_root_opened_in_a_project_stays_the_roots_after_an_upgrade(node: tuple[Daemon, str]) -> None:
    """Before ids were per project, the root opened trajectories in any project, and the log does not
    say who opened it: moved to its sandbox's project, it stays reachable by the root (and by that
    project and those above it, as then), never by another project."""
    d, url = node
    in_a = SPEC.model_copy(update={"project": "org/team-a"})
    with d.client() as root:
        traj = root.trajectory("opened-by-root", in_a)
        answer = traj.exec(COUNT).stdout
    _upgrade(d, d.state_dir / "trajectories", {"opened-by-root": "_"})  # the root's today
    assert (d.state_dir / "trajectories" / "org+team-a" / "opened-by-root.jsonl").exists()  # its sandbox's project
    with _client(url, "a") as a, _client(url, "b") as b, d.client() as root:
        assert [t.id for t in root.trajectories() if t.id == "opened-by-root"] == ["opened-by-root"]
        again = root.trajectory("opened-by-root", in_a)  # the trainer that opened it, resumed
        assert again.exec(COUNT).stdout == answer and again.last is not None and again.last.replayed
        assert again.exec(COUNT).stdout == "2\n"
        assert a.get_trajectory("opened-by-root").info.steps == 2  # its sandbox's project: as before
        with pytest.raises(NotFoundError):
            b.get_trajectory("opened-by-root")
        assert not [t for t in b.trajectories() if t.id == "opened-by-root"]
        root.get_trajectory("opened-by-root").delete()
        with pytest.raises(NotFoundError):
            a.get_trajectory("opened-by-root")
        with pytest.raises(NotFoundError):  # the id is free again: the root's own next time
            root.get_trajectory("opened-by-root")
