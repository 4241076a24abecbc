"""A Connect service (connectrpc's ASGI application) from a service descriptor and an object whose
methods are named as the RPCs; sandfleet's errors raised in them become Connect errors."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from connectrpc.code import Code
from connectrpc.codec import Codec
from connectrpc.compat import google_protobuf_codecs
from connectrpc.errors import ConnectError
from connectrpc.method import IdempotencyLevel, MethodInfo
from connectrpc.server import ConnectASGIApplication, Endpoint
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor

from sandfleet import errors
from sandfleet.e2b._upstream import not_found_message

log = logging.getLogger("sandfleet.e2b")

# sandfleet's wire codes as Connect's (E2B's SDK turns each into its own exception).
CODES: dict[type[errors.SandboxError], Code] = {
    errors.InvalidArgumentError: Code.INVALID_ARGUMENT,
    errors.UnsupportedError: Code.UNIMPLEMENTED,
    errors.NotFoundError: Code.NOT_FOUND,
    errors.WrongStateError: Code.FAILED_PRECONDITION,
    errors.ResourceExhaustedError: Code.RESOURCE_EXHAUSTED,
    errors.SandboxTimeoutError: Code.DEADLINE_EXCEEDED,
    errors.UnauthenticatedError: Code.UNAUTHENTICATED,
    errors.PermissionDeniedError: Code.PERMISSION_DENIED,
    errors.UnavailableError: Code.UNAVAILABLE,
    errors.SandboxLostError: Code.UNAVAILABLE,
    errors.DataLossError: Code.DATA_LOSS,
    errors.InternalError: Code.INTERNAL,
}


def connect_error(exc: errors.SandboxError) -> ConnectError:
    if isinstance(exc, errors.SandboxNotFoundError):
        # What E2B's SDK reads as "the sandbox is not running" (not a missing file).
        return ConnectError(Code.UNAVAILABLE, not_found_message(exc))
    code = next((c for cls, c in CODES.items() if isinstance(exc, cls)), Code.INTERNAL)
    return ConnectError(code, str(exc))


def _error(exc: Exception) -> ConnectError:
    """What a handler raised, as the Connect error its caller gets: sandfleet's by their code, one
    of ours as it is, anything else `internal` (logged: a bug, but never a dropped connection)."""
    if isinstance(exc, ConnectError):
        return exc
    if isinstance(exc, errors.SandboxError):
        return connect_error(exc)
    log.exception("unexpected error in an E2B envd call")
    return ConnectError(Code.INTERNAL, f"internal error: {type(exc).__name__}")


def _mapped(fn: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream(*args: Any) -> AsyncIterator[Any]:
            try:
                async for item in fn(*args):
                    yield item
            except Exception as exc:
                raise _error(exc) from exc

        return stream

    @functools.wraps(fn)
    async def unary(*args: Any) -> Any:
        try:
            return await fn(*args)
        except Exception as exc:
            raise _error(exc) from exc

    return unary


def _endpoints(service: ServiceDescriptor, impl: object) -> Mapping[str, Any]:
    found: dict[str, Any] = {}
    for md in service.methods:
        fn = getattr(impl, md.name)
        info = MethodInfo(
            name=md.name,
            service_name=service.full_name,
            input=message_factory.GetMessageClass(md.input_type),
            output=message_factory.GetMessageClass(md.output_type),
            idempotency_level=IdempotencyLevel.UNKNOWN,
        )
        if md.client_streaming:
            kind: Any = Endpoint.client_stream
        elif md.server_streaming:
            kind = Endpoint.server_stream
        else:
            kind = Endpoint.unary
        found[f"/{service.full_name}/{md.name}"] = kind(method=info, function=_mapped(fn))
    return found


class _Checked:
    """A codec whose failure to decode a request is the caller's error (invalid_argument), never
    the server's: protobuf's parsers raise their own errors on malformed bodies."""

    def __init__(self, codec: Codec[Any, Any]) -> None:
        self._codec = codec

    def name(self) -> str:
        return self._codec.name()

    def encode(self, message: Any) -> bytes:
        return self._codec.encode(message)

    def decode(self, data: bytes | bytearray, message_class: type[Any]) -> Any:
        try:
            return self._codec.decode(data, message_class)
        except Exception as exc:
            raise ConnectError(Code.INVALID_ARGUMENT, f"the request cannot be decoded: {exc}") from exc


class ConnectService(ConnectASGIApplication[Any]):
    """`impl`'s methods served as `service`'s RPCs (Connect protocol, JSON and binary codecs)."""

    def __init__(self, service: ServiceDescriptor, impl: object) -> None:
        self._path = "/" + str(service.full_name)
        codecs = [_Checked(c) for c in google_protobuf_codecs()]
        super().__init__(service=impl, endpoints=lambda svc: _endpoints(service, svc), codecs=codecs)

    @property
    def path(self) -> str:
        return self._path
