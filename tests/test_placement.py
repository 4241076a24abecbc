"""The cluster gateway's placement policy: unit behaviour, and the cluster-scale simulation as a CI check.

The simulation (bench/placement_sim.py) runs the real Placer at full scale (160 nodes, 380K sandboxes,
5,000 creates/s, 8 and 32 gateways with load data up to 5 s old) in simulated time; a few seconds of CPU.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

from sandfleet.cluster.placement import NoCapacity, NodeState, PlacementRequest, Placer

pytestmark = pytest.mark.unit

REQ = PlacementRequest()


def _node(key: str, **kw: object) -> NodeState:
    return NodeState(key, **kw)  # type: ignore[arg-type]


def _placer(nodes: list[NodeState], **kw: object) -> Placer:
    p = Placer(rng=random.Random(7), **kw)  # type: ignore[arg-type]
    p.update(nodes)
    return p


# -- filters ------------------------------------------------------------------------------------------------


def test_filters_alive_draining_tier_labels() -> None:
    nodes = [
        _node("aaaaaa", alive=False),
        _node("bbbbbb", draining=True),
        _node("cccccc", tiers=frozenset({"microvm"})),
        _node("dddddd", labels={"gpu": "a100"}),
        _node("eeeeee", labels={"gpu": "h100", "zone": "x"}),
        _node("ffffff"),
    ]
    p = _placer(nodes)
    assert {p.place(REQ, 0.0) for _ in range(50)} == {"dddddd", "eeeeee", "ffffff"}
    assert {p.place(PlacementRequest(tier="microvm"), 0.0) for _ in range(10)} == {"cccccc"}
    assert {p.place(PlacementRequest(node_labels={"gpu": "h100"}), 0.0) for _ in range(10)} == {"eeeeee"}
    with pytest.raises(NoCapacity, match="tier='vm'"):
        p.place(PlacementRequest(tier="vm"), 0.0)
    with pytest.raises(NoCapacity):
        p.place(PlacementRequest(node_labels={"gpu": "v100"}), 0.0)


def test_update_rebuilds_the_candidates() -> None:
    p = _placer([_node("aaaaaa"), _node("bbbbbb")])
    p.place(REQ, 0.0)
    p.update([_node("aaaaaa", draining=True), _node("bbbbbb")])
    assert {p.place(REQ, 1.0) for _ in range(20)} == {"bbbbbb"}
    assert [n.key for n in p.nodes()] == ["aaaaaa", "bbbbbb"]
    assert p.nodes()[0].draining


def test_estimated_room_and_no_capacity() -> None:
    p = _placer([_node("aaaaaa", sandboxes=10, capacity=10), _node("bbbbbb", sandboxes=8, capacity=10)])
    assert [p.place(REQ, 0.0) for _ in range(2)] == ["bbbbbb", "bbbbbb"]
    with pytest.raises(NoCapacity, match="all 2 nodes .* are full"):
        p.place(REQ, 0.0)


def test_exclude() -> None:
    p = _placer([_node(f"{i:06x}") for i in range(5)])
    assert all(p.place(REQ, 0.0, exclude={"000000", "000001"}) not in {"000000", "000001"} for _ in range(100))
    with pytest.raises(NoCapacity, match="excluded"):
        p.place(REQ, 0.0, exclude=[f"{i:06x}" for i in range(5)])


def test_nearly_full_pool_still_finds_the_free_node() -> None:
    """Sampling misses the one node with room among many full ones; the fallback scan finds it."""
    nodes = [_node(f"{i:06x}", sandboxes=100, capacity=100) for i in range(200)] + [_node("ffffff", capacity=100)]
    p = _placer(nodes)
    assert [p.place(REQ, 0.0) for _ in range(5)] == ["ffffff"] * 5


# -- image preference and spill-over -------------------------------------------------------------------------


def test_prefers_cached_image_then_falls_back() -> None:
    img = "python:3.11"
    nodes = [_node("aaaaaa", images=frozenset({img}), sandboxes=8, capacity=10)] + [
        _node(f"{i:06x}", sandboxes=0, capacity=10) for i in range(4)
    ]
    p = _placer(nodes)
    req = PlacementRequest(image=img)
    assert [p.place(req, 0.0) for _ in range(2)] == ["aaaaaa", "aaaaaa"]  # more loaded, but cached
    assert p.place(req, 0.0) != "aaaaaa"  # full now: any node that passes the filter


def test_spill_over_in_group_order() -> None:
    nodes = [
        _node("aaaaaa", group="on-prem", sandboxes=0, capacity=3),
        _node("bbbbbb", group="burst", sandboxes=0, capacity=100),
        _node("cccccc", group="zz-spot", capacity=1),
        _node("dddddd", group="cloud", capacity=1),
    ]
    p = _placer(nodes, groups=("on-prem", "burst"))
    assert [p.place(REQ, 0.0) for _ in range(3)] == ["aaaaaa"] * 3
    assert p.place(REQ, 0.0) == "bbbbbb"
    # unlisted groups come after the listed ones, in name order
    p = _placer([n for n in nodes if n.key != "bbbbbb"], groups=("on-prem", "burst"))
    assert [p.place(REQ, 0.0) for _ in range(5)] == ["aaaaaa"] * 3 + ["dddddd", "cccccc"]


# -- power of two choices and the overlay --------------------------------------------------------------------


def test_power_of_two_never_picks_the_most_loaded() -> None:
    nodes = [_node(f"{i:06x}", sandboxes=100 * i, capacity=10_000) for i in range(10)]
    p = _placer(nodes, overlay_ttl=0.0)  # no overlay: the estimates stay fixed
    got = Counter(p.place(REQ, 0.0) for _ in range(10_000))
    assert got["000009"] == 0
    assert got["000000"] > got["000005"] > got["000008"] > 0
    assert 0.15 < got["000000"] / 10_000 < 0.25  # ~2/n: the emptiest node gets about k x the mean rate


def test_overlay_counts_own_placements_until_newer_load() -> None:
    p = _placer([_node("aaaaaa", sandboxes=0), _node("bbbbbb", sandboxes=5)], overlay_ttl=10.0)
    got = Counter(p.place(REQ, 1.0) for _ in range(15))
    assert got == {"aaaaaa": 10, "bbbbbb": 5}  # 5 to catch up, then alternating
    # a load read before those placements does not count them: the overlay stays
    p.update([_node("aaaaaa", sandboxes=0, seen_at=0.5), _node("bbbbbb", sandboxes=5, seen_at=0.5)])
    assert [p.place(REQ, 2.0) for _ in range(2)] == ["aaaaaa", "bbbbbb"]  # 0 + 10 vs 5 + 5, not 0 vs 5
    # a load read after them replaces them
    p.update([_node("aaaaaa", sandboxes=3, seen_at=3.0), _node("bbbbbb", sandboxes=9, seen_at=3.0)])
    assert [p.place(REQ, 3.0) for _ in range(6)] == ["aaaaaa"] * 6


def test_overlay_expires_after_ttl() -> None:
    p = _placer([_node("aaaaaa", sandboxes=0), _node("bbbbbb", sandboxes=3)], overlay_ttl=5.0)
    assert [p.place(REQ, 0.0) for _ in range(4)] == ["aaaaaa"] * 4
    assert p.place(REQ, 1.0) == "bbbbbb"  # aaaaaa is at 4 now
    assert p.place(REQ, 5.5) == "aaaaaa"  # the placements at t=0 expired: aaaaaa back to 0


def test_release_takes_a_placement_back_and_full_stops_sending() -> None:
    p = _placer([_node("aaaaaa", sandboxes=0), _node("bbbbbb", sandboxes=1)])
    assert p.place(REQ, 0.0) == "aaaaaa"
    p.release("aaaaaa")
    assert p.place(REQ, 0.0) == "aaaaaa"  # back at 0 (not 1 vs 1)
    p.release("aaaaaa", full=True)
    assert {p.place(REQ, 0.0) for _ in range(10)} == {"bbbbbb"}
    p.release("unknown")  # a node gone from the snapshot: nothing to do
    p.update([_node("aaaaaa", sandboxes=0, seen_at=1.0), _node("bbbbbb", sandboxes=11, seen_at=1.0)])
    assert p.place(REQ, 1.0) == "aaaaaa"  # newer load: no longer full


# -- batches -------------------------------------------------------------------------------------------------


def test_place_many_spreads_a_batch() -> None:
    p = _placer([_node(f"{i:06x}", capacity=2600) for i in range(160)])
    got = Counter(p.place_many(REQ, 1000, 0.0))
    assert sum(got.values()) == 1000
    assert max(got.values()) <= 10  # mean 6.25; a batch never lands on one node
    # the batch is in the overlay: the next batch evens it out
    got2 = Counter(p.place_many(REQ, 1000, 0.0))
    total = got + got2
    assert max(total.values()) - min(total[f"{i:06x}"] for i in range(160)) <= 4


def test_place_many_fills_the_emptier_nodes_first() -> None:
    p = _placer(
        [_node("aaaaaa", sandboxes=90), _node("bbbbbb", sandboxes=0)]
        + [_node(f"{i:06x}", sandboxes=90) for i in range(8)],
        overlay_ttl=60,
    )
    got = Counter(p.place_many(REQ, 100, 0.0))
    assert got["bbbbbb"] > max(v for k, v in got.items() if k != "bbbbbb")


def test_place_many_spills_over_and_is_all_or_nothing() -> None:
    nodes = [_node("aaaaaa", group="a", capacity=5), _node("bbbbbb", group="b", capacity=5)]
    p = _placer(nodes, groups=("a", "b"))
    assert Counter(p.place_many(REQ, 7, 0.0)) == {"aaaaaa": 5, "bbbbbb": 2}
    with pytest.raises(NoCapacity, match="only 3 of 4 fit"):
        p.place_many(REQ, 4, 0.0)
    assert p.place_many(REQ, 3, 0.0) == ["bbbbbb"] * 3  # the failed batch was taken back
    p = _placer(nodes, groups=("a", "b"))
    assert len(p.place_many(REQ, 20, 0.0, partial=True)) == 10
    assert p.place_many(REQ, 0, 0.0) == []
    p = _placer(nodes, groups=("a", "b"))
    assert set(p.place_many(REQ, 4, 0.0, exclude={"aaaaaa"})) == {"bbbbbb"}


# -- the cluster-scale simulation ----------------------------------------------------------------------------


def _sim() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "bench" / "placement_sim.py"
    spec = importlib.util.spec_from_file_location("placement_sim", path)
    assert spec is not None and spec.loader is not None
    mod = sys.modules.get("placement_sim")
    if mod is None:
        mod = importlib.util.module_from_spec(spec)
        sys.modules["placement_sim"] = mod
        spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    ("kind", "gateways", "staleness"), [("fill", 8, 1.0), ("steady", 8, 1.0), ("steady", 32, 5.0), ("fill", 32, 5.0)]
)
def test_simulation_ours_balances_without_herding(kind: str, gateways: int, staleness: float) -> None:
    sim = _sim()
    sc = sim.Scenario(f"{kind}, {gateways} gw, {staleness:g} s", kind, gateways, staleness)
    assert (sc.nodes, sc.sandboxes, sc.rate) == (160, 380_000, 5000)
    r = sim.simulate(sc, sim.OURS)
    assert r.creates == (sc.sandboxes if kind == "fill" else sc.rate * sc.duration)
    assert r.failed == 0
    assert r.max_mean <= 1.05, r
    assert r.peak_offered <= 3 * r.mean_rate, r  # mean 5000/160 = 31.25/s: no node offered more than ~94/s


def test_simulation_random_is_worse_than_ours() -> None:
    sim = _sim()
    sc = sim.Scenario("steady, 8 gw, 1 s", "steady", 8, 1.0)
    ours, rnd = sim.simulate(sc, sim.OURS), sim.simulate(sc, "random")
    assert rnd.max_mean > ours.max_mean + 0.02, (rnd, ours)
