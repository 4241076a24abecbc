"""The console an operator of an RL run watches (issue 31), in a real browser: headless Chromium
(Playwright) against a real daemon on TCP (an admin and a read-only token), with real sandboxes,
commands, trajectories and verifications made with the SDK: the jobs page's figures, a job's page
(failures of each cause, OOM kills, verifications and rewards, stuck sandboxes, actions on a selection
and on the whole job), a trajectory's page (its steps, its verdict), the alerts page and the top bar's
count, and the cluster page through a gateway over two real nodes.

One daemon for the module (`[jobs.alerts] stuck_after = 1`: a sandbox left idle a second is stuck,
which fires the `stuck_sandboxes` alert). Screenshots of each page go to the test's tmp_path (printed).
Skips without root, Playwright or /usr/bin/chromium, as tests/test_console.py does.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from sandfleet import Client, Resources, SandboxError, SandboxSpec, UnavailableError
from sandfleet.cluster.config import GatewayConfig
from sandfleet.cluster.gateway import Gateway, create_gateway_app
from sandfleet.cluster.membership import Registration
from sandfleet.models import ExecAction, ExecRequest
from test_console import ADMIN, IAM_TOML, READ_ONLY, Console, _free_port, browser  # noqa: F401 (a fixture)

from conftest import Daemon, agent_pid, destroy_daemon, make_daemon, wait_until

ALERTS_TOML = "[jobs.alerts]\nstuck_after = 1\n"  # after the top-level lines and [[iam.tokens]]


@pytest.fixture(scope="module")
def run_daemon() -> Iterator[tuple[Daemon, str]]:
    if os.geteuid() != 0:
        pytest.skip("the container tier needs root")
    port = _free_port()
    # The monitor every second: OOM kills and usage are seen within a poll of the page.
    d = make_daemon("console-run", f'tcp = "127.0.0.1:{port}"\nmonitor_interval = 1.0\n' + IAM_TOML + ALERTS_TOML)
    try:
        d.start()
        yield d, f"http://127.0.0.1:{port}"
    finally:
        destroy_daemon(d)


@pytest.fixture
def admin(run_daemon: tuple[Daemon, str]) -> Iterator[Client]:
    with Client(url=run_daemon[1], token=ADMIN, timeout=60) as c:
        yield c


@pytest.fixture
def tab(browser: Any, run_daemon: tuple[Daemon, str], tmp_path: Path) -> Iterator[Console]:  # noqa: F811
    c = Console(browser, run_daemon[1], tmp_path)
    try:
        yield c
    finally:
        c.close()


def _run() -> str:
    return uuid.uuid4().hex[:8]


def _exec(command: str, timeout: float | None = 60) -> ExecAction:
    return ExecAction(exec=ExecRequest(command=command, timeout=timeout))


def _cells(tab: Console, table: str, row: Any) -> dict[str, str]:
    heads = tab.page.locator(f"{table} thead th").all_inner_texts()
    return dict(zip(heads, row.locator("td").all_inner_texts(), strict=True))


def _state(fleet: Client, sandbox_id: str) -> str | None:
    found = [s for s in fleet.list(state="all") if s.id == sandbox_id]
    return found[0].state if found else None


# -- a job: its figures, failures of each cause, stuck sandboxes ------------------------------------


def test_a_jobs_failures_of_each_cause_verdicts_rewards_and_stuck_sandboxes(
    tab: Console, admin: Client, run_daemon: tuple[Daemon, str]
) -> None:
    daemon = run_daemon[0]
    job = f"fail-{_run()}"
    worker = admin.create(image="busybox", labels={"job": job}, resources=Resources(memory="64MiB"), idle_ttl=300)
    idle = admin.create(image="busybox", labels={"job": job}, idle_ttl=300)
    try:
        assert worker.exec("exit 1").exit_code == 1  # cause agent
        timed = worker.exec("sleep 5", timeout=0.5)  # cause timeout
        assert timed.timed_out and timed.cause == "timeout", timed
        # `tail` keeps everything after the last newline: /dev/zero has none, so it holds all 200 MiB.
        oom = worker.exec("head -c 200m /dev/zero | tail", timeout=60)
        assert oom.oom_killed or oom.exit_code == 137, oom
        assert worker.verify("exit 3").cause == "verifier"  # the checks themselves broke
        assert worker.verify("exit 1").cause == "agent"  # the work failed the checks: reward 0
        assert worker.verify("true").passed  # reward 1
        assert wait_until(lambda: any(e.kind == "oom_kill" for e in worker.events()), timeout=15)
        with pytest.raises(SandboxError) as bad_user:  # cause caller: found once its sandbox ran
            admin.create(image="busybox", labels={"job": job}, user="nosuchuser", idle_ttl=300)
        assert bad_user.value.cause == "caller", bad_user.value
        lost = admin.create(image="busybox", labels={"job": job}, idle_ttl=300)
        os.kill(agent_pid(daemon, lost.id), signal.SIGKILL)  # cause infra: the node lost its agent
        assert wait_until(lambda: _state(admin, lost.id) in ("stopped", "failed", None), timeout=15)
        admin.drain(True)  # a create of the job refused: the job's refusal, not its failure
        try:
            with pytest.raises(UnavailableError):
                admin.create(image="busybox", labels={"job": job}, idle_ttl=300, timeout=1)
        finally:
            admin.drain(False)

        # The jobs page: the job label's groups carry their figures, and lead to the job's page.
        tab.sign_in(ADMIN, "#/jobs")
        row = tab.page.locator(f"#jobs-table tr[data-job='{job}']")
        row.wait_for()
        cells = _cells(tab, "#jobs-table", row)
        assert cells["sandboxes"] == "2" and cells["pass rate"] == "33% of 3", cells
        # agent (exit 1, the command the OOM killer ended), timeout, verifier, caller, infra
        assert cells["failures"] == "6", cells
        assert "sandboxes" in cells["job"]  # the second link: the list
        tab.screenshot("jobs-counted")
        row.locator("a.job-link").click()
        tab.page.wait_for_function("() => location.hash.startsWith('#/jobs/')")
        tab.wait_text("#job-title", f"^{job}$")

        # The job's page: failures by cause, the latest of each with what failed, OOM kills.
        tab.page.locator("#failures-table tr[data-cause='verifier']").wait_for()
        for cause in ("agent", "timeout", "verifier", "caller", "infra"):
            assert tab.page.locator(f"#failures-table tr[data-cause='{cause}']").count() == 1, cause
        kinds = set(tab.page.locator("#examples-table tbody tr").evaluate_all("rs => rs.map(r => r.dataset.kind)"))
        assert kinds == {"exec", "verify", "create", "agent"}, kinds
        examples = tab.text("#examples-table")
        assert "sleep 5: timed out" in examples and "exit 1" in examples and "OOM-killed" in examples, examples
        assert tab.text("#job-oom") == "1"
        assert re.fullmatch(r"\d+ \(draining \d+\)", tab.text("#job-refused")), tab.text("#job-refused")
        assert "draining: node" in tab.text("#refusals-table")
        # Verifications by outcome, the pass rate; rewards of the judged ones (passed: 1, agent: 0).
        assert tab.text("#job-pass-rate") == "33%"
        outcomes = tab.page.locator("#verifications-table tbody tr").evaluate_all(
            "rs => rs.map(r => r.dataset.outcome)"
        )
        assert sorted(outcomes) == ["agent", "passed", "verifier"], outcomes
        assert tab.text("#reward-count") == "2" and tab.text("#reward-mean") == "0.5"
        bars = tab.page.locator("#reward-bars .reward-bin").evaluate_all("bs => bs.map(b => +b.dataset.count)")
        assert sum(bars) == 2 and bars[1] == 1 and bars[-2] == 1, bars  # [0, 0.1) and exactly 1
        # Its sandboxes now, their limits; the charts drawn.
        assert "2" in tab.text("#job-now [data-state='running']")
        cores = sum(s.info.spec.resources.cpu for s in (worker, idle))  # their limits, added up
        assert f"of {cores:g} cores (limits)" in tab.text("#job-cpu"), tab.text("#job-cpu")
        tab.page.locator("#chart-failures .uplot").wait_for()
        tab.page.locator("#chart-states .uplot").wait_for()
        # An example links to the sandbox it happened in.
        assert tab.page.locator(f"#examples-table a.sb-link[href='#/sandboxes/{worker.id}']").count() >= 1
        tab.screenshot("job-failures")

        # Stuck: with stuck_after 1 s, the sandbox left alone is listed, and why.
        tab.page.locator("#stuck-after").fill("1")
        tab.page.locator("#stuck-after").press("Enter")
        tab.page.wait_for_function("() => location.hash.includes('stuck_after=1')")
        stuck = tab.page.locator(f"#stuck-table tr[data-id='{idle.id}']")
        stuck.wait_for()
        assert "no request for" in stuck.inner_text()
        assert tab.page.locator(f"#slowest-table tr[data-id='{idle.id}']").count() == 1
        tab.screenshot("job-stuck")
        tab.check()
    finally:
        worker.stop()
        idle.stop()


def test_actions_on_a_selection_and_on_the_whole_job_take_effect(tab: Console, admin: Client) -> None:
    job = f"act-{_run()}"
    made = [admin.create(image="busybox", labels={"job": job}, idle_ttl=300) for _ in range(3)]
    a, b, c = made
    ids = {s.id for s in made}
    try:
        tab.sign_in(ADMIN, f"#/jobs/{job}?stuck_after=1")
        for s in made:
            tab.page.locator(f"#slowest-table tr[data-id='{s.id}']").wait_for()
        assert tab.page.locator("#sel-pause").is_disabled()  # nothing selected
        # A selection of one: paused, then a longer idle TTL; the others untouched.
        tab.page.locator(f"#slowest-table tr[data-id='{a.id}'] input.pick").check()
        tab.wait_text("#sel-count", "^1 selected")
        tab.page.locator("#sel-pause").click()
        assert wait_until(lambda: _state(admin, a.id) == "paused", timeout=30)
        assert {_state(admin, x.id) for x in (b, c)} == {"running"}
        tab.page.locator(f"#slowest-table tr[data-id='{a.id}'] .state-paused").wait_for()
        tab.page.locator("#lifetime-idle").fill("7200")
        tab.page.locator("#sel-extend").click()
        assert wait_until(lambda: admin.get(a.id).info.spec.idle_ttl == 7200, timeout=15)
        assert admin.get(b.id).info.spec.idle_ttl == 300
        # The selection survives the page's redraws: b added, a kept; stopped (a second click confirms).
        tab.page.locator(f"#slowest-table tr[data-id='{b.id}'] input.pick").check()
        tab.wait_text("#sel-count", "^2 selected")
        tab.page.locator(f"#slowest-table tr[data-id='{a.id}'] input.pick").uncheck()
        tab.wait_text("#sel-count", "^1 selected")
        tab.page.locator("#sel-stop").click()
        assert _state(admin, b.id) == "running"  # armed, not yet
        tab.page.locator("#sel-stop").click()
        assert wait_until(lambda: _state(admin, b.id) in (None, "stopped"), timeout=30)
        tab.page.locator(f"#slowest-table tr[data-id='{b.id}']").wait_for(state="detached")
        tab.wait_text("#sel-count", "^none selected")  # b is gone: no longer selected
        # The whole job: resumed, a max lifetime for all, then stopped.
        tab.page.locator("#job-resume").click()
        assert wait_until(lambda: _state(admin, a.id) == "running", timeout=30)
        tab.page.locator("#lifetime-idle").fill("")
        tab.page.locator("#lifetime-max").fill("9999")
        tab.page.locator("#job-extend").click()
        tab.wait_text("#notice", f"^new lifetime: 2 sandboxes of job={job}$")
        assert wait_until(lambda: {admin.get(x.id).info.spec.max_lifetime for x in (a, c)} == {9999}, timeout=15)
        assert admin.get(a.id).info.spec.idle_ttl == 7200  # left as it was
        tab.screenshot("job-actions")
        tab.page.locator("#job-stop").click()
        tab.page.locator("#job-stop").click()
        assert wait_until(lambda: not ids & {s.id for s in admin.list(labels={"job": job})}, timeout=30)
        tab.page.locator("#slowest-table tr[data-id]").first.wait_for(state="detached")
        tab.check()
    finally:
        for s in made:
            s.stop()


def test_a_read_only_token_sees_a_job_and_cannot_act_on_it(tab: Console, admin: Client) -> None:
    job = f"ro-{_run()}"
    with admin.create(image="busybox", labels={"job": job}, idle_ttl=300) as sb:
        tab.sign_in(READ_ONLY, f"#/jobs/{job}?stuck_after=1")
        tab.page.locator(f"#stuck-table tr[data-id='{sb.id}']").wait_for()
        buttons = tab.page.locator("#job-actions button.action")
        assert buttons.count() == 8
        assert all(buttons.evaluate_all("bs => bs.map(b => b.disabled)"))
        tab.page.locator(f"#stuck-table tr[data-id='{sb.id}'] input.pick").check()
        assert tab.page.locator("#sel-stop").is_disabled()  # a selection does not enable them
        tab.check()


# -- a trajectory: its steps and verdict ------------------------------------------------------------


def test_a_trajectory_page_lists_its_steps_and_its_verdict(tab: Console, admin: Client) -> None:
    job = f"traj-{_run()}"
    tid = f"rollout-{_run()}"
    t = admin.trajectory(tid, SandboxSpec(image="busybox", idle_ttl=300), labels={"job": job}, seed=7)
    try:
        first = t.step(_exec("echo hello-from-step; echo warn-on-stderr >&2"), step=0)
        assert first.exec is not None and first.exec.exit_code == 0
        again = t.step(_exec("echo hello-from-step; echo warn-on-stderr >&2"), step=0)  # a restarted trainer
        assert again.replayed
        t.write("/root/answer.txt", "42\n")
        failed = t.step(_exec("echo no-such-thing >&2; exit 1"))
        assert failed.exec is not None and failed.cause == "agent"
        verdict = t.verify("test -f /root/answer.txt && echo checks-ok")
        assert verdict.passed, verdict

        # Listed on its job's page, newest first.
        tab.sign_in(ADMIN, f"#/jobs/{job}")
        row = tab.page.locator(f"#trajectories-table tr[data-id='{tid}']")
        row.wait_for()
        cells = _cells(tab, "#trajectories-table", row)
        assert (cells["state"], cells["steps"], cells["verification"]) == ("open", "3", "passed"), cells
        assert cells["failures"] == "agent 1", cells
        assert "(+1 replayed)" in tab.text("#job-now")
        row.locator("a.traj-link").click()
        tab.wait_text("#traj-id", f"^{tid}$")

        # Its steps in order: what each asked, how it ended.
        steps = tab.page.locator("#steps-table tr.step-row")
        steps.nth(2).wait_for()
        assert steps.count() == 3
        s0 = _cells(tab, "#steps-table", steps.nth(0))
        assert s0["kind"] == "exec" and s0["exit"] == "0" and "$ echo hello-from-step" in s0["action"], s0
        assert "hello-from-step" in s0["result"], s0
        s1 = _cells(tab, "#steps-table", steps.nth(1))
        assert s1["kind"] == "write" and s1["action"] == "/root/answer.txt", s1
        s2 = _cells(tab, "#steps-table", steps.nth(2))
        assert (s2["exit"], s2["cause"]) == ("1", "agent") and "no-such-thing" in s2["result"], s2
        # A click shows a step's whole output.
        steps.nth(0).click()
        detail = tab.page.locator("#steps-table tr.step-detail[data-step='0']")
        detail.wait_for()
        assert "hello-from-step" in detail.locator(".step-stdout").inner_text()
        assert "warn-on-stderr" in detail.locator(".step-stderr").inner_text()
        # Its verdict, what the agent changed, the checks' output; its sandbox.
        assert tab.text("#traj-verdict-badge") == "passed"
        assert tab.page.locator("#changed-table tr[data-path='/root/answer.txt']").count() == 1
        assert "checks-ok" in tab.text("#verify-stdout")
        assert tab.page.locator(f"#traj-sandbox[href='#/sandboxes/{t.sandbox.id}']").count() == 1  # type: ignore[union-attr]
        # The record: collapsed, then the JSON of its actions.
        assert tab.page.locator("#traj-record-json").is_hidden()
        tab.page.locator("#traj-record summary").click()
        tab.wait_text("#traj-record-json", '"actions"')
        assert "echo hello-from-step" in tab.text("#traj-record-json")
        tab.screenshot("trajectory")
        tab.page.locator("a.back").click()
        tab.wait_text("#job-title", f"^{job}$")
        tab.check()
    finally:
        t.delete()


# -- alerts -----------------------------------------------------------------------------------------


def test_a_firing_alert_is_listed_and_counted_in_the_top_bar(tab: Console, admin: Client) -> None:
    job = f"alert-{_run()}"
    with admin.create(image="busybox", labels={"job": job}, idle_ttl=300):
        tab.sign_in(ADMIN, "#/alerts")
        # Idle past the daemon's stuck_after (1 s): stuck_sandboxes fires at the next evaluation (10 s).
        row = tab.page.locator(f"#alerts-table tr[data-name='stuck_sandboxes']:has(.chip[title='job={job}'])")
        row.wait_for(timeout=40_000)
        assert "1 sandboxes stuck" in row.inner_text()
        assert row.locator(".severity-warning").count() == 1
        tab.page.locator("#alerts-count").wait_for(state="visible")
        assert int(tab.text("#alerts-count")) >= 1
        tab.screenshot("alerts")
        row.locator("a.job-link").click()
        tab.wait_text("#job-title", f"^{job}$")
        assert tab.page.locator("#alerts-count").is_visible()  # the count stays, whatever the page
        tab.check()


# -- the cluster, through a gateway -----------------------------------------------------------------

NODE_KEYS = ("e10001", "e10002")
PROJECT = '[[iam.projects]]\npath = "team"\nquota = { sandboxes = 4 }\n'  # the nodes' and the gateway's


class InProcessGateway:
    """The gateway's own code (`Gateway`, its app under uvicorn, its load reads and placement) on an
    event loop of a thread of the test's: the test can give its membership discovery's word that a
    node died, as Ray's watcher does (tests/test_cluster.py runs Ray itself)."""

    def __init__(self, config: GatewayConfig) -> None:
        self.gw = Gateway(config)
        self.gw.membership.apply(Registration(n.key, n.url, n.group, True) for n in config.nodes)
        host, _, port = config.listen.rpartition(":")
        app = create_gateway_app(self.gw)
        self.server = uvicorn.Server(
            uvicorn.Config(app, host=host, port=int(port), log_level="warning", lifespan="off")
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._serve(),), daemon=True)
        self.thread.start()

    async def _serve(self) -> None:
        tasks = [asyncio.create_task(self.gw.membership.run()), asyncio.create_task(self.gw.run_placement_updates())]
        await self.gw.membership.refresh()
        self.gw.refresh_placement()
        try:
            await self.server.serve()
        finally:
            for t in tasks:
                t.cancel()
            await self.gw.acks.close()
            await self.gw.membership.close()

    def discovery_says(self, key: str, url: str, alive: bool) -> None:
        self.loop.call_soon_threadsafe(self.gw.membership.apply, [Registration(key, url, "default", alive)])

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        if not self.thread.is_alive():
            self.loop.close()


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[str, dict[str, Daemon], InProcessGateway]]:
    """Two node daemons and a gateway over them (a fixed node list: no Ray)."""
    if os.geteuid() != 0:
        pytest.skip("node daemons need root")
    daemons: dict[str, Daemon] = {}
    gw = None
    try:
        urls = {}
        for key in NODE_KEYS:
            port = _free_port()
            top = f'tcp = "127.0.0.1:{port}"\ntoken = "{ADMIN}"\nnode_key = "{key}"\n'
            d = daemons[key] = make_daemon(f"console-gw-{key}", top + PROJECT)
            urls[key] = f"http://127.0.0.1:{port}"
            d.start()
        listen = f"127.0.0.1:{_free_port()}"
        config = GatewayConfig.model_validate(
            {
                "listen": listen,
                "node_token": ADMIN,
                "token": ADMIN,
                "load_interval": 0.5,
                "nodes": [{"key": k, "url": u} for k, u in urls.items()],
                "iam": {"projects": [{"path": "team", "quota": {"sandboxes": 4}}]},
            }
        )
        gw = InProcessGateway(config)
        url = f"http://{listen}"

        def alive() -> bool:
            try:
                r = httpx.get(f"{url}/v1/cluster/nodes", headers={"authorization": f"Bearer {ADMIN}"}, timeout=5)
                return {n["key"]: n["status"] for n in r.json()["nodes"]} == dict.fromkeys(NODE_KEYS, "alive")
            except (httpx.HTTPError, ValueError, KeyError):
                return False

        assert wait_until(alive, timeout=60, interval=0.2)
        yield url, daemons, gw
    finally:
        if gw is not None:
            gw.close()
        for d in daemons.values():
            destroy_daemon(d)


