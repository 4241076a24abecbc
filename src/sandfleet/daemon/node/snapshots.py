"""Snapshots of a running sandbox (the tier's own: CRIU checkpoints for containers, QEMU's migration
stream for VMs), restores and forks from them, and pack (a live sandbox's changes as a new image).
A container's snapshot records the paths a restore would recreate checked at snapshot time; a fork
is a temporary snapshot restored `count` times."""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import functools
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError

from sandfleet.backends.base import LiveSandbox, Packable, SharedRestores, Snapshottable, offers, unsupported
from sandfleet.daemon.node.core import NodeCore, log
from sandfleet.daemon.node.creation import Creation
from sandfleet.daemon.node.execs import Execs
from sandfleet.daemon.node.image_service import Images, image_info
from sandfleet.daemon.node.lifecycle import PAUSED, RUNNING, BackgroundProcess, Sandbox, Session, stopped_meanwhile
from sandfleet.daemon.node.pausing import Pauser
from sandfleet.daemon.node.sessions import Sessions
from sandfleet.daemon.node.snapshot_files import (
    SnapshotRecord,
    check_intact,
    image_sizes,
    load_snapshot,
    write_json,
)
from sandfleet.daemon.node.state import StateDiskFullError
from sandfleet.errors import (
    InternalError,
    InvalidArgumentError,
    ResourceExhaustedError,
    SandboxError,
    SnapshotNotFoundError,
    UnavailableError,
    WrongStateError,
)
from sandfleet.ids import new_id
from sandfleet.images import ImageManifest, InvalidRefError, LayerRef, fsutil, parse_ref
from sandfleet.models import ExecRequest, ImageInfo, SandboxInfo, SandboxSpec, SnapshotInfo, shown

MAX_SNAPSHOTS_PER_SANDBOX = 256

PACK_TIMEOUT = 3600.0

SNAPSHOT_IN_PROGRESS = 3600.0  # a snapshot directory without its snapshot.json younger than this is being made

_SNAPSHOT_ID_RE = re.compile(r"^snap-[0-9a-f]{16}$")


T = TypeVar("T")


def inside_path(path: str) -> str:
    """An absolute path inside the sandbox, normalised, as a relative path of its root."""
    if not path.startswith("/") or "\0" in path:
        raise InvalidArgumentError(f"excluded path {path!r} must be absolute")
    norm = os.path.normpath(path).lstrip("/")
    if not norm or norm == "." or norm.split("/")[0] == "..":
        raise InvalidArgumentError(f"excluded path {path!r} must name something below /")
    return norm


def _scrub(root: Path, rel: str) -> None:
    """Drop `rel` from a copied writable layer, never following a symlink the sandbox made."""
    parts = rel.split("/")
    cur = root
    for part in parts[:-1]:
        cur = cur / part
        if cur.is_symlink() or not cur.is_dir():
            return  # nothing of the layer lies below a symlink or a file
    final = cur / parts[-1]
    if final.is_dir() and not final.is_symlink():
        shutil.rmtree(final)
    elif os.path.lexists(final):
        final.unlink()


