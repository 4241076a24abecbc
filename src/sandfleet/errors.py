"""One exception tree for everything sandfleet raises, and the closed set of wire error codes.

    SandboxError                      base; `.code`, `.retryable`
    ├── InvalidArgumentError          invalid_argument   bad spec, bad path, bad request body
    ├── NotFoundError                 not_found
    │   ├── SandboxNotFoundError      not_found          no sandbox with that id
    │   ├── ImageNotFoundError        not_found          no image/layer with that reference
    │   └── SnapshotNotFoundError     not_found          no snapshot with that id
    ├── WrongStateError               wrong_state        call not valid in the sandbox's lifecycle state
    ├── ResourceExhaustedError        resource_exhausted node full or a quota hit (retryable)
    ├── SandboxTimeoutError           timeout            an operation did not finish in time
    ├── UnauthenticatedError          unauthenticated    missing or bad bearer token
    ├── PermissionDeniedError         permission_denied  the sandbox refused (e.g. EACCES on a file)
    ├── UnsupportedError              unsupported        the sandbox's tier lacks the capability asked for
    ├── UnavailableError              unavailable        daemon or sandbox channel unreachable (retryable)
    ├── SandboxLostError              sandbox_lost       its node died (cluster): the sandbox is gone for good
    ├── DataLossError                 data_loss          a stored layer or snapshot is corrupt or truncated
    └── InternalError                 internal           a bug or a runtime failure

Every error also says whose fault it was (`cause`), so an RL trainer masks infrastructure failures
instead of scoring them against the policy: `infra` (the node, the daemon, a lost sandbox, a refused
create), `agent` (what ran in the sandbox: its command failed, it hit a limit, it killed its own
init), `timeout`, `verifier` (a verification's own checks broke) and `caller` (a bad request: wrong
id, wrong state, bad argument). Each class has a default; a raise site that knows better passes
`cause=`.

On the wire an error is `{"error": {"code", "message", "retryable", "cause"}}`; codes never carry class paths.
The SDK maps the code back to the class (`error_from_wire`), so callers catch the same exceptions
whether they talk to the daemon over HTTP or in-process.
"""

from __future__ import annotations

from typing import ClassVar, Literal, get_args

Cause = Literal["infra", "agent", "timeout", "verifier", "caller"]
CAUSES: tuple[str, ...] = get_args(Cause)


class SandboxError(Exception):
    """Base of every sandfleet error."""

    code: ClassVar[str] = "internal"
    http_status: ClassVar[int] = 500
    retryable: ClassVar[bool] = False
    default_cause: ClassVar[Cause] = "infra"

    def __init__(self, message: str = "", *, cause: Cause | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.cause: Cause = cause or self.default_cause

    def to_wire(self) -> dict[str, object]:
        return {"code": self.code, "message": self.message, "retryable": self.retryable, "cause": self.cause}


class InvalidArgumentError(SandboxError):
    code = "invalid_argument"
    http_status = 400
    default_cause = "caller"


class NotFoundError(SandboxError):
    code = "not_found"
    http_status = 404
    default_cause = "caller"


class SandboxNotFoundError(NotFoundError):
    pass


class ImageNotFoundError(NotFoundError):
    pass


class SnapshotNotFoundError(NotFoundError):
    pass


class WrongStateError(SandboxError):
    code = "wrong_state"
    http_status = 409
    default_cause = "caller"


class ResourceExhaustedError(SandboxError):
    code = "resource_exhausted"
    http_status = 429
    retryable = True


class SandboxTimeoutError(SandboxError):
    code = "timeout"
    http_status = 504
    default_cause = "timeout"
    retryable = True


class UnauthenticatedError(SandboxError):
    code = "unauthenticated"
    http_status = 401
    default_cause = "caller"


class PermissionDeniedError(SandboxError):
    code = "permission_denied"
    http_status = 403
    default_cause = "agent"


class UnsupportedError(SandboxError):
    """The sandbox's isolation tier cannot do this (an fncall sandbox has no snapshots, say)."""

    code = "unsupported"
    http_status = 400
    default_cause = "caller"


class UnavailableError(SandboxError):
    code = "unavailable"
    http_status = 503
    retryable = True


class SandboxLostError(SandboxError):
    """The node holding the sandbox (or snapshot, or trajectory) died or left the cluster: what it held
    is gone. Not retryable as such: a trainer masks the rollout (cause `infra`) and starts it anew."""

    code = "sandbox_lost"
    http_status = 410


class DataLossError(SandboxError):
    code = "data_loss"
    http_status = 500


class InternalError(SandboxError):
    code = "internal"
    http_status = 500


# The closed set of wire codes, most specific class first where two share a code.
WIRE_CODES: dict[str, type[SandboxError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        WrongStateError,
        ResourceExhaustedError,
        SandboxTimeoutError,
        UnauthenticatedError,
        PermissionDeniedError,
        UnsupportedError,
        UnavailableError,
        SandboxLostError,
        DataLossError,
        InternalError,
    )
}


def error_from_wire(body: object, *, status: int = 500) -> SandboxError:
    """Rebuild the exception for a wire error body; unknown shapes become InternalError."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        code = str(err.get("code", "internal"))
        message = str(err.get("message", ""))
        cls = WIRE_CODES.get(code, InternalError)
        if cls is NotFoundError:
            if message.startswith("sandbox "):
                cls = SandboxNotFoundError
            elif message.startswith("image "):
                cls = ImageNotFoundError
            elif message.startswith("snapshot "):
                cls = SnapshotNotFoundError
        cause = err.get("cause")
        return cls(message, cause=cause if cause in CAUSES else None)
    return InternalError(f"unexpected error response (HTTP {status}): {body!r}"[:500])
