"""A gateway's share of project quotas (cluster/quotas.py), without nodes: the shares of all
gateways add up to the headroom exactly, and the last unit is never stranded."""

from __future__ import annotations

import pytest

from sandfleet.cluster.job_figures import Refusals
from sandfleet.cluster.quotas import GatewayQuotas, ShareSpent
from sandfleet.daemon.security.iam import Iam, IamConfig
from sandfleet.errors import ResourceExhaustedError
from sandfleet.models import SandboxSpec

pytestmark = pytest.mark.unit

IAM = IamConfig.model_validate(
    {
        "projects": [
            {"path": "org", "quota": {"sandboxes": 10, "cpu": 8}},
            {"path": "org/job", "quota": {"sandboxes": 6}},
        ]
    }
)
GATEWAYS = ["http://gw-a:8600", "http://gw-b:8600", "http://gw-c:8600"]


class Seen:
    """What a gateway read of the nodes: per-project usage, and the gateways registered."""

    load_interval = 1.0
    nodes: dict[str, object] = {}  # noqa: RUF012 (no node read yet: our own admissions age out by time)

    def __init__(self, usage: dict[str, tuple[int, float, int]]) -> None:
        self.usage = usage
        self.gateways = list(GATEWAYS)

    def project_usage(self) -> dict[str, tuple[int, float, int]]:
        return self.usage


def spec(project: str = "org/job", cpu: float = 1.0) -> SandboxSpec:
    return SandboxSpec(project=project, resources={"cpu": cpu})


@pytest.mark.parametrize("used", [0, 2, 4, 5])
def test_shares_add_up_to_the_headroom_exactly(used: int) -> None:
    seen = Seen({"org/job": (used, float(used), used * 1024**3)})
    gws = [GatewayQuotas(Iam(IAM), seen, me) for me in GATEWAYS]  # type: ignore[arg-type]
    admitted = 0
    for gw in gws:
        while True:
            try:
                gw.admit(spec(), now=0.0)
            except ShareSpent as exc:
                assert exc.owner in GATEWAYS and "org/job" in exc.message
                break
            except ResourceExhaustedError as exc:
                assert "project org/job: quota of 6 sandboxes reached" in exc.message
                break
            admitted += 1
    assert admitted == 6 - used  # never more than the headroom, and none of it stranded


def test_the_last_unit_goes_to_the_projects_first_gateway() -> None:
    seen = Seen({"org/job": (5, 5.0, 0)})
    gws = {me: GatewayQuotas(Iam(IAM), seen, me) for me in GATEWAYS}  # type: ignore[arg-type]
    owner = next(iter(gws.values())).order("org/job")[0]
    for me, gw in gws.items():
        if me != owner:
            with pytest.raises(ShareSpent) as info:
                gw.admit(spec(), now=0.0)
            assert info.value.owner == owner  # where the gateway passes the create on
    gws[owner].admit(spec(), now=0.0)
    with pytest.raises(ResourceExhaustedError, match="quota of 6 sandboxes reached"):
        gws[owner].admit(spec(), now=0.0)


def test_an_ancestors_quota_binds_and_is_named() -> None:
    seen = Seen({"org/other": (3, 7.0, 0)})  # the team's CPU is nearly spent by another job
    gw = GatewayQuotas(Iam(IAM), seen, GATEWAYS[0])  # type: ignore[arg-type]
    gw.membership.gateways = [GATEWAYS[0]]
    gw.admit(spec(cpu=1.0), now=0.0)
    with pytest.raises(ResourceExhaustedError, match="project org: quota of 8 cpu reached"):
        gw.admit(spec(cpu=1.0), now=0.0)


def test_own_admissions_age_out_once_the_nodes_count_them() -> None:
    seen = Seen({})
    gw = GatewayQuotas(Iam(IAM), seen, GATEWAYS[0])  # type: ignore[arg-type]
    gw.membership.gateways = [GATEWAYS[0]]
    for _ in range(6):
        gw.admit(spec(), now=0.0)
    with pytest.raises(ResourceExhaustedError):
        gw.admit(spec(), now=0.5)
    seen.usage = {"org/job": (6, 6.0, 0)}  # the next read counts them; ours have aged out
    with pytest.raises(ResourceExhaustedError):
        gw.admit(spec(), now=10.0)
    seen.usage = {"org/job": (4, 4.0, 0)}  # two stopped
    gw.admit(spec(), now=10.0)
    gw.admit(spec(), now=10.0)
    with pytest.raises(ResourceExhaustedError):
        gw.admit(spec(), now=10.0)
    gw.forget(spec())  # a create that made no sandbox gives its share back
    gw.admit(spec(), now=10.0)


def test_a_refusal_is_counted_in_the_job_of_its_spec_for_the_projects_that_see_it() -> None:
    """What the gateway refuses never reaches a node: it keeps it per (project, label, value) and adds
    it to the nodes' figures of that job (GET /v1/jobs/{job} through a gateway)."""
    seen = Seen({"org/job": (6, 6.0, 0)})  # at its quota
    gw = GatewayQuotas(Iam(IAM), seen, GATEWAYS[0])  # type: ignore[arg-type]
    gw.membership.gateways = [GATEWAYS[0]]
    refusals = Refusals()
    gw.refused = refusals.add
    wanted = SandboxSpec(project="org/job", labels={"job": "grpo-1", "team": "a"})
    for _ in range(3):
        with pytest.raises(ResourceExhaustedError):
            gw.admit(wanted, now=0.0)
    nodes = {"key": "job", "value": "grpo-1", "refused": {"capacity": 2}, "refusals": []}
    got = refusals.into(nodes, lambda project: project == "org/job")
    assert got["refused"] == {"capacity": 2, "quota": 3}
    assert [e["message"][:35] for e in got["refusals"]] == ["quota: project org/job: quota of 6 "]
    assert refusals.into({**nodes, "value": "other"}, lambda _p: True)["refused"] == {"capacity": 2}
    assert refusals.into(nodes, lambda project: project == "org/else")["refused"] == {"capacity": 2}
    assert refusals.into({**nodes, "key": "team", "value": "a"}, lambda _p: True)["refused"]["quota"] == 3