def test_the_cluster_page_shows_the_nodes_drains_one_and_sees_one_go(
    browser: Any,  # noqa: F811
    gateway: tuple[str, dict[str, Daemon], InProcessGateway],
    tmp_path: Path,
) -> None:
    url, daemons, gw = gateway
    first, second = NODE_KEYS
    tab = Console(browser, url, tmp_path)
    try:
        with Client(url=url, token=ADMIN, timeout=60) as fleet:
            job = f"spread-{_run()}"
            made = [fleet.create(image="busybox", project="team", labels={"job": job}, idle_ttl=300) for _ in range(2)]
            tab.sign_in(ADMIN, "#/")
            tab.page.locator("#nav-cluster").wait_for(state="visible")  # a gateway answers /v1/cluster/nodes
            tab.page.locator("#nav-cluster").click()
            for key in NODE_KEYS:
                tab.page.locator(f"#nodes-table tr[data-key='{key}'][data-status='alive']").wait_for()

            def rows() -> dict[str, dict[str, str]]:
                return {
                    k: _cells(tab, "#nodes-table", tab.page.locator(f"#nodes-table tr[data-key='{k}']"))
                    for k in NODE_KEYS
                }

            # (the gateway reads loads every 0.5 s, the page every 5 s: the creates show by the next draw)
            assert wait_until(lambda: sum(int(r["load"].split(" / ")[0]) for r in rows().values()) == 2, 15), rows()
            first_rows = rows()
            assert "cached" in first_rows[first]["images"], first_rows  # busybox, at least
            team = tab.page.locator("#cluster-projects-table tr[data-project='team']")
            team.wait_for()
            assert _cells(tab, "#cluster-projects-table", team)["sandboxes"] == "2 of 4", tab.text("#cluster-projects")
            tab.screenshot("cluster")
            # A job's page through the gateway: its sandboxes on both nodes, each with its node.
            tab.go(f"#/jobs/{job}")
            for sb in made:
                tab.page.locator(f"#slowest-table tr[data-id='{sb.id}']").wait_for()
            nodes = tab.page.locator("#slowest-table tbody tr td:nth-child(3)").all_inner_texts()
            assert len(nodes) == 2 and set(nodes) <= set(NODE_KEYS), nodes
            tab.go("#/cluster")
            # Drain the first: the node says so; then undrain it.
            tab.page.locator(f"#nodes-table tr[data-key='{first}'] button.drain").click()
            tab.page.locator(f"#nodes-table tr[data-key='{first}'][data-status='draining']").wait_for()
            with Client(daemons[first].socket) as direct:
                assert direct.node_load().draining
            tab.page.locator(f"#nodes-table tr[data-key='{first}'] button.drain", has_text="Undrain").click()
            tab.page.locator(f"#nodes-table tr[data-key='{first}'][data-status='alive']").wait_for()
            with Client(daemons[first].socket) as direct:
                assert not direct.node_load().draining
            for sb in made:
                sb.stop()
        # The second node's daemon dies: unreachable on the page; then discovery says it is dead: lost,
        # since when, and an alert of its own on the alerts page and in the top bar.
        daemons[second].kill()
        tab.page.locator(f"#nodes-table tr[data-key='{second}'][data-status='unreachable']").wait_for()
        assert "unreachable" in tab.text("#cluster-summary")
        tab.screenshot("cluster-unreachable")
        gw.discovery_says(second, f"http://{second}.invalid", alive=False)
        lost = tab.page.locator(f"#nodes-table tr[data-key='{second}'][data-status='lost']")
        lost.wait_for()
        assert _cells(tab, "#nodes-table", lost)["lost"].startswith("20"), tab.text("#nodes-table")  # a time
        assert "1 lost" in tab.text("#cluster-summary")
        tab.go("#/alerts")
        row = tab.page.locator("#alerts-table tr[data-name='node_lost'][data-severity='critical']")
        row.wait_for()
        assert second in row.inner_text()
        tab.page.locator("#alerts-count:not([hidden])").wait_for()
        tab.screenshot("cluster-lost")
        tab.check()
    finally:
        tab.close()
