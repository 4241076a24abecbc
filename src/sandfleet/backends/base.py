"""The TierBackend protocol: *where* a sandbox lives (container, fncall, microvm, vm).

What you *do* in a sandbox (exec, files, sessions) is backend-independent and lives in the daemon's
service layer; it needs one thing every backend hands back in a `LiveSandbox`: a channel to the
in-sandbox agent.

Every tier implements the small base protocol `TierBackend`. Everything else is a capability, a protocol
of its own that a tier implements or not: the service asks `isinstance(backend, Pausable)` and
answers a typed `unsupported` error when the tier lacks it (`unsupported`). A container has them all;
a microVM has no host-side root (its files go through the agent), an fncall tier no snapshots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from sandfleet.errors import UnsupportedError
from sandfleet.images import ImageManifest
from sandfleet.models import Resources, SandboxSpec, Usage
from sandfleet.runtime.agent import AgentChannel
from sandfleet.runtime.agent_exec import ExecProcess
from sandfleet.runtime.cgroups import Cgroups


@dataclass
class LiveSandbox:
    """A running sandbox as its backend sees it. `runtime` is persisted so a restarted daemon can adopt it."""

    id: str  # its live part's name: the sandbox's id, or a standby's a rollback promoted (`part_of`)
    channel: AgentChannel
    agent_pid: int
    agent_start_time: int | None
    uid_base: int
    runtime: dict[str, Any] = field(default_factory=dict)
    # A restored child's handles on the execs it kept from its parent (sessions, background
    # processes), by exec id; the service turns them into its own records.
    inherited: dict[int, ExecProcess] = field(default_factory=dict)

    @property
    def sandbox_id(self) -> str:
        return sandbox_of(self.id)


class TierBackend(Protocol):
    """What every tier does."""

    name: str

    async def start(self) -> None:
        """Prepare the node (check the runtime, load what it needs). Called once at daemon start."""

    async def close(self) -> None:
        """Release node-level resources held by the backend (not the sandboxes)."""

    async def create(self, sandbox_id: str, spec: SandboxSpec, image: ImageManifest) -> LiveSandbox:
        """Create and start a sandbox; on failure leave nothing behind and raise SandboxError."""

    async def destroy(self, sandbox: LiveSandbox) -> None:
        """Kill every process of the sandbox and release everything it used."""

    async def adopt(self, sandbox_id: str, runtime: dict[str, Any]) -> LiveSandbox | None:
        """Reconnect to a sandbox created by a previous daemon; None if it is gone."""

    async def cleanup(self, sandbox_id: str, runtime: dict[str, Any]) -> None:
        """Idempotently remove whatever a dead or half-created sandbox left behind."""

    def residue(self) -> set[str]:
        """Ids of the sandboxes the node still holds anything of (directories, cgroups, processes),
        known to the service or not: what a restart cleans when no record claims it."""

    def usage(self, sandbox: LiveSandbox) -> Usage:
        """Current usage and limit hits (called from worker threads)."""

    def cpu_seconds(self, sandbox: LiveSandbox | None) -> float:
        """CPU time a sandbox has used; None: all of this backend's sandboxes, stopped ones included."""


def cgroup_usage(cgs: Cgroups, sandbox: LiveSandbox) -> Usage:
    """`TierBackend.usage` of a tier that keeps each sandbox in a cgroup named by its id."""
    return Usage(**dataclasses.asdict(cgs.stats(cgs.path_for(sandbox.id))))


def cgroup_cpu_seconds(cgs: Cgroups, sandbox: LiveSandbox | None) -> float:
    """`TierBackend.cpu_seconds` of such a tier: the sandbox's cgroup, or (None) the tier's parent."""
    return cgs.cpu_seconds(cgs.parent if sandbox is None else cgs.path_for(sandbox.id))


@runtime_checkable
class Pausable(Protocol):
    async def pause(self, sandbox: LiveSandbox) -> tuple[int, int]:
        """Freeze every process of the sandbox and push its memory out; (bytes before, bytes after)."""

    async def resume(self, sandbox: LiveSandbox) -> None:
        """Thaw a paused sandbox."""


