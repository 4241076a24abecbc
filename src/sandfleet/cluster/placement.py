"""Where a gateway sends a create: filter, prefer cached images, spill over node groups, power-of-k choice.

Gateways are stateless and many; each holds a load snapshot that is seconds old (refreshed from the watcher).
Least-loaded on such data herds: every gateway sends everything to the same "emptiest" node until the next
refresh. Power-of-k (sample k nodes, take the less loaded) keeps the balance of least-loaded while giving the
emptiest node at most ~k times the mean create rate. On top, each gateway counts its own placements since the
node's load was read (the overlay), so one gateway's burst is not blind to itself; the new load replaces them.

The node agent makes the final admission decision; a refused create is `release()`d and retried elsewhere.
Pure: no I/O, no clock (the caller passes `now`, monotonic seconds), the standard library and sandfleet.errors only.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from sandfleet.errors import ResourceExhaustedError

__all__ = ["NoCapacity", "NodeState", "PlacementRequest", "Placer"]


class NoCapacity(ResourceExhaustedError):
    """No node can take the request (none matches, or all that match are full/excluded); the message says why."""


@dataclass(frozen=True)
class NodeState:
    """One node as the watcher last saw it."""

    key: str  # stable node key (6 hex chars), never an IP or Ray node id
    group: str = "default"  # node group for spill-over ("on-prem", "burst", ...)
    alive: bool = True
    draining: bool = False
    tiers: frozenset[str] = frozenset({"container"})
    images: frozenset[str] = frozenset()  # image refs the node has cached
    labels: Mapping[str, str] = field(default_factory=dict)  # node labels
    sandboxes: int = 0  # live sandboxes on the node when the load was read
    capacity: int = 1000  # the node's admission limit (max sandboxes)
    seen_at: float = 0.0  # when `sandboxes` was read (monotonic seconds)


@dataclass(frozen=True)
class PlacementRequest:
    """What a create needs from a node."""

    tier: str = "container"
    image: str | None = None
    node_labels: Mapping[str, str] = field(default_factory=dict)  # the node must carry these labels
    project: str | None = None  # not used for placement now; carried for logs


class _Node:
    """A node's snapshot plus this placer's own placements on it since the snapshot (the overlay)."""

    __slots__ = ("state", "capacity", "base", "full", "overlay", "pending")

    def __init__(self, state: NodeState) -> None:
        self.state = state
        self.capacity = state.capacity
        self.base = state.sandboxes
        self.full = False  # the node refused a create since its load was read: no room until the next update
        self.overlay: deque[list[float]] = deque()  # [placed_at, count], oldest first
        self.pending = 0  # sum of the overlay's counts

    def load(self, now: float, ttl: float) -> int:
        """Estimated sandboxes now: the snapshot plus our unexpired placements made after it."""
        ov = self.overlay
        if ov:
            cutoff = now - ttl
            while ov and ov[0][0] <= cutoff:
                self.pending -= int(ov.popleft()[1])
        return self.base + self.pending

    def record(self, now: float, n: int = 1) -> None:
        ov = self.overlay
        if ov and ov[-1][0] == now:
            ov[-1][1] += n
        else:
            ov.append([now, n])
        self.pending += n

    def unrecord(self, n: int) -> None:
        """Take back up to `n` of the newest placements (a create that failed there)."""
        ov = self.overlay
        while n > 0 and ov:
            take = min(n, int(ov[-1][1]))
            ov[-1][1] -= take
            self.pending -= take
            n -= take
            if ov[-1][1] <= 0:
                ov.pop()


_CacheKey = tuple[str, str | None, frozenset[tuple[str, str]]]
# Per group, in spill-over order: (nodes with the image cached, all nodes that pass the filter).
_Pools = list[tuple[str, list[_Node], list[_Node]]]


class Placer:
    """One gateway's placement policy over a (stale) load snapshot; see the module docstring.

    `choices` is k of power-of-k (2 balances best under stale data; 3 concentrates more creates on the
    emptiest nodes). `groups` is the spill-over order; groups not listed come after, in name order.
    `overlay_ttl` bounds how long an own placement counts if no newer load arrives for its node
    (0 turns the overlay off).
    """

    def __init__(
        self,
        *,
        choices: int = 2,
        groups: Sequence[str] = ("default",),
        overlay_ttl: float = 10.0,
        rng: random.Random | None = None,
    ) -> None:
        if choices < 1:
            raise ValueError("choices must be >= 1")
        self.choices = choices
        self.groups = tuple(groups)
        self.overlay_ttl = overlay_ttl
        self.placed: Counter[str] = Counter()  # creates placed per node, net of releases
        self._rng = rng if rng is not None else random.Random()
        self._nodes: dict[str, _Node] = {}
        self._pools: dict[_CacheKey, _Pools] = {}  # filtered candidates per request shape; rebuilt after update()

    # -- snapshot ---------------------------------------------------------------------------------------

    def update(self, nodes: Iterable[NodeState]) -> None:
        """Replace the load snapshot. Overlay entries (this placer's own recent placements) made before a
        node's `seen_at` are dropped for that node: the new load already counts them."""
        fresh: dict[str, _Node] = {}
        for st in nodes:
            node = _Node(st)
            old = self._nodes.get(st.key)
            if old is not None:
                for placed_at, n in old.overlay:
                    if placed_at >= st.seen_at:  # placed after the read: the new load does not count it yet
                        node.overlay.append([placed_at, n])
                        node.pending += int(n)
                if st.seen_at < old.state.seen_at:  # an older reading than we had: keep what we learnt
                    node.full = old.full
            fresh[st.key] = node
        self._nodes = fresh
        self._pools.clear()

    def nodes(self) -> list[NodeState]:
        """The current snapshot."""
        return [n.state for n in self._nodes.values()]

    # -- placement --------------------------------------------------------------------------------------

    def place(self, req: PlacementRequest, now: float, exclude: Collection[str] = ()) -> str:
        """Filter (alive, not draining, tier, labels, not excluded, estimated room), prefer nodes with the
        image cached (fall back to all that pass the filter), spill over groups in `groups` order (a group
        is used only if some node in it has room), then power-of-`choices` over estimated load
        (sandboxes + overlay) / capacity; records the placement in the overlay; returns the node key."""
        pools = self._pools_for(req)
        for _group, preferred, every in pools:
            node = self._pick(preferred, now, exclude) if preferred else None
            if node is None and every is not preferred:
                node = self._pick(every, now, exclude)
            if node is not None:
                node.record(now)
                self.placed[node.state.key] += 1
                return node.state.key
        raise NoCapacity(self._why(req, pools, exclude))

    def place_many(
        self, req: PlacementRequest, m: int, now: float, exclude: Collection[str] = (), *, partial: bool = False
    ) -> list[str]:
        """m placements for a batch: sample about 2m candidate nodes once and assign each sandbox to the
        less loaded of two of them, updating estimates as it goes (so a batch of 1000 doesn't land on one node).

        Same filters, image preference and spill-over as `place`. If not all m fit, raises NoCapacity (and
        takes the batch's placements back out of the overlay), or with `partial=True` returns those that fit.
        """
        out: list[str] = []
        if m <= 0:
            return out
        pools = self._pools_for(req)
        ttl = self.overlay_ttl
        rng = self._rng
        k = max(2, self.choices)
        for _group, preferred, every in pools:
            for pool in (preferred, every) if every is not preferred else (every,):
                while len(out) < m:
                    room = [n for n in pool if n.state.key not in exclude and _has_room(n, now, ttl)]
                    if not room:
                        break
                    want = 2 * (m - len(out))
                    cand = room if want >= len(room) else rng.sample(room, want)
                    while cand and len(out) < m:
                        picks = cand if len(cand) <= k else [cand[rng.randrange(len(cand))] for _ in range(k)]
                        best = _least_loaded(picks, now, ttl)
                        if best is None:  # the sampled ones are full: drop them from the candidates
                            cand = [n for n in cand if _has_room(n, now, ttl)]
                            continue
                        best.record(now)
                        self.placed[best.state.key] += 1
                        out.append(best.state.key)
        if len(out) < m and not partial:
            for key in out:
                self.release(key)
            raise NoCapacity(f"only {len(out)} of {m} fit: " + self._why(req, pools, exclude))
        return out

    def release(self, key: str, n: int = 1, *, full: bool = False) -> None:
        """A create placed on `key` failed there (refused/full): take it back out of the overlay.

        With `full=True` (the node answered "full") the node also counts as having no room until the next
        update(), so this placer stops sending there at once instead of after the next refresh.
        """
        node = self._nodes.get(key)
        if node is None:
            return
        node.unrecord(n)
        self.placed[key] = max(0, self.placed[key] - n)
        if full:
            node.full = True

    # -- internals --------------------------------------------------------------------------------------

    def _pools_for(self, req: PlacementRequest) -> _Pools:
        """The filtered candidates for this request shape, built once per snapshot: `place` stays O(choices)."""
        ck: _CacheKey = (req.tier, req.image, frozenset(req.node_labels.items()))
        pools = self._pools.get(ck)
        if pools is None:
            pools = self._pools[ck] = self._build_pools(req)
        return pools

    def _build_pools(self, req: PlacementRequest) -> _Pools:
        by_group: dict[str, list[_Node]] = {}
        want = req.node_labels.items()
        for node in self._nodes.values():
            st = node.state
            if not st.alive or st.draining or req.tier not in st.tiers:
                continue
            if any(st.labels.get(k) != v for k, v in want):
                continue
            by_group.setdefault(st.group, []).append(node)
        rank = {g: i for i, g in enumerate(self.groups)}
        order = sorted(by_group, key=lambda g: (rank.get(g, len(rank)), g))
        pools: _Pools = []
        for g in order:
            every = by_group[g]
            preferred = [n for n in every if req.image in n.state.images] if req.image is not None else []
            pools.append((g, preferred if len(preferred) < len(every) else every, every))
        return pools

    def _pick(self, pool: list[_Node], now: float, exclude: Collection[str]) -> _Node | None:
        """Power-of-k over `pool`: k distinct random nodes that are not excluded and have room, the least loaded.

        Sampling first keeps this O(k); only when the samples find no room (a nearly full pool) does it
        scan the pool, so a group with one free node is still found.
        """
        ttl = self.overlay_ttl
        k = self.choices
        size = len(pool)
        if size <= k:
            return _least_loaded([n for n in pool if n.state.key not in exclude], now, ttl)
        rng = self._rng
        best: _Node | None = None
        best_ratio = 2.0**63
        seen: list[int] = []
        got = 0
        for _ in range(2 * k + 2):
            i = rng.randrange(size)
            if i in seen:
                continue
            seen.append(i)
            node = pool[i]
            ratio = None if node.state.key in exclude else _ratio(node, now, ttl)
            if ratio is None:
                continue
            if ratio < best_ratio:
                best, best_ratio = node, ratio
            got += 1
            if got == k:
                break
        if best is not None:
            return best
        room = [n for n in pool if n.state.key not in exclude and _has_room(n, now, ttl)]
        if not room:
            return None
        return _least_loaded(room if len(room) <= k else rng.sample(room, k), now, ttl)

    def _why(self, req: PlacementRequest, pools: _Pools, exclude: Collection[str]) -> str:
        what = f"tier={req.tier!r}"
        if req.node_labels:
            what += f" labels={dict(req.node_labels)!r}"
        matching = sum(len(every) for _g, _p, every in pools)
        if not matching:
            live = sum(1 for n in self._nodes.values() if n.state.alive and not n.state.draining)
            return f"no alive, non-draining node offers {what} ({live} of {len(self._nodes)} nodes alive and open)"
        excluded = sum(1 for _g, _p, every in pools for n in every if n.state.key in exclude)
        return f"all {matching} nodes for {what} are full" + (f" or excluded ({excluded} excluded)" if excluded else "")


def _ratio(node: _Node, now: float, ttl: float) -> float | None:
    """Estimated load / capacity, or None for a node without room."""
    if node.full:
        return None
    load = node.load(now, ttl)
    return None if load >= node.capacity else load / node.capacity


def _has_room(node: _Node, now: float, ttl: float) -> bool:
    return _ratio(node, now, ttl) is not None


def _least_loaded(nodes: Sequence[_Node], now: float, ttl: float) -> _Node | None:
    """The node with the lowest estimated load / capacity among those with room (None if none has room)."""
    best: _Node | None = None
    best_ratio = 2.0**63
    for node in nodes:
        ratio = _ratio(node, now, ttl)
        if ratio is not None and ratio < best_ratio:
            best, best_ratio = node, ratio
    return best
