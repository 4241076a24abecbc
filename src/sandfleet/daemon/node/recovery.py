"""Recovery at daemon start: adopt the sandboxes a previous daemon left running, clean the dead
and half-created ones, and, when the state database was damaged, take back what still runs on the
node from its cgroups and agents. A verification's sandbox is never adopted (unless kept on
request): its verification died with the previous daemon, so nothing would ever stop it."""

from __future__ import annotations

import builtins
import contextlib
import time

from pydantic import ValidationError

from sandfleet.backends.base import Recoverable, TierBackend, part_of
from sandfleet.daemon.net.sandbox_network import Networking
from sandfleet.daemon.node.core import ACTIVITY_FLUSH, NodeCore, lenient_spec, log, store_row
from sandfleet.daemon.node.lifecycle import CREATING, FAILED, HOLDING_STATES, PAUSED, RUNNING, STOPPED, Sandbox
from sandfleet.daemon.node.pausing import Pauser
from sandfleet.daemon.node.snapshots import Snapshots
from sandfleet.daemon.node.standbys import STANDBY_MARK, is_standby
from sandfleet.daemon.node.state import SandboxRow
from sandfleet.errors import SandboxError
from sandfleet.models import KEPT_LABEL, VERIFY_LABEL, SandboxSpec


class Recovery:
    def __init__(self, core: NodeCore, pauser: Pauser, snapshots: Snapshots, networking: Networking) -> None:
        self.core = core
        self.pauser = pauser
        self.snapshots = snapshots
        self.networking = networking

    async def recover(self) -> None:
        """Re-adopt live sandboxes of a previous daemon; clean every half-created or dead one."""
        rows = await self.core.state.all()
        # The live parts of the sandboxes that hold the node (a sandbox's id, or the standby's a
        # rollback promoted): anything else of ours is residue (an old part a killed daemon had not
        # destroyed yet, whatever a stopped sandbox still had).
        known = {part_of(r.id, r.runtime) for r in rows if r.state in HOLDING_STATES}
        now = time.time()
        repause: builtins.list[str] = []
        for row in rows:
            tier = self.core.backends.get(row.backend)
            if tier is None:
                log.error("sandbox %s: its tier %r is not configured on this node; left as it is", row.id, row.backend)
            spec = lenient_spec(row.spec)
            if spec is None:
                # A row this version cannot read must not keep the daemon from starting.
                log.error("sandbox %s: unreadable spec in the state store; removing it", row.id)
                if tier is not None:
                    await tier.cleanup(row.id, row.runtime)
                await self.core.state.delete([row.id])
                continue
            unheard = not row.acked and row.idempotency_key is None
            orphaned = VERIFY_LABEL in spec.labels and KEPT_LABEL not in spec.labels  # its verification is gone
            if row.idempotency_key is not None:  # a retry of its create gets this one, stopped or not
                # In its project's namespace, checked against the request it came with (as before
                # the restart; "" for a row of a version that did not keep it: any request).
                self.core.keys[(spec.project, row.idempotency_key)] = (row.id, row.idempotency_fingerprint or "")
            if tier is not None and row.state in HOLDING_STATES and not unheard and not orphaned:
                # adopt() thaws a paused sandbox first (a frozen agent cannot answer): it comes back
                # running; one paused on request is paused again below, its idle policy may pause
                # the others again.
                live = await tier.adopt(row.id, row.runtime)
                if live is not None:
                    sb = self._recovered(row, spec, RUNNING, now)
                    sb.live = live
                    if not sb.acked:  # a create whose answer was lost: its retry (same key) claims it
                        sb.claim_by = now + self.core.claim_window
                    self.core.admission.commit(spec.resources)
                    live.channel.on_close = lambda _ch, sid=row.id: self.core.on_agent_lost(sid)
                    self.core.table.add(sb)
                    self.core.watch_agent(row.id, live)
                    self.core.journal.record(row.id, "adopted", {"agent_pid": live.agent_pid})
                    try:
                        await self.networking.attach(sb)
                    except OSError as exc:
                        log.warning("sandbox %s: its network policy could not be applied again: %s", row.id, exc)
                    if spec.qos == "best_effort":
                        self.core.best_effort_ids.add(row.id)
                    if row.state == PAUSED and row.held:
                        repause.append(row.id)
                    continue
            if row.state not in (STOPPED, FAILED):  # it was live (or a state this version does not know)
                if tier is not None:
                    await tier.cleanup(row.id, row.runtime)
                sb = self._recovered(row, spec, FAILED if row.state == CREATING else STOPPED, now)
                sb.stop_reason = sb.stop_reason or (
                    "its create was never answered"
                    if unheard
                    else "its verification was lost in a daemon restart"
                    if orphaned
                    else "lost in daemon restart"
                )
                sb.stopped_at = time.time()
                self.core.table.add(sb)  # (first: the journal's taps find it, its job counts the stop)
                self.core.journal.record(row.id, "stopped", {"reason": sb.stop_reason})
                await self.core.forget(sb)
                continue
            self.core.table.add(self._recovered(row, spec, row.state, now))
        orphans = {tier: tier.residue() - known for tier in self.core.backends.values()}
        if self.core.state.reset_from is not None:
            # The database was damaged and set aside: what still runs is taken back from the node.
            for tier, ids in orphans.items():
                ids -= await self._rebuild(tier, ids)
        await self.snapshots.recover()
        # Residue with no row at all (a create whose row had not landed, warm pool members).
        for tier, ids in orphans.items():
            for name in ids:
                await tier.cleanup(name, {})
        for sandbox_id in repause:
            with contextlib.suppress(SandboxError):
                await self.pauser.pause(sandbox_id)
        self.core.metrics.alive.set(self.core.running_count())

    def _recovered(self, row: SandboxRow, spec: SandboxSpec, state: str, now: float) -> Sandbox:
        """The record of a sandbox a previous daemon left in the state store, in `state`."""
        return Sandbox(
            row.id,
            spec,
            state,
            row.created_at,
            # Activity reaches the store every ACTIVITY_FLUSH seconds: the last use before a crash
            # may not have, so the sandbox is given the benefit of the doubt (never reaped early).
            min(now, row.last_active_at + ACTIVITY_FLUSH + self.core.reaper_interval),
            stopped_at=row.stopped_at,
            stop_reason=row.stop_reason,
            idempotency_key=row.idempotency_key,
            acked=bool(row.acked),
        )

    async def _rebuild(self, rebuild: TierBackend, candidates: set[str]) -> set[str]:
        """After the state database was lost: adopt the sandboxes still running on the node (their
        cgroups and agents say what they are), with what can be known of their specs. Returns the
        names taken back (and of those cleaned up)."""
        taken: set[str] = set()
        owners: set[str] = set()  # the sandboxes taken back
        # Rows still readable in the damaged file give back the spec (labels, env, TTLs) of theirs.
        salvaged = {row.id: row for row in getattr(self.core.state, "salvaged", [])}
        lost = "events and exec history; for sandboxes whose row was lost too: labels, env, user, workdir, TTLs"
        if not isinstance(rebuild, Recoverable):
            log.warning("the %s tier cannot take back running sandboxes: they are cleaned up", rebuild.name)
            return taken
        for name in sorted(candidates):  # (a sandbox's id before its parts' names)
            # A standby's name: a checkpoint restored ahead of a rollback (the tier says none, and it
            # is cleaned up) or a sandbox's live part that a rollback promoted.
            sandbox_id = name.split(STANDBY_MARK)[0] if is_standby(name) else name
            if sandbox_id in owners:
                continue
            found = await rebuild.recover(name)
            if found is None:
                continue
            live, resources = found
            spec = SandboxSpec.model_validate(
                {
                    "backend": rebuild.name,
                    "image": None,
                    "layers": [],
                    "resources": resources,
                    "labels": {"sandfleet.recovered": "true"},
                }
            )
            row = salvaged.get(sandbox_id)
            if row is not None:
                with contextlib.suppress(ValidationError):
                    spec = SandboxSpec.model_validate(row.spec)
            if VERIFY_LABEL in spec.labels and KEPT_LABEL not in spec.labels:  # its verification is gone
                live.channel.close()
                await rebuild.cleanup(sandbox_id, live.runtime)
                taken.add(name)  # (gone: not residue)
                continue
            now = time.time()
            sb = Sandbox(sandbox_id, spec, RUNNING, now, now, live=live)
            self.core.table.add(sb)
            await self.core.state.insert(store_row(sb, live.runtime))
            self.core.admission.commit(spec.resources)
            live.channel.on_close = lambda _ch, sid=sandbox_id: self.core.on_agent_lost(sid)
            self.core.watch_agent(sandbox_id, live)
            self.core.journal.record(sandbox_id, "recovered", {"from": str(self.core.state.reset_from), "lost": lost})
            taken.add(name)
            owners.add(sandbox_id)
        log.warning(
            "state database %s was damaged (%s) and set aside: %d running sandboxes were taken back from "
            "the node; lost: %s",
            self.core.state.reset_from,
            self.core.state.reset_reason,
            len(owners),
            lost,
        )
        return taken