@runtime_checkable
class Snapshottable(Protocol):
    async def snapshot(self, sandbox: LiveSandbox, target: Path) -> dict[str, Any]:
        """Checkpoint a running sandbox (processes, memory, writable layer) into the empty directory
        `target`; it keeps running. Returns what `restore` needs besides the directory."""

    async def restore(self, sandbox_id: str, spec: SandboxSpec, source: Path, meta: dict[str, Any]) -> LiveSandbox:
        """Start a new sandbox from a snapshot; on failure leave nothing behind and raise SandboxError."""


# A sandbox's live part has the sandbox's id as its name (of its cgroup, directory, ...), or, once a
# rollback promoted a standby (restored ahead under a name of its own, `<id>.<...>`) in its place,
# the standby's: a swap renames nothing. The sandbox's runtime record says which (`part`).
PART_SEP = "."


def part_of(sandbox_id: str, runtime: Any) -> str:
    """The name of the sandbox's live part (a damaged record's anything else is ignored: it never
    names another sandbox's part, or a path)."""
    part = runtime.get("part") if isinstance(runtime, dict) else None
    if isinstance(part, str) and part.startswith(sandbox_id + PART_SEP) and "/" not in part and "\0" not in part:
        return part
    return sandbox_id


def sandbox_of(part: str) -> str:
    """The id of the sandbox whose live part (or standby, or old part) `part` names."""
    return part.split(PART_SEP, 1)[0]


@runtime_checkable
class StandbyTier(Protocol):
    """A tier that restores a checkpoint ahead of a rollback, frozen under a name of its own, and
    later makes that restore the sandbox itself: the rollback is then a swap, not a restore."""

    def standbys_possible(self) -> bool:
        """Whether this node can (the container tier: a cgroup can be renamed, v1 only)."""

    async def restore_standby(
        self, name: str, spec: SandboxSpec, source: Path, meta: dict[str, Any], *, idle: bool
    ) -> LiveSandbox:
        """Restore the snapshot at `source` as `name` (a name no sandbox has) and freeze it. `idle`:
        the restore gets only CPU no one else wants (until `hurry`)."""

    async def hurry(self, name: str, spec: SandboxSpec) -> None:
        """The restore of standby `name` is waited for: give it the CPU weight of its sandbox (`spec`)."""

    async def promote(
        self, standby: LiveSandbox, sandbox_id: str, spec: SandboxSpec, replacing: LiveSandbox | None
    ) -> None:
        """Make the frozen standby the live part of sandbox `sandbox_id` (`spec` its own) under its
        own name, and thaw it; its runtime then says so (the caller records it). The live part it
        replaces (`replacing`, if still in place) stops taking CPU at the same time and stays until
        the caller destroys it. On failure raise SandboxError, the standby destroyed. (The caller checks that its agent
        answers.)"""

    async def set_aside(self, live: LiveSandbox, name: str) -> None:
        """Move a sandbox's live part out of its id's way under `name` (a name no sandbox has), to
        be destroyed later; raises SandboxError (nothing moved) if it cannot."""

    async def destroy(self, sandbox: LiveSandbox) -> None:
        """(as TierBackend's)"""

    async def cleanup(self, sandbox_id: str, runtime: dict[str, Any]) -> None:
        """(as TierBackend's)"""

    def residue(self) -> set[str]:
        """(as TierBackend's)"""


@runtime_checkable
class SharedRestores(Protocol):
    """A tier whose restores of one snapshot can share its memory (microvm: a template of it)."""

    async def share(self, spec: SandboxSpec, source: Path, meta: dict[str, Any]) -> None:
        """Before several restores of the snapshot at `source` at once (a fork): make them share its
        memory. Best effort: the restores work without it."""

    async def unshare(self, source: Path) -> None:
        """The snapshot at `source` is gone: drop what `share` made of it."""


@runtime_checkable
class Packable(Protocol):
    async def export_writable_layer(self, sandbox: LiveSandbox, dest: Path) -> None:
        """Copy what the sandbox changed above its layers (overlay upper, whiteouts kept) to `dest`."""


