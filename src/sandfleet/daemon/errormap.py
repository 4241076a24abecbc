"""Every exception the node's own layers raise, mapped to a wire error (sandfleet.errors).

The service maps what it expects where it happens, with a message of its own (`raise ... from`);
this table is the boundary's single answer for the rest, so an exception that escapes a handler
still reaches the client as the right code (a closed agent channel is `unavailable`, a corrupt
layer `data_loss`, a full state disk `resource_exhausted`), never a blanket `internal`.
`tests/test_errormap.py` checks that every exception class defined in the package is covered.
"""

from __future__ import annotations

import errno

from sandfleet import errors
from sandfleet.backends.vm import disks, guest, migration, qemu
from sandfleet.daemon.net import egress
from sandfleet.daemon.node import state
from sandfleet.daemon.node.process import DaemonStartError
from sandfleet.images import models as image_models
from sandfleet.images.oci_errors import OciImportError
from sandfleet.images.recipe import RecipeError
from sandfleet.runtime import agent_errors, criu, launcher, mounts, seccomp, swap
from sandfleet.runtime.sandboxfs.results import FileOpError

# File operation kinds (runtime/sandboxfs/) -> wire errors.
FILE_ERRORS: dict[str, type[errors.SandboxError]] = {
    "not_found": errors.NotFoundError,
    "exists": errors.WrongStateError,
    "not_a_directory": errors.InvalidArgumentError,
    "is_a_directory": errors.InvalidArgumentError,
    "permission_denied": errors.PermissionDeniedError,
    "crosses_mount": errors.PermissionDeniedError,
    "invalid_path": errors.InvalidArgumentError,
    "too_large": errors.InvalidArgumentError,
    "no_space": errors.ResourceExhaustedError,
    "io_error": errors.InternalError,
    "changed": errors.WrongStateError,  # the sandbox moved things under a walk: stopped rather than followed
}

# Most specific first: the first class an exception is an instance of decides.
ERROR_MAP: list[tuple[type[BaseException], type[errors.SandboxError]]] = [
    # the state store
    (state.StateDiskFullError, errors.ResourceExhaustedError),
    (state.StateConflictError, errors.UnavailableError),  # a row with the same key is still going: retry
    (state.StateCorruptError, errors.DataLossError),
    (state.StateError, errors.InternalError),
    (egress.Refused, errors.PermissionDeniedError),  # answered inside the sandbox (a 403), never on the API
    (DaemonStartError, errors.UnavailableError),  # a local daemon the CLI or demo started did not come up
    # the in-sandbox agent
    (agent_errors.ChannelClosedError, errors.UnavailableError),
    (
        agent_errors.ExecStartError,
        errors.InvalidArgumentError,
    ),  # the command could not start (not found, chdir, setuid)
    (agent_errors.AgentBuildError, errors.InternalError),
    (agent_errors.ProtocolError, errors.InternalError),
    (agent_errors.AgentError, errors.UnavailableError),
    # host mechanisms
    (criu.ImageError, errors.DataLossError),  # a snapshot's images do not parse
    (criu.CriuUnavailableError, errors.UnavailableError),
    (criu.ShimBuildError, errors.InternalError),
    (launcher.LaunchError, errors.InternalError),
    (mounts.MountError, errors.InternalError),
    (seccomp.SeccompUnavailableError, errors.InternalError),
    (swap.SwapSetupError, errors.InternalError),
    (guest.GuestUnavailableError, errors.UnavailableError),  # no guest kernel or modules: setup.sh
    (qemu.QMPError, errors.UnavailableError),  # a VM's QEMU did not answer its monitor
    (disks.DiskBuildError, errors.InternalError),  # the vm tier's base disk of an image could not be made
    (migration.SnapshotFileError, errors.DataLossError),  # a VM snapshot's file is missing or changed
    (migration.VersionMismatchError, errors.WrongStateError),  # another QEMU, accel or tier than the snapshot's
    # images
    (image_models.ImageNotFoundError, errors.ImageNotFoundError),
    (image_models.InvalidRefError, errors.InvalidArgumentError),
    (image_models.LayerCorruptError, errors.DataLossError),
    (RecipeError, errors.InvalidArgumentError),
    (OciImportError, errors.InvalidArgumentError),
    (image_models.ImageBuildError, errors.InternalError),
    (image_models.ImageError, errors.InternalError),
]


def to_wire_error(exc: BaseException, *, limit: int = 300) -> errors.SandboxError:
    """The wire error for `exc` (a SandboxError is its own), its message cut at `limit` characters
    (a recipe's failing step, or a file operation's path, wants more than the default)."""
    if isinstance(exc, errors.SandboxError):
        return exc
    message = str(exc)[:limit] or type(exc).__name__
    if isinstance(exc, state.StateDiskFullError) or (isinstance(exc, OSError) and exc.errno == errno.ENOSPC):
        return errors.ResourceExhaustedError(f"the node's disk is full: {message}"[:limit])
    if isinstance(exc, launcher.LaunchError):
        if exc.invalid:
            return errors.InvalidArgumentError(message)
        if exc.unavailable:
            return errors.UnavailableError(message)
    if isinstance(exc, FileOpError):
        return FILE_ERRORS.get(exc.kind, errors.InternalError)(message)
    for cls, wire in ERROR_MAP:
        if isinstance(exc, cls):
            return wire(message)
    return errors.InternalError(f"internal error: {message}")
