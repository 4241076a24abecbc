"""Every exception class the package defines reaches the wire as a code of the closed set, and the
tiers' capabilities are what the service checks (no root, no sandboxes)."""

from __future__ import annotations

import errno
import importlib
import inspect
import typing
from pathlib import Path

import pytest

import sandfleet
from sandfleet import errors
from sandfleet.backends.base import CAPABILITIES, TierBackend, unsupported
from sandfleet.backends.container.backend import ContainerBackend
from sandfleet.daemon.errormap import ERROR_MAP, FILE_ERRORS, to_wire_error
from sandfleet.daemon.node import state
from sandfleet.images.models import LayerCorruptError
from sandfleet.models import ErrorBody
from sandfleet.runtime.agent_errors import ChannelClosedError, ExecStartError
from sandfleet.runtime.launcher import INVALID, UNAVAILABLE, LaunchError
from sandfleet.runtime.sandboxfs.results import FileOpError, FileTooLargeError

pytestmark = pytest.mark.unit


def _package_exceptions() -> list[type[BaseException]]:
    """Every exception class defined in a module of the package (daemon/ is a namespace package,
    so the modules are found on disk rather than through pkgutil)."""
    root = Path(sandfleet.__file__).parent
    found: dict[str, type[BaseException]] = {}
    for path in sorted(root.rglob("*.py")):
        name = ".".join(("sandfleet", *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
        if name.endswith(".__main__"):  # running it is the CLI
            continue
        if name.startswith("sandfleet.adapters."):  # they raise their framework's own types, never over the API
            continue
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            # A private class (state._Damaged) is a module's own control flow, caught where raised.
            if (
                issubclass(cls, BaseException)
                and cls.__module__ == module.__name__
                and not cls.__name__.startswith("_")
            ):
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return sorted(found.values(), key=lambda c: f"{c.__module__}.{c.__qualname__}")


EXCEPTIONS = _package_exceptions()


def test_the_scan_finds_the_package_exceptions() -> None:
    names = {c.__name__ for c in EXCEPTIONS}
    assert {"ChannelClosedError", "FileOpError", "StateDiskFullError", "LayerCorruptError", "LaunchError"} <= names


@pytest.mark.parametrize("cls", EXCEPTIONS, ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_every_exception_of_the_package_is_mapped(cls: type[BaseException]) -> None:
    if issubclass(cls, errors.SandboxError):
        assert cls.code in errors.WIRE_CODES, f"{cls} has a code outside the closed set"
        return
    special = issubclass(cls, FileOpError | LaunchError)
    assert special or any(issubclass(cls, mapped) for mapped, _ in ERROR_MAP), f"{cls} has no wire mapping"


def test_the_map_answers_only_codes_of_the_closed_set() -> None:
    wire_classes = {wire for _, wire in ERROR_MAP} | set(FILE_ERRORS.values())
    assert {cls.code for cls in wire_classes} <= set(errors.WIRE_CODES)
    assert set(errors.WIRE_CODES) == set(typing.get_args(ErrorBody.model_fields["code"].annotation))


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (ChannelClosedError("gone"), "unavailable"),
        (ExecStartError(errno.ENOENT, "no such file"), "invalid_argument"),
        (state.StateDiskFullError(OSError(errno.ENOSPC, "full")), "resource_exhausted"),
        (OSError(errno.ENOSPC, "No space left on device"), "resource_exhausted"),
        (LayerCorruptError("digest mismatch"), "data_loss"),
        (FileOpError("no_space", "/a", "full"), "resource_exhausted"),
        (FileTooLargeError("/a", "too big"), "invalid_argument"),
        (FileOpError("crosses_mount", "/proc", "a mount"), "permission_denied"),
        (LaunchError(INVALID, "bad uid map"), "invalid_argument"),
        (LaunchError(UNAVAILABLE, "no such cgroup"), "unavailable"),
        (ValueError("a bug"), "internal"),
        (errors.WrongStateError("paused"), "wrong_state"),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else v,
)
def test_to_wire_error(exc: BaseException, code: str) -> None:
    wire = to_wire_error(exc)
    assert wire.code == code
    assert len(wire.message) <= 400


def test_the_container_tier_has_every_capability() -> None:
    for name, cap in CAPABILITIES.items():
        assert issubclass(ContainerBackend, cap), name
    base = {n for n in dir(TierBackend) if not n.startswith("_")} | set(typing.get_type_hints(TierBackend))
    assert base <= set(dir(ContainerBackend)) | {"name"}


def test_a_tier_without_a_capability_says_so() -> None:
    class Minimal:
        name = "fncall"

    assert not any(isinstance(Minimal(), cap) for cap in CAPABILITIES.values())
    exc = unsupported(Minimal(), "snapshot a sandbox")  # type: ignore[arg-type]
    assert isinstance(exc, errors.UnsupportedError)
    assert exc.to_wire() == {
        "code": "unsupported",
        "message": "the fncall tier cannot snapshot a sandbox",
        "retryable": False,
        "cause": "caller",
    }
