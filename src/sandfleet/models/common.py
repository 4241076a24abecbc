"""What the models share: the base model, sizes, limits, and the checks of names, paths, labels and projects."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import pydantic
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
)

from sandfleet.errors import Cause

_BYTES = TypeAdapter(pydantic.ByteSize)  # "512MiB", "1 GB", "4k", 4096: decimal and binary units


def parse_size(value: object) -> int:
    """Bytes from `"1GiB"`, `"512M"` or `4096` (pydantic's ByteSize parses the strings); a bool
    or a negative number is refused rather than read as 1, 0 or a huge size."""
    if isinstance(value, bool):
        raise ValueError("size must be a number of bytes or a string like '1GiB'")
    if isinstance(value, int | float) and value < 0:
        raise ValueError("size must not be negative")
    try:
        return int(_BYTES.validate_python(value))
    except ValidationError:
        raise ValueError(f"cannot parse size {str(value)[:40]!r} (use e.g. '512MiB', '1GiB', 1048576)") from None


MAX_BYTES = 2**40  # 1 TiB: far above any node, far below what overflows a kernel interface


# One schema for requests and responses: bytes, or a size string such as "4GiB" on input.
ByteSize = Annotated[
    int,
    BeforeValidator(parse_size),
    WithJsonSchema(
        {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_BYTES}, {"type": "string", "examples": ["4GiB"]}]}
    ),
]


_LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")


LABEL_KEY = _LABEL_KEY_RE  # what a label key may be


_HOSTNAME_RE = re.compile(r"^[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?$")


_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


_USER_RE = re.compile(r"^[a-z_][a-z0-9_-]*\$?$|^[0-9]+$")


Backend = Literal["fncall", "container", "microvm", "vm"]


QoS = Literal["latency_sensitive", "best_effort"]


SandboxState = Literal["creating", "running", "paused", "stopping", "stopped", "failed"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# Bounds on what one request may carry: an error message never echoes more than SHOWN characters of
# an input, and every string a sandbox keeps (env, labels, paths) has a size the node can afford.
SHOWN = 80


MAX_PATH = 4096


MAX_ENV_VALUE = 16 * 1024


MAX_ENV_TOTAL = 32 * 1024


MAX_ENV_VARS = 256


MAX_LABELS = 64


MAX_LABEL_VALUE = 256


MAX_COMMAND = 32 * 1024  # an exec's command; argv, env and cwd travel in one 64 KiB agent message


MAX_SESSION_COMMAND = 1024**2  # a session command travels as a script, in chunks


MAX_STDIN = 32 * 1024**2


MAX_REF = 255


def shown(value: object) -> str:
    """`value` for an error message: repr'd, and cut to SHOWN characters."""
    text = repr(value)
    return text if len(text) <= SHOWN else text[: SHOWN - 3] + "..."


def check_env(env: dict[str, str]) -> dict[str, str]:
    if len(env) > MAX_ENV_VARS:
        raise ValueError(f"at most {MAX_ENV_VARS} environment variables")
    total = 0
    for key, value in env.items():
        if len(key) > 256 or not _ENV_KEY_RE.match(key):
            raise ValueError(f"invalid environment variable name {shown(key)}")
        if "\0" in value:
            raise ValueError(f"environment variable {key} contains a NUL byte")
        if len(value) > MAX_ENV_VALUE:
            raise ValueError(f"environment variable {key} is longer than {MAX_ENV_VALUE} characters")
        total += len(key) + len(value) + 2
    if total > MAX_ENV_TOTAL:
        raise ValueError(f"the environment is larger than {MAX_ENV_TOTAL} characters in all")
    return env


def check_user(user: str) -> str:
    """A user name (as in /etc/passwd) or a numeric uid."""
    if len(user) > 64 or not _USER_RE.match(user):
        raise ValueError(f"invalid user {shown(user)}")
    return user


def check_abs_path(path: str) -> str:
    if not path.startswith("/") or "\0" in path or len(path) > MAX_PATH:
        raise ValueError(f"path must be absolute, at most {MAX_PATH} characters, with no NUL byte: {shown(path)}")
    return path


def check_path(path: str) -> str:
    """A path inside the sandbox: absolute, or relative to the sandbox's working directory."""
    if not path or "\0" in path or len(path) > MAX_PATH:
        raise ValueError(f"path must be non-empty, at most {MAX_PATH} characters, with no NUL byte: {shown(path)}")
    return path


def check_labels(labels: dict[str, str]) -> dict[str, str]:
    if len(labels) > MAX_LABELS:
        raise ValueError(f"at most {MAX_LABELS} labels")
    for key, value in labels.items():
        if not _LABEL_KEY_RE.match(key) or len(value) > MAX_LABEL_VALUE:
            raise ValueError(
                f"invalid label {shown(key)}: keys are 1-63 characters of [A-Za-z0-9._/-] starting with a letter "
                f"or digit, values at most {MAX_LABEL_VALUE} characters"
            )
    return labels


def check_idempotency_key(key: str) -> str:
    if not _IDEMPOTENCY_RE.match(key):
        raise ValueError("an idempotency key is 1-128 characters of [A-Za-z0-9._:-]")
    return key


_IDEMPOTENCY_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


# In a label selector (list, stop, pause, resume ... by labels), this key selects by project: a
# sandbox of that project or of one under it matches. Sandboxes do not carry it as a label.
PROJECT_LABEL = "sandfleet.project"
VERIFY_LABEL = "sandfleet.verify"  # on a verifier's sandbox: the id of the sandbox it verifies
KEPT_LABEL = "sandfleet.verify.kept"  # on one the caller asked to keep: a restart adopts it


_PROJECT_PART = r"[a-z0-9][a-z0-9_.-]{0,62}"


_PROJECT_RE = re.compile(rf"^{_PROJECT_PART}(/{_PROJECT_PART}){{0,7}}$")


def validation_message(errors: Sequence[Mapping[str, Any]]) -> str:
    """What a refused request is told of its validation errors: where and what, for the first five;
    never the (unbounded) input itself. "body", FastAPI's first place of a JSON body, is left out."""
    parts = []
    for err in errors[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")[:100]
        parts.append(f"{loc}: {str(err.get('msg'))[:300]}")
    return "; ".join(parts) or "invalid request"


def check_project(project: str) -> str:
    """A project path: org/team/job, up to 8 levels of 1-63 characters of [a-z0-9_.-]."""
    if not _PROJECT_RE.match(project):
        raise ValueError(
            f"invalid project {shown(project)}: a path like 'org/team/job' of at most 8 parts, each 1-63 "
            "characters of [a-z0-9_.-] starting with a letter or digit"
        )
    return project


# Field types that carry these checks, for every model (here, recipes, imports) that takes such values.
EnvVars = Annotated[dict[str, str], AfterValidator(check_env)]


AbsPath = Annotated[str, AfterValidator(check_abs_path)]


SandboxPath = Annotated[str, AfterValidator(check_path)]


UserName = Annotated[str, AfterValidator(check_user)]


Labels = Annotated[dict[str, str], AfterValidator(check_labels)]


ProjectPath = Annotated[str, AfterValidator(check_project)]


IdempotencyKey = Annotated[str, AfterValidator(check_idempotency_key)]


Encoding = Literal["utf-8", "base64"]


DEFAULT_CPU_REQUEST = 0.1


MAX_SECONDS = 10 * 365 * 86400.0  # ten years: any lifetime longer is "none"


class ErrorBody(_Model):
    code: Literal[
        "invalid_argument",
        "not_found",
        "wrong_state",
        "resource_exhausted",
        "timeout",
        "unauthenticated",
        "permission_denied",
        "unsupported",
        "unavailable",
        "sandbox_lost",
        "data_loss",
        "internal",
    ]
    message: str
    retryable: bool
    cause: Cause = Field(
        description="whose fault: infra (node, daemon, lost sandbox, refused create), agent (what ran in the "
        "sandbox), timeout, verifier (a verification's own checks broke), caller (a bad request)"
    )


class ErrorResponse(_Model):
    error: ErrorBody