class Snapshots:
    def __init__(
        self,
        core: NodeCore,
        pauser: Pauser,
        images: Images,
        creation: Creation,
        execs: Execs,
        sessions: Sessions,
        *,
        snapshot_dir: Path | None,
        retention: float | None,
        max_bytes: int | None,
    ) -> None:
        self.core = core
        self.pauser = pauser
        self.images = images
        self.creation = creation
        self.execs = execs
        self.sessions = sessions
        self.snapshot_dir = snapshot_dir
        self.snapshot_retention = retention
        self.snapshot_max_bytes = max_bytes
        self.records: dict[str, SnapshotRecord] = {}
        images.layer_users.append(self._layers)

    def _layers(self) -> set[str]:
        return {str(d) for rec in self.records.values() for d in rec.meta.get("layers", [])}

    async def snapshot(
        self,
        sandbox_id: str,
        *,
        ttl: float | None = None,
        labels: dict[str, str] | None = None,
        temporary: bool = False,
    ) -> SnapshotInfo:
        """Checkpoint a sandbox (a paused one is resumed for it and paused again); it keeps running.
        The snapshot outlives the sandbox: it is kept until deleted or until its ttl (default: the
        node's snapshot_retention) runs out. `temporary`: a fork's, deleted right after."""
        tier = self.core.tier(self.core.sandbox(sandbox_id))
        if not isinstance(tier, Snapshottable) or not offers(tier, "snapshot"):
            raise unsupported(tier, "snapshot or fork a sandbox")
        if self.snapshot_dir is None:
            raise UnavailableError("snapshots are not enabled on this daemon")
        was = self.core.sandbox(sandbox_id)
        was_paused, was_held = was.state == PAUSED, was.held
        if not temporary:
            if len(self._snapshots_of(sandbox_id)) >= MAX_SNAPSHOTS_PER_SANDBOX:
                raise ResourceExhaustedError(
                    f"sandbox {sandbox_id} has {MAX_SNAPSHOTS_PER_SANDBOX} snapshots already: delete one first"
                )
            used = sum(r.info.size_bytes for r in self.records.values() if not r.deleted)
            if self.snapshot_max_bytes is not None and used >= self.snapshot_max_bytes:
                raise ResourceExhaustedError(
                    f"the node's snapshot store holds {used} of {self.snapshot_max_bytes} bytes "
                    "(snapshot_max_bytes): delete snapshots first"
                )
        async with self.pauser.holding(sandbox_id) as (sb, live):
            snapshot_id = new_id("snap", self.core.node_key)
            path = self.snapshot_dir / snapshot_id
            t0 = time.perf_counter()
            try:
                meta = await self.capture(sb, live, path)
                seconds = time.perf_counter() - t0
                size = await asyncio.to_thread(fsutil.disk_usage, path)
                now = time.time()
                keep_for = ttl if ttl is not None else self.snapshot_retention
                info = SnapshotInfo(
                    id=snapshot_id,
                    sandbox_id=sb.id,
                    created_at=now,
                    size_bytes=size,
                    seconds=round(seconds, 4),
                    labels=labels or {},
                    expires_at=None if keep_for is None else now + keep_for,
                    project=sb.spec.project,
                )
                record = {"info": info.model_dump(mode="json"), "spec": sb.spec.model_dump(mode="json"), "meta": meta}
                with stopped_meanwhile(sb, "its snapshot was taken"):
                    await asyncio.to_thread(write_json, path / "snapshot.json", record)
                    if sb.state != RUNNING:  # stopped meanwhile (stop does not wait for the pause lock)
                        raise WrongStateError(f"sandbox {sandbox_id} stopped while its snapshot was taken")
            except BaseException:
                await asyncio.to_thread(shutil.rmtree, path, True)
                raise
            self.records[snapshot_id] = SnapshotRecord(info, path, sb.spec, meta)
            self.core.touch(sb)
            self.core.journal.record(
                sb.id, "snapshot", {"snapshot": snapshot_id, "bytes": size, "seconds": info.seconds}
            )
            self.core.metrics.snapshot_seconds.observe(seconds)
        if was_paused:
            with contextlib.suppress(SandboxError):
                await self.pauser.pause(sandbox_id, by_policy=not was_held)
        return info

    async def capture(self, sb: Sandbox, live: LiveSandbox, path: Path) -> dict[str, Any]:
        """Take the state of `sb` (frozen by the caller's hold) into `path`: its tier's images, and
        the sessions and background processes whatever starts from it keeps (same ids)."""
        terminals = sb.terminals + sum(1 for s in sb.sessions.values() if s.pty and not s.dead)
        if terminals:
            raise WrongStateError(
                f"sandbox {sb.id} has {terminals} command(s) or session(s) on a terminal: close them first"
            )
        tier = self.core.tier(sb)
        if not isinstance(tier, Snapshottable) or not offers(tier, "snapshot"):
            raise unsupported(tier, "snapshot or fork a sandbox")
        inherit = self._inheritance(sb)
        with stopped_meanwhile(sb, "its state was taken"):
            meta = await tier.snapshot(live, path)
            meta["sizes"] = await asyncio.to_thread(image_sizes, path)
        meta["keep_execs"] = [s["exec_id"] for s in inherit["sessions"]]
        meta["keep_execs"] += [p["exec_id"] for p in inherit["processes"]]
        meta["inherit"] = inherit
        return meta

    @staticmethod
    def _inheritance(sb: Sandbox) -> dict[str, builtins.list[dict[str, Any]]]:
        """The sessions and background processes a child of this moment keeps (same ids): their
        processes are in the snapshot, the handles to drive them are these."""
        sessions = [
            {"id": s.id, "exec_id": s.process.id, "pid": s.process.pid, "shell": s.shell, "created_at": s.created_at}
            | {"pty": s.pty, "fds": list(s.fds)}
            for s in sb.sessions.values()
            if not s.dead
        ]
        processes = [
            {
                "id": bp.id,
                "exec_id": bp.process.id,
                "pid": bp.process.pid,
                "command": bp.command,
                "started_at": bp.started_at,
                "encoding": bp.encoding,
                "limit": bp.limit,
                "stdout": base64.b64encode(bytes(bp.stdout)).decode(),
                "stderr": base64.b64encode(bytes(bp.stderr)).decode(),
            }
            for bp in sb.processes.values()
            if not bp.done.is_set()
        ]
        return {"sessions": sessions, "processes": processes}

    def inherit(self, sb: Sandbox, live: LiveSandbox, inherit: dict[str, Any]) -> None:
        """Handles in a restored child for its parent's sessions and background processes."""
        for s in inherit.get("sessions", []):
            proc = live.inherited.get(int(s["exec_id"]))
            if proc is not None:
                session = Session(str(s["id"]), str(s["shell"]), float(s["created_at"]), proc, pty=bool(s.get("pty")))
                if isinstance(fds := s.get("fds"), list) and len(fds) == 2:
                    session.fds = (int(fds[0]), int(fds[1]))
                self.sessions.add(sb, session)
        for p in inherit.get("processes", []):
            proc = live.inherited.get(int(p["exec_id"]))
            if proc is None:
                continue
            bp = BackgroundProcess(
                str(p["id"]), p["command"], float(p["started_at"]), proc, encoding=p["encoding"], limit=int(p["limit"])
            )
            bp.stdout.extend(base64.b64decode(p["stdout"]))
            bp.stderr.extend(base64.b64decode(p["stderr"]))
            sb.processes[bp.id] = bp
            req = ExecRequest(command=bp.command, timeout=None, output_limit=bp.limit, encoding=bp.encoding)
            self.core.spawn(self.execs.collect(sb, bp, req), name=f"bg-{sb.id}-{bp.id}")

    def _snapshot(self, snapshot_id: str) -> SnapshotRecord:
        rec = self.records.get(snapshot_id)
        if rec is None and self.snapshot_dir is not None and _SNAPSHOT_ID_RE.match(snapshot_id):
            # one another node (sharing snapshot_dir) took since this daemon started
            rec = load_snapshot(self.snapshot_dir / snapshot_id, time.time())
            if rec is not None:
                self.records[snapshot_id] = rec
        if rec is None or rec.deleted:
            raise SnapshotNotFoundError(f"snapshot {shown(snapshot_id)} not found")
        return rec

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return self._snapshot(snapshot_id).info

    async def list_snapshots(
        self, sandbox_id: str | None = None, labels: dict[str, str] | None = None
    ) -> builtins.list[SnapshotInfo]:
        return self._snapshots_of(sandbox_id, labels)

    def _snapshots_of(
        self, sandbox_id: str | None = None, labels: dict[str, str] | None = None
    ) -> builtins.list[SnapshotInfo]:
        return [
            r.info
            for r in self.records.values()
            if not r.deleted
            and (sandbox_id is None or r.info.sandbox_id == sandbox_id)
            and all(r.info.labels.get(k) == v for k, v in (labels or {}).items())
        ]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self._drop_snapshot(self._snapshot(snapshot_id))

    async def _drop_snapshot(self, rec: SnapshotRecord) -> None:
        rec.deleted = True
        if rec.restoring == 0 and self.records.pop(rec.info.id, None) is not None:
            await asyncio.to_thread(shutil.rmtree, rec.path, True)
            if isinstance(tier := self.core.backends.get(rec.spec.backend), SharedRestores):
                await tier.unshare(rec.path)

    @staticmethod
    async def _share(tier: SharedRestores, spec: SandboxSpec, rec: SnapshotRecord) -> None:
        """Before a batch: its children share the snapshot's memory where the tier can (best effort:
        each child is restored, and answers, on its own either way)."""
        try:
            await tier.share(spec, rec.path, rec.meta)
        except SandboxError as exc:
            log.warning("the children of snapshot %s will not share its memory: %s", rec.info.id, exc)

    async def expire(self, now: float) -> None:
        for rec in list(self.records.values()):
            if rec.info.expires_at is not None and now > rec.info.expires_at and not rec.deleted:
                log.info("snapshot %s expired", rec.info.id)
                await self._drop_snapshot(rec)

    async def recover(self) -> None:
        """Keep every readable snapshot that has not expired (they outlive their sandboxes)."""
        if self.snapshot_dir is None:
            return
        # Root only: snapshots hold sandboxes' files (owned by their uids) and memory.
        self.snapshot_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.snapshot_dir, 0o700)
        now = time.time()
        for path in await asyncio.to_thread(lambda: sorted(self.snapshot_dir.iterdir()) if self.snapshot_dir else []):
            rec = await asyncio.to_thread(load_snapshot, path, now)
            if rec is not None:
                self.records[rec.info.id] = rec
                continue
            with contextlib.suppress(OSError):
                if not (path / "snapshot.json").exists() and now - path.stat().st_mtime < SNAPSHOT_IN_PROGRESS:
                    continue  # being taken right now (by another node sharing the directory)
            log.warning("snapshot directory %s is unreadable or expired: removing it", path)
            await asyncio.to_thread(shutil.rmtree, path, True)

    async def _batch_key(
        self, project: str | None, key: str, fingerprint: str, count: int
    ) -> builtins.list[SandboxInfo | SandboxError] | None:
        """A fork or restore retried with its idempotency key (of the children's `project`): the
        children the first one made (waiting for it if it still runs); None if the key is new."""
        while True:
            entry = self.core.keys.get((project, key))
            if entry is None:
                # Made before a restart: its children's rows carry their keys `key#i` and the
                # batch's fingerprint (any child that was made tells).
                entry = next(
                    (("batch", e[1]) for i in range(count) if (e := self.core.keys.get((project, f"{key}#{i}")))),
                    None,
                )
                if entry is None:
                    return None
            made, seen = entry
            if seen != fingerprint and seen != "":  # "": kept by a version that did not record it
                raise InvalidArgumentError(f"idempotency key {shown(key)} was used for another request")
            if not isinstance(made, asyncio.Future):
                break
            with contextlib.suppress(Exception):
                await asyncio.shield(made)  # then look again: it made its children, or nothing
        out: builtins.list[SandboxInfo | SandboxError] = []
        for i in range(count):
            child = await self.creation.claimed((project, f"{key}#{i}"), seen)
            out.append(child if child is not None else InternalError("this child was not made (it failed)"))
        return out

    async def _keyed_batch(
        self,
        project: str | None,
        key: str | None,
        fingerprint: str,
        count: int,
        make: Callable[[], Awaitable[builtins.list[Any]]],
    ) -> builtins.list[SandboxInfo | SandboxError]:
        """Run a fork or restore under its idempotency key (of the children's `project`): a
        concurrent or later retry waits for it and gets the same children."""
        if key is None:
            return await make()
        done = await self._batch_key(project, key, fingerprint, count)
        if done is not None:
            return done
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.core.keys[(project, key)] = (fut, fingerprint)
        try:
            results = await make()
        except BaseException:
            self.core.keys.pop((project, key), None)  # it made nothing: a retry runs it again
            fut.set_result("failed")
            raise
        self.core.keys[(project, key)] = ("batch", fingerprint)
        fut.set_result("batch")
        return results

    def _child_spec(self, rec: SnapshotRecord, labels: dict[str, str] | None) -> SandboxSpec:
        """The spec of a restored child: the snapshot's, with the caller's labels added (validated
        together: a parent's labels plus a fork's may not exceed what any spec may carry)."""
        try:
            return SandboxSpec.model_validate(
                {**rec.spec.model_dump(exclude_unset=True), "labels": {**rec.spec.labels, **(labels or {})}}
            )
        except ValidationError as exc:
            errors = "; ".join(str(e["msg"])[:200] for e in exc.errors()[:3])
            raise InvalidArgumentError(f"the children's labels are not valid: {errors}") from exc

    async def restore(
        self,
        snapshot_id: str,
        count: int = 1,
        labels: dict[str, str] | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> builtins.list[SandboxInfo | SandboxError]:
        """`count` new sandboxes from a snapshot, started together; each succeeds or fails on its own.
        Each child keeps the parent's sessions and background processes (same ids)."""
        rec = self._snapshot(snapshot_id)
        if not isinstance(tier := self.core.tier_for(rec.spec.backend), Snapshottable) or not offers(tier, "snapshot"):
            raise unsupported(tier, "restore a snapshot")
        spec = self._child_spec(rec, labels)
        fingerprint = json.dumps(["restore", snapshot_id, count, sorted((labels or {}).items())])
        return await self._keyed_batch(
            spec.project,
            idempotency_key,
            fingerprint,
            count,
            lambda: self._restore(rec, spec, count, idempotency_key, fingerprint),
        )

    async def _restore(
        self, rec: SnapshotRecord, spec: SandboxSpec, count: int, key: str | None, fingerprint: str | None = None
    ) -> builtins.list[SandboxInfo | SandboxError]:
        """`count` children of `rec`; with an idempotency key, child i's is `key#i` (of the spec's
        project), kept with the batch's `fingerprint` in its row (a retry after a restart is checked)."""
        tier = self.core.tier_for(spec.backend)
        if not isinstance(tier, Snapshottable) or not offers(tier, "snapshot"):
            raise unsupported(tier, "restore a snapshot")
        created = {"snapshot": rec.info.id, "source": rec.info.sandbox_id}
        inherit = rec.meta.get("inherit", {})

        async def one(index: int) -> SandboxInfo | SandboxError:
            child_key = None if key is None else f"{key}#{index}"
            try:
                self.creation.check_backend(spec)
                self.creation.admit(spec)
                await asyncio.to_thread(check_intact, rec.path, rec.meta)  # each child answers on its own
                info = await self.creation.start_admitted(
                    spec,
                    lambda sid: tier.restore(sid, spec, rec.path, rec.meta),
                    created,
                    child_key,
                    fingerprint=fingerprint,
                )
                if child_key is not None:
                    self.core.keys[(spec.project, child_key)] = (info.id, fingerprint or "")
                child = self.core.table.find(info.id)
                if child is not None and child.live is not None:
                    self.inherit(child, child.live, inherit)
                return info
            except SandboxError as exc:
                return exc
            except StateDiskFullError as exc:
                return ResourceExhaustedError(f"the node's state disk is full: {exc}"[:300])
            except Exception as exc:  # noqa: BLE001 (one child's failure must not fail its siblings)
                log.exception("restore of %s failed", rec.info.id)
                return InternalError(f"restore failed: {exc}"[:300])

        rec.restoring += 1
        try:
            if count > 1 and isinstance(tier, SharedRestores):
                await self._share(tier, spec, rec)
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(one(i)) for i in range(count)]
        finally:
            rec.restoring -= 1
            if rec.deleted:
                await self._drop_snapshot(rec)
        return [t.result() for t in tasks]

    async def fork(
        self,
        sandbox_id: str,
        count: int = 1,
        labels: dict[str, str] | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> builtins.list[SandboxInfo | SandboxError]:
        """`count` copies of a live (or paused) sandbox: a snapshot, restored `count` times, deleted."""
        fingerprint = json.dumps(["fork", sandbox_id, count, sorted((labels or {}).items())])
        # The children's project is the parent's; a parent gone since (only the root still names it)
        # is known by its fork's keys, whose fingerprint names it.
        parent = self.core.table.find(sandbox_id)
        project = parent.spec.project if parent is not None else self._forked_into(idempotency_key, fingerprint)

        async def make() -> builtins.list[SandboxInfo | SandboxError]:
            snap = await self.snapshot(sandbox_id, temporary=True)
            try:
                rec = self._snapshot(snap.id)
                return await self._restore(rec, self._child_spec(rec, labels), count, idempotency_key, fingerprint)
            finally:
                rec2 = self.records.get(snap.id)
                if rec2 is not None:
                    await self._drop_snapshot(rec2)

        return await self._keyed_batch(project, idempotency_key, fingerprint, count, make)

    def _forked_into(self, key: str | None, fingerprint: str) -> str | None:
        """The project of the children a fork with this key and fingerprint made (None: none found)."""
        if key is not None:
            for (project, name), (_made, seen) in self.core.keys.items():
                if seen == fingerprint and (name == key or name.startswith(key + "#")):
                    return project
        return None

    async def changes_layer(
        self, sandbox_id: str, scrub: builtins.list[str], inspect: Callable[[Path], T]
    ) -> tuple[Sandbox, LayerRef, builtins.list[LayerRef], T]:
        """What the sandbox changed above its layers, as a new layer of the store: (the sandbox, that
        layer, the sandbox's own layers bottom -> top, `inspect(staging)`). `inspect` looks at the copied
        changes (in a thread) before `scrub`'s relative paths are dropped from them."""
        tier = self.core.tier(self.core.sandbox(sandbox_id))
        if not isinstance(tier, Packable) or not offers(tier, "pack"):
            raise unsupported(tier, "export what a sandbox changed")
        staging = self.core.store.tmp_dir / f"pack-{secrets.token_hex(8)}"
        try:
            async with self.pauser.holding(sandbox_id) as (sb, live):  # the copy freezes it
                self.core.busy(sb, PACK_TIMEOUT)  # its idle TTL does not stop it meanwhile
                try:
                    layers = [str(d) for d in live.runtime.get("layers", [])]
                    base = await asyncio.to_thread(self.images.layer_refs, layers)
                    with stopped_meanwhile(sb, "its changes were copied"):
                        await tier.export_writable_layer(live, staging)
                finally:
                    self.core.idle_done(sb)
            seen = await asyncio.to_thread(inspect, staging)
            for rel in scrub:
                await asyncio.to_thread(_scrub, staging, rel)
            layer = await self.core.store.add_layer_from_dir(
                staging, f"changes of sandbox {sandbox_id}", kind="layer", shift_ids=False
            )
        finally:
            await asyncio.to_thread(shutil.rmtree, staging, True)
        return sb, layer, base, seen

    def baseline(self, snapshot_id: str) -> Path | None:
        """The writable layer a snapshot holds (what its sandbox had changed when it was taken), where
        its tier keeps one as a directory: the baseline of a sandbox restored from it."""
        upper = self._snapshot(snapshot_id).path / "fs" / "upper"
        return upper if upper.is_dir() else None

    async def pack(self, sandbox_id: str, ref: str, exclude: builtins.list[str]) -> ImageInfo:
        """A new image: the sandbox's layers plus one new layer holding what it changed.

        `exclude`: absolute paths whose changes are dropped (build caches, shell history, answer
        files): under them the new image shows the base layers' content, as before the sandbox ran.
        The manifest's recipe records which sandbox (and image) it was packed from, and when.
        """
        tier = self.core.tier(self.core.sandbox(sandbox_id))
        if not isinstance(tier, Packable) or not offers(tier, "pack"):
            raise unsupported(tier, "pack a sandbox into an image")
        try:
            name, tag = parse_ref(ref)
        except InvalidRefError as exc:
            raise InvalidArgumentError(f"invalid image reference {ref!r}: {exc}") from exc
        scrub = [inside_path(path) for path in exclude]
        sb, layer, base, _ = await self.changes_layer(sandbox_id, scrub, lambda _staging: None)
        recipe = {
            "packed_from": sandbox_id,
            "labels": sb.spec.labels,  # who built it: the job / agent that owned the sandbox
            "image": sb.spec.environment(),
            "excluded": scrub,
            "packed_at": time.time(),
        }
        layers = [*base, layer]
        # The source image's defaults carry over; the caller's own env (maybe secrets) does not.
        source: ImageManifest | None = None
        with contextlib.suppress(SandboxError):  # the image may be gone since: no defaults then
            source = await self.images.resolve_environment(sb.spec)
        manifest = await asyncio.to_thread(
            functools.partial(
                self.core.store.put_manifest,
                name,
                tag,
                layers,
                recipe=json.dumps(recipe),
                env=source.env if source else None,
                workdir=source.workdir if source else None,
                user=source.user if source else None,
            )
        )
        self.core.journal.record(
            sandbox_id, "packed", {"image": manifest.ref, "layer": layer.digest, "bytes": layer.size}
        )
        return image_info(manifest)