@runtime_checkable
class HostFiles(Protocol):
    """The sandbox's files reached from the host side (the container tier: an O_PATH root fd)."""

    def open_root(self, sandbox: LiveSandbox) -> int:
        """An O_PATH directory fd of the sandbox's root filesystem (caller closes it)."""

    def mount_points(self, sandbox: LiveSandbox) -> frozenset[str]:
        """Paths inside the sandbox that something is mounted on (never removed by the files API)."""


@runtime_checkable
class LayerCache(Protocol):
    """Read-only layers mounted on the node and shared by its sandboxes."""

    async def unmount_unused_layers(self) -> int:
        """Unmount read-only layers no sandbox uses, so their files can be deleted; how many."""

    def busy_layers(self) -> set[str]:
        """Digests of the layers mounted or being mounted on this node (their files must stay)."""

    def remove_layer_if_idle(self, digest: str, remove: Callable[[], None]) -> bool:
        """Run `remove` (which deletes the layer's file) unless the layer is mounted or being
        mounted, atomically with respect to mounting it; whether it ran."""


@runtime_checkable
class Recoverable(Protocol):
    async def recover(self, name: str) -> tuple[LiveSandbox, Resources] | None:
        """After the state database was lost: take back a sandbox found running on the node (by its
        cgroup and agent) under `name` (of `residue`: its id, or its live part's name), with the
        resources its limits say; None if there is nothing to take."""


@runtime_checkable
class HostChecks(Protocol):
    def leftovers(self) -> dict[str, list[str]]:
        """Node-level residue not owned by any live sandbox, by kind (for leak checks and `doctor`)."""


@runtime_checkable
class Networked(Protocol):
    """The sandbox has a network namespace the daemon can enter (egress policy, exposed ports)."""

    def netns_path(self, sandbox: LiveSandbox) -> str:
        """A path naming the sandbox's network namespace (`/proc/<pid>/ns/net`)."""


@runtime_checkable
class LayerView(Protocol):
    """The sandbox's writable layer and the read-only layers under it, readable from the host (the
    detectors look for system files a sandbox replaced)."""

    def layer_paths(self, sandbox: LiveSandbox) -> tuple[Path, list[Path]]:
        """(the writable layer's directory, the read-only layers' directories, top first)."""


@runtime_checkable
class HostProcesses(Protocol):
    """The sandbox's processes are host processes: its init (the agent) and the init's descendants,
    in a pid namespace of the sandbox's own. The daemon reads a command's own CPU from /proc (its
    `cpu_time`, and whether the node starved it)."""

    def init_pid(self, sandbox: LiveSandbox) -> int:
        """The host pid of the sandbox's init; each command is one of its children."""


CAPABILITIES: dict[str, type] = {
    "pause": Pausable,
    "snapshot": Snapshottable,
    "pack": Packable,
    "host_files": HostFiles,
    "layer_cache": LayerCache,
    "recover": Recoverable,
    "host_checks": HostChecks,
    "network": Networked,
    "layer_view": LayerView,
    "host_processes": HostProcesses,
}


def offers(backend: TierBackend, capability: str) -> bool:
    """Whether `backend` has `capability`: it implements the protocol, and its configuration allows
    it (a tier may define `supports(name) -> bool`: the container tier snapshots and packs only with
    its own launcher, not under crun or runc)."""
    if not isinstance(backend, CAPABILITIES[capability]):
        return False
    supports = getattr(backend, "supports", None)
    return bool(supports(capability)) if callable(supports) else True


def capabilities(backend: TierBackend) -> list[str]:
    """The names of the capabilities `backend` has."""
    return [name for name in CAPABILITIES if offers(backend, name)]


def unsupported(backend: TierBackend, doing: str) -> UnsupportedError:
    """The typed error a tier without the capability answers (raise it after an isinstance check,
    which is also what narrows the backend's type)."""
    return UnsupportedError(f"the {backend.name} tier cannot {doing}")
