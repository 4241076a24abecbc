"""Nodes' job figures and alerts added up by a gateway (their JSON as the nodes answer it): counters
add, series add bucket by bucket (every node buckets by the same wall-clock boundaries), examples and
sandboxes are merged newest or oldest first and marked with their node."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

from sandfleet.errors import CAUSES, SandboxError
from sandfleet.models import BRIEF, EXAMPLES, Refusal, SandboxSpec

_ADD = ("created", "stopped", "execs", "steps", "replays", "oom_kills", "cpu", "memory", "cpu_used", "memory_used")
_ADD_DICTS = ("states", "failures", "verifications", "findings", "refused")
_POINT_ADD = ("created", "refused", "stopped", "oom_kills", "verified", "passed", "steps", "replays", "execs")


def merge_groups(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """GET /v1/jobs of every node: groups of one value added up (the figures too, where counted)."""
    groups: dict[str | None, dict[str, Any]] = {}
    for part in parts:
        for job in part["jobs"]:
            into = groups.setdefault(job["value"], {"value": job["value"], "count": 0, "states": collections.Counter()})
            into["count"] += job["count"]
            into["states"].update(job["states"])
            for k in ("failures", "verified", "passed", "steps"):
                if job.get(k) is not None:
                    into[k] = into.get(k, 0) + job[k]
    out = []
    for value in sorted(groups, key=lambda v: (v is None, v or "")):
        g = groups[value]
        out.append({**g, "states": dict(g["states"])})
    return out


def merge_stats(parts: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """GET /v1/jobs/{job} of the nodes that know the job: (node key, answer) each."""
    first = parts[0][1]
    out: dict[str, Any] = {"key": first["key"], "value": first["value"], "bucket": first["bucket"]}
    out["since"] = min(p["since"] for _, p in parts)
    for k in _ADD:
        out[k] = sum(p[k] for _, p in parts)
    for k in _ADD_DICTS:
        c: collections.Counter[str] = collections.Counter()
        for _, p in parts:
            c.update(p.get(k, {}))  # (a node of a version before a figure: none of it)
        out[k] = dict(c)
    verified = sum(out["verifications"].values())
    out["pass_rate"] = out["verifications"].get("passed", 0) / verified if verified else None
    out["rewards"] = _rewards([p["rewards"] for _, p in parts])
    examples = [e for _, p in parts for e in p["examples"]]
    out["examples"] = sorted(examples, key=lambda e: -e["at"])[: EXAMPLES * len(CAUSES)]
    refusals = [e for _, p in parts for e in p.get("refusals", [])]  # (a node before refusals: none)
    out["refusals"] = sorted(refusals, key=lambda e: -e["at"])[:EXAMPLES]
    quotas: dict[str, dict[str, Any]] = {}
    for _, p in parts:  # each node's use of a project's quota: the cluster's is their sum
        for q in p["quotas"]:
            into = quotas.setdefault(q["project"], {**q, "sandboxes": 0, "cpu": 0.0, "memory": 0})
            for k in ("sandboxes", "cpu", "memory"):
                into[k] += q[k]
    out["quotas"] = [quotas[k] for k in sorted(quotas)]
    out["series"] = _series([p["series"] for _, p in parts])
    stuck = [{**s, "node": key} for key, p in parts for s in p["stuck"]]
    out["stuck"] = sorted(stuck, key=lambda s: s["last_active_at"])[:BRIEF]
    slowest = [{**s, "node": key} for key, p in parts for s in p["slowest"]]
    out["slowest"] = sorted(slowest, key=lambda s: s["created_at"])[:BRIEF]
    return out


def _rewards(parts: list[dict[str, Any]]) -> dict[str, Any]:
    count = sum(r["count"] for r in parts)
    total = sum(r["mean"] * r["count"] for r in parts if r["count"])
    mins = [r["min"] for r in parts if r["min"] is not None]
    maxes = [r["max"] for r in parts if r["max"] is not None]
    bins = [dict(b) for b in parts[0]["bins"]]
    for r in parts[1:]:
        for into, b in zip(bins, r["bins"], strict=True):
            into["count"] += b["count"]
    return {
        "count": count,
        "mean": total / count if count else None,
        "min": min(mins) if mins else None,
        "max": max(maxes) if maxes else None,
        "bins": bins,
    }


def _series(parts: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    points: dict[float, dict[str, Any]] = {}
    for series in parts:
        for pt in series:
            into = points.get(pt["t"])
            if into is None:
                points[pt["t"]] = {**pt, "failures": dict(pt["failures"]), "states": dict(pt["states"])}
                continue
            for k in _POINT_ADD:
                into[k] = into.get(k, 0) + pt.get(k, 0)
            for k in ("failures", "states"):
                for name, n in pt[k].items():
                    into[k][name] = into[k].get(name, 0) + n
    return [points[t] for t in sorted(points)]


class Refusals:
    """Creates the gateway itself refused (a project's quota or creates per second, before any node
    was asked), to add to the nodes' figures of their jobs (totals and latest refusals; the series
    are the nodes'). The gateway does not know the nodes' job label: each refusal is kept under every
    label of its spec, (project, label, value). At most `MAX` of those per listed project whose quota
    refused, the least recent forgotten first: a project's own refusals never push another's out."""

    MAX = 1000

    def __init__(self) -> None:
        self._by: dict[str, collections.OrderedDict[tuple[str, str, str], _Counted]] = {}

    def add(self, listed: str, spec: SandboxSpec, why: Refusal, error: SandboxError) -> None:
        now = time.time()
        message = f"{why}: {error.message}"[:300]
        example: dict[str, Any] = {"at": now, "cause": error.cause, "kind": "create", "message": message}
        book = self._by.setdefault(listed, collections.OrderedDict())
        for key, value in spec.labels.items():
            ident = (spec.project or "", key, value)
            counts, examples = book.pop(ident) if ident in book else (collections.Counter(), [])
            counts[why] += 1
            last = examples[0] if examples else None
            if last is None or last["at"] < now - 1 or not last["message"].startswith(why):  # (a burst: one example)
                examples[:] = [example, *examples[: EXAMPLES - 1]]
            book[ident] = (counts, examples)
            while len(book) > self.MAX:
                book.popitem(last=False)

    def into(self, stats: dict[str, Any], sees: Callable[[str], bool]) -> dict[str, Any]:
        """`stats` (a merged job's) with the gateway's refusals of it, of the projects the caller sees."""
        refused = collections.Counter(stats.get("refused", {}))
        refusals = list(stats.get("refusals", []))
        for book in self._by.values():
            for (project, key, value), (counts, examples) in book.items():
                if key == stats["key"] and value == stats["value"] and sees(project):
                    refused.update(counts)
                    refusals.extend(examples)
        return {**stats, "refused": dict(refused), "refusals": sorted(refusals, key=lambda e: -e["at"])[:EXAMPLES]}


_Counted = tuple[collections.Counter[str], list[dict[str, Any]]]  # by why, and the latest examples


def merge_alerts(parts: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """GET /v1/alerts of every node, each alert labelled with its node."""
    return [{**a, "labels": {**a["labels"], "node": key}} for key, p in parts for a in p["alerts"]]
