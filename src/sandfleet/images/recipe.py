"""Declarative environment recipes: a base plus steps, each step one cached EROFS layer.

A recipe is a TOML file (``Recipe.load``)::

    ref = "envs/django:1"                 # the image to produce
    base = "debian:bookworm"              # image ref (built-ins are built on demand), layer digest
    # base = { mmdebstrap = { suite = "bookworm", packages = ["python3"], variant = "minbase" } }
    env = { LANG = "C.UTF-8" }            # optional: image env defaults (over the base image's),
    workdir = "/work"                     #   also used by run steps (see below); user = "..." for
                                          #   the image only

    [[step]]
    apt = ["git", "python3-pip"]          # host-side mmdebstrap of the stack's packages + these,
                                          # diffed against the stack (Debian-based stacks only)
    [[step]]
    pip = ["six==1.16.0"]                 # wheels (only: nothing is built on the host) fetched on
                                          # the host, installed offline in a build sandbox (needs
                                          # python3 in the stack, not pip)
    [[step]]
    copy = { src = "harness", dest = "/opt/harness", exclude = ["__pycache__"] }
                                          # src: inside the recipe's directory, symlinks resolved
    name = "toolkit/harness:3.1"          # optional on any step: publish its layer as an image
    [[step]]
    git = { url = "../repo", rev = "v1.2", dest = "/work/repo", keep_git = false }
    [[step]]
    run = "make -C /opt/harness install"  # /bin/sh -c in a build sandbox on the stack so far;
    env = { K = "V" }                     # its writable layer, packed, is the step's layer
    cwd = "/opt/harness"                  # optional, as are timeout, exclude and resources

Working directory of ``run`` steps: the step's ``cwd`` if it sets one (it must exist); else the
image's workdir (the recipe's, else the base image's) once it exists in the stack, and ``/`` before
that, so a step may create the workdir (``git clone ... /work/repo``, ``mkdir -p /work``): nothing is
created for it, and steps after it run there. The image's sandboxes start in the workdir, so some
step should create it.

Caching: every step's layer is recorded in ``<store>/build-cache/<key>.json`` (a LayerRef),
``key`` being the sha256 of the step's inputs. ``copy`` and ``git`` layers do not depend on what
is below them (the key is their inputs plus the content hash of the tree as copied / the resolved
commit), so changing a lower layer does not rebuild them; ``apt``, ``pip`` and ``run`` keys
include the digests of every layer below. An entry whose layer file is gone (GC'd) is a miss.
``build_recipe`` writes the image's manifest, with a JSON record of each step's key and hit.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import hashlib
import json
import logging
import os
import platform
import posixpath
import re
import stat
import sys
import time
import tomllib
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationError,
    field_validator,
)

from sandfleet.errors import NotFoundError, SandboxError
from sandfleet.models import AbsPath, EnvVars, ExecResult, Resources, UserName

from . import fsutil
from .builders import DEBIAN_SUITE, debian_mirror, mounted_layers, trim_debian_rootfs
from .models import (
    DIGEST_RE,
    ImageError,
    ImageManifest,
    ImageNotFoundError,
    InvalidRefError,
    LayerRef,
    canonical_ref,
    parse_ref,
)
from .store import LayerStore, ProgressFn

if TYPE_CHECKING:
    from sandfleet.client.aio import AsyncClient, AsyncSandbox

log = logging.getLogger(__name__)

# Bump when the meaning of a cache key's inputs changes, so old entries stop matching.
CACHE_VERSION = 1
STEP_KINDS = ("apt", "pip", "copy", "git", "run")
# Labels of build sandboxes: the recipe's ref, this build's id and the step number, so a
# caller (or a test) can find them, and cleanup can stop one whose create reply was lost.
BUILD_LABEL = "sandfleet.build"
BUILD_ID_LABEL = "sandfleet.build-id"
BUILD_STEP_LABEL = "sandfleet.build-step"
# Build sandboxes get the host's cores and room for compilers and wheels; the CPU *request*
# stays the default (0.1), so a build does not block admission of ordinary sandboxes.
BUILD_RESOURCES = Resources(cpu=float(min(os.cpu_count() or 1, 256)), memory="4GiB", disk="16GiB")
# Short: a build sandbox is only idle if this process died between requests; exec and pack
# requests in flight count as activity, so long commands are not cut off by it.
BUILD_IDLE_TTL = 120.0
# Where the pip step puts its wheelhouse inside the build sandbox (excluded from the layer).
PIP_DIR = "/tmp/sandfleet-pip"
# At most this many layers under a build sandbox (SandboxSpec.layers' max_length, the daemon's
# MAX_LAYERS: one overlay's mount options must fit a page).
MAX_BUILD_LAYERS = 32
OUTPUT_TAIL_LINES = 20
OUTPUT_TAIL_CHARS = 2000


class RecipeError(ImageError):
    """A recipe is invalid or one of its steps failed; the message says which step and why."""


# =========================================================================== recipe models
# Env, paths and users are checked by the daemon's own validators (sandfleet.models), so a recipe
# accepts exactly what the daemon will accept from the image and the build sandboxes.


def _check_ref(v: str) -> str:
    try:
        return canonical_ref(v)
    except InvalidRefError as exc:
        raise ValueError(str(exc)) from None


_SUITE_RE = re.compile(r"^[a-z][a-z0-9-]*$")
_APT_PKG_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]+(:[a-z0-9-]+)?(=[A-Za-z0-9.+~:-]+)?$")


def _check_packages(v: list[str]) -> list[str]:
    # They end up in mmdebstrap's comma-separated --include: nothing but package names.
    for pkg in v:
        if not _APT_PKG_RE.fullmatch(pkg):
            raise ValueError(f"invalid Debian package name {pkg!r}")
    return v


# A PEP 508 project name with optional extras; what follows is checked by _check_requirement.
_PIP_NAME_RE = re.compile(r"^\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*(\[[A-Za-z0-9._,\s-]*\])?\s*")
# pip takes a "name" with an archive extension for a file name (relative to its cwd).
_ARCHIVE_EXTS = (".whl", ".zip", ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz", ".tar.xz", ".txz", ".tar.lz", ".tlz")
_WHEELS_ONLY = (
    "The pip step installs wheels only, as building an sdist or source tree runs its code, which "
    "must not happen on the host: copy the source in (copy or git step) and build it in a run step."
)
# Runs the host's pip with source builds refused: pip prepares the metadata of every sdist, source
# tree or VCS checkout it meets (running its setup.py or build backend) even with
# --only-binary=:all: when the requirement, or a dependency in a wheel's metadata, is a direct URL.
# The first argument is the directory to run in. Fails closed: if pip's internals move, the
# import fails and so does the step.
_PIP_GUARD = """\
import os, sys
os.chdir(sys.argv.pop(1))
from pip._internal.distributions.sdist import SourceDistribution
from pip._internal.exceptions import InstallationError

def refuse(self, *args, **kwargs):
    raise InstallationError(f"sandfleet: refusing to build {self.req} from source on the host (wheels only)")

SourceDistribution.prepare_distribution_metadata = refuse
from pip._internal.cli.main import main
sys.exit(main())
"""


def _check_requirement(req: str) -> str:
    """A requirement pip resolves to wheels alone: ``name[extras] <version spec> ; markers``, or
    ``name @ https://.../name-1.0-py3-none-any.whl``. Paths, sdist and VCS URLs are refused here,
    before pip (which would build them on the host even with --only-binary=:all:) sees them."""
    if req.lstrip().startswith("-"):
        # Options would be passed to pip on the host: not something a recipe may smuggle in.
        raise ValueError(f"invalid requirement {req!r} (options are not allowed)")
    m = _PIP_NAME_RE.match(req)
    if m is None or m.group(1).lower().endswith(_ARCHIVE_EXTS):
        raise ValueError(f"invalid requirement {req!r}: give a project name such as 'six==1.16.0'. {_WHEELS_ONLY}")
    rest = req[m.end() :]
    if rest.startswith("@"):
        url, *markers = rest[1:].split(None, 1) or [""]
        if not (re.match(r"^https?://", url, re.IGNORECASE) and urlsplit(url).path.endswith(".whl")):
            raise ValueError(
                f"invalid requirement {req!r}: 'name @ URL' must be an http(s) URL of a .whl. {_WHEELS_ONLY}"
            )
        if markers and not markers[0].startswith(";"):
            raise ValueError(f"invalid requirement {req!r}: only markers (; ...) may follow the URL")
    elif (rest and rest[0] not in "<>=!~(;") or "@" in rest.partition(";")[0]:
        raise ValueError(f"invalid requirement {req!r}: expected a version spec or markers after the name")
    return req


def _check_dest(v: str) -> str:
    if not v.startswith("/") or "\0" in v:
        raise ValueError(f"dest must be absolute (a path inside the image): {v!r}")
    norm = posixpath.normpath(v)
    if norm.startswith("//"):
        norm = "/" + norm.lstrip("/")
    if any(norm == d or norm.startswith(d + "/") for d in ("/proc", "/sys", "/dev")):
        raise ValueError(f"dest {v!r} is under /proc, /sys or /dev, which the runtime provides")
    return norm


ImageRef = Annotated[str, AfterValidator(_check_ref)]
Dest = Annotated[str, AfterValidator(_check_dest)]
Packages = Annotated[list[str], AfterValidator(_check_packages)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MmdebstrapSpec(_Strict):
    """A Debian root filesystem bootstrapped on the host (the base layer of the image)."""

    suite: str = Field(DEBIAN_SUITE, pattern=_SUITE_RE.pattern, description="Debian suite, e.g. 'bookworm'")
    packages: Packages = Field(default_factory=list, description="extra packages (mmdebstrap --include)")
    variant: Literal["minbase", "required", "important", "standard"] = Field(
        "minbase", description="mmdebstrap --variant"
    )


class MmdebstrapBase(_Strict):
    mmdebstrap: MmdebstrapSpec


class _Step(_Strict):
    name: ImageRef | None = Field(
        None, description="also publish this step's layer as a one-layer image of this name:tag"
    )


class AptStep(_Step):
    """Debian packages, installed by a host-side mmdebstrap diffed against the stack below."""

    apt: Packages = Field(min_length=1, description="package names (optionally pkg=version)")


class PipStep(_Step):
    """Python requirements: wheels fetched on the host, installed offline in a build sandbox."""

    pip: list[str] = Field(min_length=1, description="requirement specifiers, e.g. 'six==1.16.0'")
    resources: Resources | None = Field(None, description="build sandbox resources (default BUILD_RESOURCES)")

    @field_validator("pip")
    @classmethod
    def _requirements(cls, v: list[str]) -> list[str]:
        for req in v:
            _check_requirement(req)
        return v


class CopySpec(_Strict):
    src: str = Field(description="host file or directory, relative to the recipe file")
    dest: Dest = Field(description="absolute path in the image (a directory src's contents go there)")
    exclude: list[str] = Field(
        default_factory=list, description="glob patterns matched against names and relative paths"
    )


class CopyStep(_Step):
    """Host files, content-hashed; owned by root inside the sandbox."""

    # `copy` is a BaseModel method: the field lives under another name, `copy` in TOML.
    model_config = ConfigDict(populate_by_name=True)

    spec: CopySpec = Field(alias="copy")


class GitSpec(_Strict):
    url: str = Field(description="clone URL, or a path (relative to the recipe file)")
    rev: str = Field("HEAD", description="commit, branch or tag")
    dest: Dest = Field(description="absolute path of the checkout in the image")
    keep_git: bool = Field(False, description="keep the .git directory in the layer")

    @field_validator("rev")
    @classmethod
    def _rev(cls, v: str) -> str:
        if not v or v.startswith("-") or any(c.isspace() for c in v):
            raise ValueError(f"invalid git revision {v!r}")
        return v


class GitStep(_Step):
    """A git checkout at a resolved commit (without .git unless keep_git)."""

    git: GitSpec


class RunStep(_Step):
    """A shell command in a build sandbox on the stack so far; its changes become the layer."""

    run: str = Field(min_length=1, description="shell command (/bin/sh -c)")
    env: EnvVars = Field(default_factory=dict, description="environment of the command (over the recipe's)")
    cwd: AbsPath | None = Field(
        None,
        description="working directory of the command, which must exist (default: the image's workdir "
        "once a step below made it, else /)",
    )
    timeout: float = Field(3600.0, gt=0, le=86400, description="seconds before the command is killed")
    exclude: list[AbsPath] = Field(
        default_factory=list, description="absolute paths whose changes are left out of the layer (caches)"
    )
    resources: Resources | None = Field(None, description="build sandbox resources (default BUILD_RESOURCES)")


_STEP_MODELS: dict[str, type[_Step]] = {
    "apt": AptStep,
    "pip": PipStep,
    "copy": CopyStep,
    "git": GitStep,
    "run": RunStep,
}


def _step_kind(value: Any) -> str | None:
    """Discriminator: the one kind key a step table has (the before-validator checked 'one')."""
    if isinstance(value, dict):
        kinds = [k for k in STEP_KINDS if k in value]
        return kinds[0] if len(kinds) == 1 else None
    for kind, model in _STEP_MODELS.items():
        if isinstance(value, model):
            return kind
    return None


Step = Annotated[
    Annotated[AptStep, Tag("apt")]
    | Annotated[PipStep, Tag("pip")]
    | Annotated[CopyStep, Tag("copy")]
    | Annotated[GitStep, Tag("git")]
    | Annotated[RunStep, Tag("run")],
    Discriminator(_step_kind),
]


# A string (ref or digest) or a table; tagged by type so errors are about the one that was meant.
Base = Annotated[
    Annotated[str, Tag("ref")] | Annotated[MmdebstrapBase, Tag("table")],
    Discriminator(lambda v: "ref" if isinstance(v, str) else "table"),
]


def step_kind(step: Step) -> str:
    kind = _step_kind(step)
    assert kind is not None  # every Step model has exactly one kind field
    return kind


class Recipe(BaseModel):
    """A parsed recipe. ``Recipe.load(path)`` or ``Recipe.parse(text, base_dir)``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    ref: ImageRef = Field(description="name:tag of the image to produce")
    base: Base = Field(
        description="an image ref (built-ins such as 'busybox' are built on demand), a layer digest "
        "'sha256:...', or a table { mmdebstrap = { suite, packages, variant } }"
    )
    steps: list[Step] = Field(default_factory=list, alias="step", description="[[step]] tables, bottom -> top")
    # The daemon's own field types (sandfleet.models), so the image's defaults are ones it accepts.
    env: EnvVars = Field(
        default_factory=dict,
        description="environment defaults of the image (over the base image's); also the environment of run steps",
    )
    workdir: AbsPath | None = Field(None, description="default working directory of the image (and of run steps)")
    user: UserName | None = Field(
        None, description="default user of sandboxes from the image (build steps always run as root)"
    )

    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)
    _source: str = PrivateAttr("")

    @field_validator("base")
    @classmethod
    def _base(cls, v: str | MmdebstrapBase) -> str | MmdebstrapBase:
        if isinstance(v, str) and not DIGEST_RE.match(v):
            return _check_ref(v)
        return v

    @field_validator("steps", mode="before")
    @classmethod
    def _one_kind_per_step(cls, v: Any) -> Any:
        # Checked before the union so the message names the problem instead of pydantic's
        # "unable to extract tag".
        if isinstance(v, list):
            for i, item in enumerate(v, 1):
                if not isinstance(item, dict):
                    continue
                kinds = [k for k in STEP_KINDS if k in item]
                if not kinds:
                    raise ValueError(f"step {i} has no kind: give exactly one of {', '.join(STEP_KINDS)}")
                if len(kinds) > 1:
                    raise ValueError(f"step {i} has several kinds ({', '.join(kinds)}): use one [[step]] per kind")
        return v

    @property
    def base_dir(self) -> Path:
        """Directory that relative ``copy.src`` and ``git.url`` paths are resolved against."""
        return self._base_dir

    @property
    def source(self) -> str:
        """The recipe text it was parsed from (recorded in the manifest)."""
        return self._source

    @classmethod
    def parse(cls, text: str, base_dir: str | os.PathLike[str] = ".", *, origin: str = "recipe") -> Recipe:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise RecipeError(f"{origin}: not valid TOML: {exc}") from None
        try:
            recipe = cls.model_validate(data)
        except ValidationError as exc:
            raise RecipeError(f"{origin}: invalid recipe:\n" + _format_errors(exc)) from None
        recipe._base_dir = Path(base_dir).resolve()
        recipe._source = text
        return recipe

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Recipe:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise RecipeError(f"cannot read recipe {p}: {exc}") from None
        return cls.parse(text, p.parent, origin=str(p))


def _format_errors(exc: ValidationError) -> str:
    """pydantic's error list as one line per problem, with steps numbered from 1 and named by kind."""
    lines = []
    for err in exc.errors():
        loc = list(err["loc"])
        where: list[str] = []
        if loc[:1] == ["step"] and len(loc) > 1 and isinstance(loc[1], int):
            i = loc[1]
            kind = loc[2] if len(loc) > 2 and loc[2] in STEP_KINDS else None
            where.append(f"step {i + 1}" + (f" ({kind})" if kind else ""))
            loc = loc[3:] if kind else loc[2:]
        elif loc[:1] == ["step"]:
            loc = loc[1:]
        elif loc[:1] == ["base"] and len(loc) > 1 and loc[1] in ("ref", "table"):
            loc = ["base", *loc[2:]]
        key = ".".join(str(x) for x in loc)
        if err["type"] == "extra_forbidden":
            msg = f"unknown key {key!r}"
        else:
            msg = err["msg"].removeprefix("Value error, ")
            if key:
                msg = f"{key}: {msg}"
        lines.append("  - " + ": ".join([*where, msg]))
    return "\n".join(lines)


# =========================================================================== results


@dataclass
class StepResult:
    """One layer of the result. ``index`` 0 is the base; [[step]]s are numbered from 1."""

    index: int
    kind: str  # "base" or one of STEP_KINDS
    key: str  # cache key (for a ref/digest base: the ref or digest itself)
    layer: str  # digest of the step's layer (for a multi-layer base image: its top layer)
    cache_hit: bool
    seconds: float
    name: str | None = None  # image ref the layer was also published as
    description: str = ""


@dataclass
class BuildResult:
    manifest: ImageManifest
    steps: list[StepResult] = field(default_factory=list)

    @property
    def cache_hits(self) -> int:
        return sum(s.cache_hit for s in self.steps)


# =========================================================================== host-side helpers (blocking)


def _cache_key(kind: str, **inputs: Any) -> str:
    blob = json.dumps({"v": CACHE_VERSION, "kind": kind, **inputs}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def _excluded(rel: str, name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(rel, p) for p in patterns)


# Every open of a copy step's source refuses symlinks and, below the top, is relative to an open
# directory. O_NONBLOCK: a FIFO swapped in for a file must not hang the build (fstat rejects it).
_O_SRC = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_O_SRC_DIR = _O_SRC | os.O_DIRECTORY
_O_DEST = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_COPY_CHUNK = 1024**2


def _copy_tree(fd: int, out: Path | None, exclude: list[str]) -> tuple[int, str]:
    """Hash the file or tree open at ``fd`` and, unless ``out`` is None, copy it to ``out``;
    return (entries, content hash). Blocking; ``fd`` stays the caller's.

    The walk never follows a symlink (symlinks are copied as links), so renaming or replacing
    things in the source meanwhile cannot make it read outside the tree; and the hash is of
    exactly the bytes and modes written, so an edit during the copy cannot end up in a layer
    cached under the previous content's key.

    The hash covers names, types, permission bits, file contents and link targets, in sorted
    order. Owners and mtimes are left out on purpose: the layer makes everything root's, and a
    fresh checkout or `touch` should not invalidate the cache when nothing actually changed.
    """
    h = hashlib.sha256()
    count = 0
    dir_times: list[tuple[Path, os.stat_result]] = []

    def record(rel: str, st: os.stat_result, payload: bytes) -> None:
        nonlocal count
        count += 1
        h.update(f"{rel}\0{stat.S_IFMT(st.st_mode)}\0{stat.S_IMODE(st.st_mode):o}\0".encode(errors="surrogateescape"))
        h.update(payload + b"\n")

    def copy_file(src_fd: int, rel: str, st: os.stat_result) -> None:
        fh = hashlib.sha256()
        dst = None if out is None else os.open(out / rel if rel else out, _O_DEST, 0o600)
        try:
            while chunk := os.read(src_fd, _COPY_CHUNK):
                fh.update(chunk)
                view = memoryview(chunk)
                while dst is not None and view:
                    view = view[os.write(dst, view) :]
            if dst is not None:
                os.fchmod(dst, stat.S_IMODE(st.st_mode))
                os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            if dst is not None:
                os.close(dst)
        record(rel, st, fh.digest())

    def entry(entry_fd: int, rel: str) -> None:
        # The type and mode of what was opened, not of an earlier lstat: that is what is copied.
        st = os.fstat(entry_fd)
        if stat.S_ISREG(st.st_mode):
            copy_file(entry_fd, rel, st)
            return
        if not stat.S_ISDIR(st.st_mode):
            raise RecipeError(f"{rel or 'the source'}: only files, directories and symlinks can be copied")
        record(rel, st, b"")
        if out is not None:
            d = out / rel if rel else out
            d.mkdir(exist_ok=not rel)  # the top may be the staging root itself (dest = "/")
            os.chmod(d, stat.S_IMODE(st.st_mode))
            dir_times.append((d, st))
        for name in sorted(os.listdir(entry_fd)):
            r = f"{rel}/{name}" if rel else name
            if _excluded(r, name, exclude):
                continue
            lst = os.stat(name, dir_fd=entry_fd, follow_symlinks=False)
            if stat.S_ISLNK(lst.st_mode):
                target = os.readlink(name, dir_fd=entry_fd)
                if out is not None:
                    os.symlink(target, out / r)
                record(r, lst, os.fsencode(target))
            elif stat.S_ISDIR(lst.st_mode) or stat.S_ISREG(lst.st_mode):
                child = os.open(name, _O_SRC_DIR if stat.S_ISDIR(lst.st_mode) else _O_SRC, dir_fd=entry_fd)
                try:
                    entry(child, r)
                finally:
                    os.close(child)
            else:
                raise RecipeError(f"{r}: only files, directories and symlinks can be copied")

    entry(fd, "")
    for d, st in reversed(dir_times):  # children are in place: restore the dirs' mtimes last
        os.utime(d, ns=(st.st_atime_ns, st.st_mtime_ns))
    return count, h.hexdigest()


def hash_tree(src: Path, exclude: list[str]) -> str:
    """Content hash of the file or directory ``src`` (not a symlink), as a copy step keys it."""
    fd = os.open(src, _O_SRC)
    try:
        return _copy_tree(fd, None, exclude)[1]
    finally:
        os.close(fd)


def _open_source(base_dir: Path, src: str) -> int:
    """An fd of the copy source ``base_dir/src`` (symlinks resolved), which must be in ``base_dir``.

    A recipe may come from someone else: it must not bake the builder's files (``/root/.ssh``,
    ``../../etc``, a symlink to them) into an image. The real path is checked again on the open
    fd, so replacing a directory on the way by a symlink after the first check gains nothing.
    """
    base = os.path.realpath(base_dir)

    def inside(path: str) -> bool:
        return path == base or path.startswith(base.rstrip("/") + "/")

    real = os.path.realpath(base_dir / src)
    if not inside(real):
        raise RecipeError(f"source {src!r} is {real}, outside the recipe's directory {base}")
    try:
        fd = os.open(real, _O_SRC)
    except FileNotFoundError:
        raise RecipeError(f"source {real} does not exist") from None
    try:
        opened = os.readlink(f"/proc/self/fd/{fd}")
        if not inside(opened):
            raise RecipeError(f"source {src!r} is {opened}, outside the recipe's directory {base}")
    except BaseException:
        os.close(fd)
        raise
    return fd


# Modes for directories a step creates as parents of its dest. In overlayfs the topmost layer's
# directory metadata wins, and copy/git layers cannot look at the stack below, so use what the
# FHS says these directories are instead of a blanket 0755 (which would un-sticky /tmp).
_STANDARD_DIR_MODES = {"tmp": 0o1777, "var/tmp": 0o1777, "root": 0o700}


def _make_parents(root: Path, dest_rel: str) -> None:
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)
    parts = [p for p in dest_rel.split("/") if p][:-1]
    for n in range(1, len(parts) + 1):
        rel = "/".join(parts[:n])
        d = root / rel
        d.mkdir(exist_ok=True)
        os.chmod(d, _STANDARD_DIR_MODES.get(rel, 0o755))


def _own_by_root(root: Path) -> None:
    """lchown everything to 0:0 (root inside, once shifted), keeping setuid bits chown clears."""
    paths = [str(root)]
    for dirpath, dirnames, filenames in os.walk(root):
        paths += [os.path.join(dirpath, n) for n in (*dirnames, *filenames)]
    for path in paths:
        st = os.lstat(path)
        os.lchown(path, 0, 0)
        if not stat.S_ISLNK(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
            os.chmod(path, stat.S_IMODE(st.st_mode))


def _normalize_checkout_modes(root: Path) -> None:
    """Git records only "executable or not"; the checkout's modes come from this process's
    umask. Make them what git means (0755 / 0644), so a umask of 077 on the build host does not
    leave files only root can read in the image."""
    for dirpath, _dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                os.chmod(path, 0o755 if st.st_mode & 0o111 else 0o644)


def stage_copy(base_dir: Path, src: str, staging: Path, dest: str, exclude: list[str]) -> tuple[int, str]:
    """Lay out ``base_dir/src`` at ``staging/dest`` (blocking); return the number of entries
    copied and the content hash of what was copied (see ``_copy_tree``)."""
    dest_rel = dest.lstrip("/")
    fd = _open_source(base_dir, src)
    try:
        if not dest_rel and not stat.S_ISDIR(os.fstat(fd).st_mode):
            raise RecipeError(f"{src} is a file: dest must name the file, not /")
        _make_parents(staging, dest_rel)
        n, digest = _copy_tree(fd, staging / dest_rel, exclude)
    finally:
        os.close(fd)
    if not dest_rel:
        os.chmod(staging, 0o755)  # the image's / keeps standard metadata whatever src's is
    _own_by_root(staging)  # lchown and chmod leave the mtimes _copy_tree restored alone
    return n, digest


def _resolve_in_root(root: Path, rel: str, hops: int = 16) -> Path | None:
    """``root/rel`` with symlinks resolved inside ``root`` (an absolute link target is relative to
    the image's /, not the host's); None if it does not exist."""
    parts = [p for p in rel.split("/") if p]
    cur: list[str] = []
    while parts:
        part = parts.pop(0)
        if part == ".":
            continue
        if part == "..":
            if cur:
                cur.pop()
            continue
        p = root.joinpath(*cur, part)
        if p.is_symlink():
            hops -= 1
            if hops < 0:
                return None
            target = os.readlink(p)
            if target.startswith("/"):
                cur = []
            parts = [x for x in target.split("/") if x] + parts
            continue
        cur.append(part)
    path = root.joinpath(*cur)
    return path if path.exists() or path.is_symlink() else None


@dataclass
class DebianInfo:
    suite: str
    packages: list[str]  # installed, as mmdebstrap --include names


def read_debian_info(root: Path, native_arch: str) -> DebianInfo | None:
    """Suite and installed packages of a mounted Debian root, or None if it is not Debian-based.

    The stack may come from an imported image or a run step, so its files are untrusted: they go
    into mmdebstrap's argv (the suite as an argument, the packages joined by commas into
    --include), and a suite like ``--setup-hook=...`` or a "package" ``/tmp/x.deb`` or ``a,b``
    would be obeyed there. Anything that is not a plain name raises RecipeError.
    """
    status = _resolve_in_root(root, "var/lib/dpkg/status")
    os_release = _resolve_in_root(root, "etc/os-release")
    if status is None or os_release is None:
        return None
    fields: dict[str, str] = {}
    for line in os_release.read_text(errors="replace").splitlines():
        k, sep, v = line.partition("=")
        if sep:
            fields[k.strip()] = v.strip().strip('"')
    ids = {fields.get("ID", ""), *fields.get("ID_LIKE", "").split()}
    suite = fields.get("VERSION_CODENAME", "")
    if "debian" not in ids or not suite:
        return None
    if not _SUITE_RE.fullmatch(suite):
        raise RecipeError(f"the stack's /etc/os-release has an invalid VERSION_CODENAME {suite!r}")
    packages = []
    for para in re.split(r"\n\s*\n", status.read_text(errors="replace")):
        info: dict[str, str] = {}
        for line in para.splitlines():
            if line[:1].isspace() or ":" not in line:
                continue
            k, _, v = line.partition(":")
            info[k] = v.strip()
        if info.get("Status", "").split()[-1:] != ["installed"] or "Package" not in info:
            continue
        arch = info.get("Architecture", "all")
        pkg = info["Package"] if arch in (native_arch, "all") else f"{info['Package']}:{arch}"
        # The user's packages pass the same check (_check_packages). Failing is better than
        # dropping the entry: the apt layer's dpkg database would silently forget the package.
        if not _APT_PKG_RE.fullmatch(pkg) or "=" in pkg:
            raise RecipeError(f"the stack's /var/lib/dpkg/status lists an invalid package {pkg!r}")
        packages.append(pkg)
    return DebianInfo(suite=suite, packages=sorted(set(packages)))


def drop_whiteouts(root: Path) -> int:
    """Remove whiteouts (0/0 char devices) from a layer dir; return how many (blocking).

    An apt step's full tree only knows what dpkg installed: files that copy/git/pip/run steps
    put in the stack are missing from it, and must not be deleted by the apt layer.
    """
    n = 0
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                os.unlink(p)
                n += 1
    return n


def python_version_in(root: Path) -> tuple[int, int] | None:
    """``(major, minor)`` of the image's ``python3``, read from the mounted stack, or None."""
    for cand in ("usr/local/bin/python3", "usr/bin/python3"):
        link = root / cand
        if not (link.exists() or link.is_symlink()):
            continue
        # python3 is normally a symlink to python3.N; follow the chain inside the image.
        name = cand
        for _ in range(8):
            p = root / name
            if not p.is_symlink():
                break
            target = os.readlink(p)
            name = target.lstrip("/") if target.startswith("/") else posixpath.join(posixpath.dirname(name), target)
        m = re.search(r"python(\d+)\.(\d+)$", name)
        if m:
            return int(m.group(1)), int(m.group(2))
        libs = sorted(root.glob("usr/lib/python3.*")) + sorted(root.glob("usr/local/lib/python3.*"))
        for lib in reversed(libs):
            m = re.fullmatch(r"python(\d+)\.(\d+)", lib.name)
            if m:
                return int(m.group(1)), int(m.group(2))
    return None


def glibc_version_in(root: Path) -> tuple[int, int] | None:
    """``(major, minor)`` of the glibc in a mounted stack (from its libc.so.6), or None."""
    cands = ["lib64/libc.so.6", "usr/lib64/libc.so.6", "lib/libc.so.6", "usr/lib/libc.so.6"]
    for libdir in ("usr/lib", "lib"):
        real = _resolve_in_root(root, libdir)  # inside the image, even through an absolute link
        if real is not None and real.is_dir():
            cands += sorted(f"{libdir}/{e.name}/libc.so.6" for e in os.scandir(real) if "-linux-gnu" in e.name)
    for cand in cands:
        path = _resolve_in_root(root, cand)
        if path is None or not path.is_file():
            continue
        with open(path, "rb") as f:
            head = f.read(64 * 1024**2)  # a libc is a few MB; the image's file may be anything
        m = re.search(rb"GNU C Library [^\n]*?release version (\d+)\.(\d+)", head)
        if m:
            return int(m.group(1)), int(m.group(2))
    return None


def _manylinux_platforms(glibc: tuple[int, int], arch: str) -> list[str]:
    """pip --platform values for the wheels that run on ``glibc``: pip does not widen a
    manylinux_2_N tag to the older ones itself. With the legacy names of 2.17, 2.12 and 2.5."""
    if glibc[0] != 2:
        return []
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    tags = []
    for minor in range(glibc[1], 4, -1):
        tags.append(f"manylinux_2_{minor}_{arch}")
        if minor in legacy:
            tags.append(f"{legacy[minor]}_{arch}")
    return tags


def _tail(result_stdout: str, result_stderr: str) -> str:
    text = result_stderr if result_stderr.strip() else result_stdout
    tail = "\n".join(text.rstrip().splitlines()[-OUTPUT_TAIL_LINES:])
    return tail[-OUTPUT_TAIL_CHARS:]


def _is_url(url: str) -> bool:
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", url) or re.match(r"^[^/:]+@[^/:]+:", url))


# =========================================================================== the build


@dataclass
class _Ctx:
    recipe: Recipe
    store: LayerStore
    client_factory: Callable[[], AsyncClient] | None
    progress: ProgressFn | None
    build_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    stack: list[LayerRef] = field(default_factory=list)
    client: AsyncClient | None = None
    workdir: Path = Path()
    # Environment defaults of the image so far: the base image's, then the recipe's.
    env: dict[str, str] = field(default_factory=dict)
    image_workdir: str | None = None
    image_user: str | None = None
    on_step: Callable[[StepResult], None] | None = None
    on_output: Callable[[int, str, str], None] | None = None

    @property
    def cache_dir(self) -> Path:
        return self.store.root / "build-cache"

    def report(self, index: int, kind: str, stage: str, fraction: float) -> None:
        if self.progress is None:
            return
        total = len(self.recipe.steps) + 1
        overall = (index + min(max(fraction, 0.0), 1.0)) / total
        try:
            self.progress(f"[{index}/{total - 1}] {kind}: {stage}", overall)
        except Exception:  # a broken progress callback must not fail the build
            log.exception("progress callback failed")

    def step_done(self, result: StepResult) -> None:
        if self.on_step is not None:
            try:
                self.on_step(result)
            except Exception:  # a broken callback must not fail the build
                log.exception("on_step callback failed")

    def output(self, index: int, stream: str, line: str) -> None:
        if self.on_output is not None:
            try:
                self.on_output(index, stream, line)
            except Exception:
                log.exception("on_output callback failed")

    # ------------------------------------------------------------------ cache

    def _cache_get(self, key: str) -> LayerRef | None:
        path = self.cache_dir / f"{key}.json"
        try:
            layer = LayerRef.model_validate_json(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable build cache entry %s: %s", path, exc)
            return None
        try:
            lp = self.store.layer_path(layer.digest)
        except ImageError:
            return None  # the layer was GC'd (or damaged): rebuild
        if lp.stat().st_size != layer.size:
            return None
        self._touch([layer])
        return layer

    def _cache_put(self, key: str, layer: LayerRef) -> None:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        path = self.cache_dir / f"{key}.json"
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            tmp.write_text(layer.model_dump_json(indent=2) + "\n")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def _touch(self, layers: list[LayerRef]) -> None:
        # LayerStore.gc spares layers stored or used (LayerStore.touch) within its min_age (600 s
        # by default). A cached layer no manifest names yet could otherwise be deleted between its
        # cache hit and the final manifest. The use stamp is a file of its own: the layer file is
        # not touched, so its verification stays valid.
        for layer in layers:
            if self.store.layer_ref(layer.digest) is not None:
                continue
            with contextlib.suppress(OSError, ImageError):
                self.store.touch(self.store.layer_path(layer.digest))

    async def cached(self, key: str, build: Callable[[], Awaitable[LayerRef]]) -> tuple[LayerRef, bool]:
        hit = await asyncio.to_thread(self._cache_get, key)
        if hit is not None:
            return hit, True
        layer = await build()
        await asyncio.to_thread(self._cache_put, key, layer)
        return layer, False

    def push(self, layer: LayerRef) -> bool:
        """Put ``layer`` on top of the stack, unless the stack has it already: return whether it did.

        An overlay cannot mount a layer twice, and the daemon keeps the first (lowest) occurrence
        of a layer named twice in an environment; the stack keeps that one too, so it is always
        mountable and exactly what build sandboxes run on. Moving the layer up instead would put
        it above layers that were built on top of it.
        """
        if any(x.digest == layer.digest for x in self.stack):
            return False
        self.stack.append(layer)
        return True

    def below(self) -> list[str]:
        return [x.digest for x in self.stack]

    def scratch(self, name: str) -> Path:
        return self.workdir / name

    # ------------------------------------------------------------------ daemon

    def get_client(self) -> AsyncClient:
        if self.client is None:
            if self.client_factory is None:
                raise RecipeError("needs a running daemon (build_recipe got no client_factory)")
            self.client = self.client_factory()
        return self.client


async def build_recipe(
    recipe: Recipe,
    store: LayerStore,
    *,
    client_factory: Callable[[], AsyncClient] | None = None,
    progress: ProgressFn | None = None,
    on_step: Callable[[StepResult], None] | None = None,
    on_output: Callable[[int, str, str], None] | None = None,
) -> BuildResult:
    """Build ``recipe`` into ``store``: one layer per step, reusing cached layers; write the manifest.

    ``client_factory`` makes an ``AsyncClient`` to the daemon that uses ``store``; it is called at
    most once, on the first pip/run step that misses the cache, and the client is closed at the
    end. Without it such steps raise RecipeError. Raises RecipeError naming the failing step.

    ``on_step(result)`` is called as each step (the base first, index 0) is done; with
    ``on_output(index, stream, line)`` a run step's output is streamed to it line by line
    (``stream`` is "stdout" or "stderr", ``line`` without its newline) as the command runs.
    """
    ctx = _Ctx(recipe, store, client_factory, progress, on_step=on_step, on_output=on_output)
    ctx.workdir = store.tmp_dir / f"recipe-{ctx.build_id}"
    await asyncio.to_thread(ctx.workdir.mkdir, parents=True)
    results: list[StepResult] = []
    try:
        results.append(await _build_base(ctx))
        ctx.step_done(results[-1])
        ctx.env.update(recipe.env)
        ctx.image_workdir = recipe.workdir or ctx.image_workdir
        ctx.image_user = recipe.user or ctx.image_user
        for i, step in enumerate(recipe.steps, 1):
            kind = step_kind(step)
            started = time.monotonic()
            ctx.report(i, kind, "checking cache", 0.0)
            await asyncio.to_thread(ctx._touch, ctx.stack)
            try:
                key, layer, hit = await _STEP_BUILDERS[kind](ctx, i, step)
                published = None
                if step.name is not None:
                    published = await _publish_step(ctx, i, kind, key, step.name, layer)
            except (ImageError, SandboxError, OSError) as exc:
                raise RecipeError(f"step {i} ({kind}): {exc}") from exc
            if not ctx.push(layer):
                log.info("step %d (%s): layer %s is in the stack below already; it stays there", i, kind, layer.digest)
            results.append(
                StepResult(
                    index=i,
                    kind=kind,
                    key=key,
                    layer=layer.digest,
                    cache_hit=hit,
                    seconds=time.monotonic() - started,
                    name=published,
                    description=layer.description,
                )
            )
            ctx.report(i, kind, "cached" if hit else "built", 1.0)
            ctx.step_done(results[-1])
        name, tag = parse_ref(recipe.ref)
        record = {
            "recipe": recipe.ref,
            "source": recipe.source,
            "build_id": ctx.build_id,
            "steps": [
                {"index": r.index, "kind": r.kind, "key": r.key, "layer": r.layer, "cache_hit": r.cache_hit}
                | ({"name": r.name} if r.name else {})
                for r in results
            ],
        }
        try:
            manifest = await asyncio.to_thread(
                store.put_manifest,
                name,
                tag,
                list(ctx.stack),
                recipe=json.dumps(record),
                env=ctx.env,
                workdir=ctx.image_workdir,
                user=ctx.image_user,
            )
        except ImageError as exc:
            raise RecipeError(f"writing the manifest of {recipe.ref}: {exc}") from exc
        return BuildResult(manifest=manifest, steps=results)
    finally:
        # Shielded: a cancelled build must still close its client and remove its scratch dir
        # (the mounts under it are unmounted by their own context managers first).
        cleanup = [asyncio.to_thread(fsutil.rmtree, ctx.workdir)]
        if ctx.client is not None:
            cleanup.append(ctx.client.aclose())
        await asyncio.shield(asyncio.gather(*cleanup, return_exceptions=True))


def prune_build_cache(store: LayerStore) -> int:
    """Delete build-cache entries whose layer file is gone (after ``images gc``); return how many.

    Such entries are misses anyway; this only keeps ``build-cache/`` from growing forever.
    Blocking: call it via ``asyncio.to_thread`` from async code.
    """
    removed = 0
    for path in (store.root / "build-cache").glob("*.json"):
        try:
            layer = LayerRef.model_validate_json(path.read_bytes())
            store.layer_path(layer.digest)
            continue
        except (OSError, ValueError, ImageError):
            pass
        path.unlink(missing_ok=True)
        removed += 1
    return removed


async def _publish_step(ctx: _Ctx, i: int, kind: str, key: str, ref: str, layer: LayerRef) -> str:
    name, tag = parse_ref(ref)
    record = {"recipe": ctx.recipe.ref, "step": i, "kind": kind, "key": key}
    await asyncio.to_thread(ctx.store.put_manifest, name, tag, [layer], recipe=json.dumps(record))
    return f"{name}:{tag}"


# --------------------------------------------------------------------------- base


async def _build_base(ctx: _Ctx) -> StepResult:
    base = ctx.recipe.base
    started = time.monotonic()
    store = ctx.store
    ctx.report(0, "base", "resolving", 0.0)
    try:
        if isinstance(base, MmdebstrapBase):
            spec = base.mmdebstrap
            key = _cache_key("mmdebstrap", suite=spec.suite, variant=spec.variant, packages=sorted(spec.packages))

            async def build() -> LayerRef:
                return await _mmdebstrap_base(ctx, spec)

            layer, hit = await ctx.cached(key, build)
            ctx.stack = [layer]
        elif DIGEST_RE.match(base):
            key, hit = base, True
            size = (await asyncio.to_thread(store.layer_path, base)).stat().st_size
            ctx.stack = [LayerRef(digest=base, size=size, kind="base", description=f"layer {base}")]
        else:
            key = base
            hit = await asyncio.to_thread(store.has_image, base)

            def sub(stage: str, fraction: float) -> None:
                ctx.report(0, "base", stage, fraction)

            # ensure() builds built-in images (busybox, debian, python) on first use.
            manifest = await store.ensure(base, sub)
            for x in manifest.layers:  # one naming a layer twice (imported, say) keeps the first
                ctx.push(x)
            ctx.env, ctx.image_workdir, ctx.image_user = dict(manifest.env), manifest.workdir, manifest.user
            if not ctx.stack:
                raise RecipeError(f"image {base} has no layers")
    except (ImageError, OSError) as exc:
        raise RecipeError(f"base: {exc}") from exc
    ctx.report(0, "base", "ready", 1.0)
    top = ctx.stack[-1]
    return StepResult(0, "base", key, top.digest, hit, time.monotonic() - started, None, top.description)


async def _mmdebstrap(target: Path, suite: str, *, variant: str = "minbase", include: list[str]) -> str:
    mirror = await asyncio.to_thread(debian_mirror, suite)
    argv = ["mmdebstrap", f"--variant={variant}", "--mode=root", "--quiet"]
    if include:
        argv.append("--include=" + ",".join(include))
    argv += [suite, str(target), mirror]
    await fsutil.run(*argv, what="mmdebstrap")
    return mirror


async def _mmdebstrap_base(ctx: _Ctx, spec: MmdebstrapSpec) -> LayerRef:
    rootfs = ctx.scratch("base-rootfs")
    ctx.report(0, "base", f"mmdebstrap {spec.suite} ({spec.variant})", 0.1)
    mirror = await _mmdebstrap(rootfs, spec.suite, variant=spec.variant, include=spec.packages)
    await asyncio.to_thread(trim_debian_rootfs, rootfs)
    ctx.report(0, "base", "mkfs.erofs", 0.8)
    extra = f" + {', '.join(spec.packages)}" if spec.packages else ""
    layer = await ctx.store.add_layer_from_dir(
        rootfs, f"debian {spec.suite} {spec.variant}{extra} ({mirror})", kind="base"
    )
    await asyncio.to_thread(fsutil.rmtree, rootfs)
    return layer


# --------------------------------------------------------------------------- copy


async def _step_copy(ctx: _Ctx, i: int, step: Step) -> tuple[str, LayerRef, bool]:
    assert isinstance(step, CopyStep)
    spec = step.spec
    staging = ctx.scratch(f"step{i}-copy")
    ctx.report(i, "copy", f"staging {spec.src} -> {spec.dest}", 0.1)
    # Copied first and keyed by what was copied, even when the key then hits: hashing the source
    # and copying it separately would store an edit made in between under the old content's key.
    n, digest = await asyncio.to_thread(stage_copy, ctx.recipe.base_dir, spec.src, staging, spec.dest, spec.exclude)
    # No digests of the stack below: a copy layer's content does not depend on it.
    key = _cache_key("copy", tree=digest, dest=spec.dest, exclude=spec.exclude)

    async def build() -> LayerRef:
        ctx.report(i, "copy", "mkfs.erofs", 0.7)
        return await ctx.store.add_layer_from_dir(staging, f"copy {spec.src} -> {spec.dest} ({n} entries)")

    layer, hit = await ctx.cached(key, build)
    await asyncio.to_thread(fsutil.rmtree, staging)
    return key, layer, hit


# --------------------------------------------------------------------------- git

_SHA_RE = re.compile(r"^[0-9a-f]{40}$|^[0-9a-f]{64}$")
_GIT_ENV = {"GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "/bin/true", "LC_ALL": "C"}


async def _git(*args: str) -> str:
    try:
        return await fsutil.run("git", *args, what=f"git {args[0]}", env={**os.environ, **_GIT_ENV})
    except ImageError as exc:
        raise RecipeError(str(exc)) from None


async def _ls_remote(url: str, rev: str) -> str | None:
    """The commit ``rev`` names on the remote if it is a branch, tag or HEAD; None otherwise
    (an abbreviated sha, say, which only a clone can resolve)."""
    out = await _git("ls-remote", "--", url)
    refs: dict[str, str] = {}
    for line in out.splitlines():
        sha, _, ref = line.partition("\t")
        refs[ref] = sha
    for cand in (rev, f"refs/tags/{rev}", f"refs/heads/{rev}"):
        # Annotated tags: the peeled entry names the commit, the plain one the tag object.
        for name in (cand + "^{}", cand):
            if name in refs:
                return refs[name]
    return None


async def _step_git(ctx: _Ctx, i: int, step: Step) -> tuple[str, LayerRef, bool]:
    assert isinstance(step, GitStep)
    spec = step.git
    url = spec.url if _is_url(spec.url) else str((ctx.recipe.base_dir / spec.url).resolve())
    ctx.report(i, "git", f"resolving {spec.rev}", 0.05)
    remote = spec.rev if _SHA_RE.match(spec.rev) else await _ls_remote(url, spec.rev)
    repo = ctx.scratch(f"step{i}-git")

    async def clone() -> None:
        ctx.report(i, "git", f"cloning {spec.url}", 0.2)
        await _git("clone", "--quiet", "--no-checkout", "--", url, str(repo))

    if remote is None:
        # e.g. an abbreviated sha: only the repository itself can expand it.
        await clone()
        commit = (await _git("-C", str(repo), "rev-parse", "--verify", f"{spec.rev}^{{commit}}")).strip()
    else:
        commit = remote

    async def build() -> LayerRef:
        if not repo.exists():
            await clone()
        ctx.report(i, "git", f"checking out {commit[:12]}", 0.5)
        await _git("-C", str(repo), "-c", "advice.detachedHead=false", "checkout", "--quiet", "--detach", commit)
        staging = ctx.scratch(f"step{i}-git-layer")

        def stage() -> None:
            if not spec.keep_git:
                fsutil.rmtree(repo / ".git")
            dest_rel = spec.dest.lstrip("/")
            if dest_rel:
                _make_parents(staging, dest_rel)
                os.rename(repo, staging / dest_rel)
                os.chmod(staging / dest_rel, 0o755)
            else:
                os.rename(repo, staging)
                os.chmod(staging, 0o755)
            _normalize_checkout_modes(staging / dest_rel)
            _own_by_root(staging)

        await asyncio.to_thread(stage)
        ctx.report(i, "git", "mkfs.erofs", 0.7)
        layer = await ctx.store.add_layer_from_dir(staging, f"git {spec.url} @ {commit} -> {spec.dest}")
        await asyncio.to_thread(fsutil.rmtree, staging)
        return layer

    # No digests of the stack below: the checkout does not depend on it. Nor the URL: the commit
    # names the content wherever it was fetched from; only a kept .git records its origin.
    key = _cache_key("git", commit=commit, dest=spec.dest, keep_git=spec.keep_git, url=url if spec.keep_git else None)
    layer, hit = await ctx.cached(key, build)
    await asyncio.to_thread(fsutil.rmtree, repo)
    return key, layer, hit


# --------------------------------------------------------------------------- apt


async def _step_apt(ctx: _Ctx, i: int, step: Step) -> tuple[str, LayerRef, bool]:
    assert isinstance(step, AptStep)
    key = _cache_key("apt", below=ctx.below(), packages=sorted(step.apt))

    async def build() -> LayerRef:
        store = ctx.store
        native = (await fsutil.run("dpkg", "--print-architecture", what="dpkg --print-architecture")).strip()
        full = ctx.scratch(f"step{i}-apt-full")
        out = ctx.scratch(f"step{i}-apt-layer")
        paths = [store.layer_path(x.digest) for x in ctx.stack]
        async with mounted_layers(paths, ctx.scratch(f"step{i}-apt-lower")) as lower:
            info = await asyncio.to_thread(read_debian_info, lower, native)
            if info is None:
                raise RecipeError(
                    "the stack below is not Debian-based (no /var/lib/dpkg/status or Debian /etc/os-release); "
                    "apt steps need a base such as debian:bookworm or { mmdebstrap = { ... } }"
                )
            # Bootstrap what the stack already has plus the new packages, so the full tree's dpkg
            # database and shared files describe the whole system, then keep only the difference.
            ctx.report(i, "apt", f"mmdebstrap {info.suite} + {', '.join(step.apt)}", 0.1)
            include = sorted(set(info.packages) | set(step.apt))
            await _mmdebstrap(full, info.suite, include=include)
            ctx.report(i, "apt", "diffing against the stack", 0.7)
            await asyncio.to_thread(trim_debian_rootfs, full)
            # Stored layers are id-shifted; shift the full tree alike so the diff compares like
            # with like, then pack without shifting again.
            await asyncio.to_thread(fsutil.shift_ownership, full, store.uid_base)
            stats = await asyncio.to_thread(fsutil.diff_trees, lower, full, out)
        await asyncio.to_thread(drop_whiteouts, out)
        await asyncio.to_thread(fsutil.rmtree, full)
        ctx.report(i, "apt", "mkfs.erofs", 0.85)
        layer = await store.add_layer_from_dir(
            out, f"apt install {' '.join(step.apt)} (+{stats.added} ~{stats.changed})", shift_ids=False
        )
        await asyncio.to_thread(fsutil.rmtree, out)
        return layer

    layer, hit = await ctx.cached(key, build)
    return key, layer, hit


# --------------------------------------------------------------------------- build sandboxes


async def _in_build_sandbox(
    ctx: _Ctx,
    i: int,
    kind: str,
    work: Callable[[AsyncSandbox], Awaitable[None]],
    *,
    exclude: list[str],
    resources: Resources | None,
    lifetime: float,
    description: str,
) -> LayerRef:
    """Run ``work`` in a sandbox on the stack so far and pack its writable layer into a new layer.

    The sandbox is stopped and the temporary pack manifest deleted whatever happens (error,
    cancellation); a sandbox whose create reply was lost is found by its build labels.
    """
    # The stack names no layer twice (_Ctx.push): the daemon takes it as it is, no dedupe rule
    # to agree on, and the packed image must sit on exactly it.
    below = ctx.below()
    if len(below) > MAX_BUILD_LAYERS:
        raise RecipeError(
            f"the stack below has {len(below)} layers; a build sandbox takes at most {MAX_BUILD_LAYERS}: "
            "merge steps (one run step with `&&`, one apt/pip step with several packages)"
        )
    client = ctx.get_client()
    labels = {BUILD_LABEL: ctx.recipe.ref, BUILD_ID_LABEL: ctx.build_id, BUILD_STEP_LABEL: str(i)}
    tmp_ref = f"sandfleet-build/{ctx.build_id}:step{i}"
    sb: AsyncSandbox | None = None
    pack_tried = False
    try:
        ctx.report(i, kind, "starting build sandbox", 0.1)
        sb = await client.create(
            layers=below,
            labels=labels,
            idle_ttl=BUILD_IDLE_TTL,
            max_lifetime=lifetime,
            resources=resources or BUILD_RESOURCES,
        )
        await work(sb)
        ctx.report(i, kind, "packing", 0.8)
        pack_tried = True
        info = await sb.pack(tmp_ref, exclude=exclude)
        if info.layers[:-1] != below:
            raise RecipeError(f"packed image has layers {info.layers[:-1]}, not the stack {below}")
        # The daemon shares this store: its manifest carries the new layer's size.
        try:
            packed = await asyncio.to_thread(ctx.store.resolve, tmp_ref)
        except ImageNotFoundError:
            raise RecipeError(
                f"the daemon packed {tmp_ref}, but it is not in {ctx.store.root}: the daemon must use this layer store"
            ) from None
        top = packed.layers[-1]
        return LayerRef(digest=top.digest, size=top.size, kind="layer", description=description)
    finally:
        await asyncio.shield(_cleanup_sandbox(client, sb, labels, tmp_ref if pack_tried else None))


async def _cleanup_sandbox(
    client: AsyncClient, sb: AsyncSandbox | None, labels: dict[str, str], tmp_ref: str | None
) -> None:
    # Errors here are logged, not raised: they must not mask the step's own outcome, and the
    # short idle_ttl stops a sandbox we failed to stop.
    try:
        if sb is not None:
            await sb.stop(reason="build step done")
        else:
            await client.stop_many(labels, reason="build step aborted")
    except SandboxError as exc:
        log.warning("stopping build sandbox (%s) failed: %s", labels, exc)
    if tmp_ref is not None:
        try:
            await client.delete_image(tmp_ref)
        except SandboxError as exc:
            if exc.code != "not_found":
                log.warning("deleting temporary image %s failed: %s", tmp_ref, exc)


def _check_exec(what: str, result: ExecResult) -> None:
    if result.timed_out:
        raise RecipeError(f"{what} timed out after {result.duration:.0f}s: {_tail(result.stdout, result.stderr)}")
    if result.signal is not None:
        raise RecipeError(f"{what} was killed by signal {result.signal}: {_tail(result.stdout, result.stderr)}")
    if result.exit_code != 0:
        raise RecipeError(f"{what} exited {result.exit_code}: {_tail(result.stdout, result.stderr)}")


# --------------------------------------------------------------------------- run


async def _is_dir(sb: AsyncSandbox, path: str) -> bool:
    """Whether `path` is a directory in the sandbox (following symlinks); True when unsure, so that
    the exec reports what is wrong with it."""
    try:
        return (await sb.files.stat(path, follow_symlinks=True)).type == "dir"
    except NotFoundError:
        return False
    except SandboxError as exc:
        log.debug("stat %s in the build sandbox: %s", path, exc)
        return True


class _Lines:
    """Splits a stream's chunks into lines; keeps the last `keep` characters for error messages."""

    def __init__(self, keep: int = 64 * 1024) -> None:
        self.partial = ""
        self.tail = ""
        self.keep = keep

    def feed(self, data: str) -> list[str]:
        self.tail = (self.tail + data)[-self.keep :]
        *lines, self.partial = (self.partial + data).split("\n")
        return lines

    def flush(self) -> list[str]:
        rest, self.partial = self.partial, ""
        return [rest] if rest else []


async def _exec_streaming(
    ctx: _Ctx, i: int, sb: AsyncSandbox, command: str, *, env: dict[str, str], cwd: str, timeout: float
) -> ExecResult:
    """Run a step's command; with an output callback, streamed to it line by line."""
    if ctx.on_output is None:
        return await sb.exec(command, env=env, cwd=cwd, timeout=timeout, output_limit=1024**2)
    streams = {"stdout": _Lines(), "stderr": _Lines()}
    result: ExecResult | None = None
    async for ev in sb.exec_stream(command, env=env, cwd=cwd, timeout=timeout, output_limit=1024**2):
        if ev.type in streams:
            for line in streams[ev.type].feed(ev.data):
                ctx.output(i, ev.type, line)
        elif ev.type == "exit":
            result = ev.result
    for name, lines in streams.items():
        for line in lines.flush():
            ctx.output(i, name, line)
    if result is None:
        raise RecipeError("the command's output stream ended without its exit status")
    # What streamed is the output; the final event need not repeat it.
    return result.model_copy(update={"stdout": streams["stdout"].tail, "stderr": streams["stderr"].tail})


async def _step_run(ctx: _Ctx, i: int, step: Step) -> tuple[str, LayerRef, bool]:
    assert isinstance(step, RunStep)
    env = {**ctx.env, **step.env}
    cwd = step.cwd or ctx.image_workdir or "/"
    key = _cache_key("run", below=ctx.below(), command=step.run, env=env, cwd=cwd, exclude=step.exclude)

    async def work(sb: AsyncSandbox) -> None:
        ctx.report(i, "run", step.run.splitlines()[0][:80], 0.2)
        # The image's workdir until a step has made it: /, so that a step can make it.
        run_cwd = cwd if step.cwd is not None or cwd == "/" or await _is_dir(sb, cwd) else "/"
        result = await _exec_streaming(ctx, i, sb, step.run, env=env, cwd=run_cwd, timeout=step.timeout)
        _check_exec("command", result)

    async def build() -> LayerRef:
        return await _in_build_sandbox(
            ctx,
            i,
            "run",
            work,
            exclude=step.exclude,
            resources=step.resources,
            lifetime=step.timeout + 600,
            description=f"run: {step.run[:200]}",
        )

    layer, hit = await ctx.cached(key, build)
    return key, layer, hit


# --------------------------------------------------------------------------- pip


async def _step_pip(ctx: _Ctx, i: int, step: Step) -> tuple[str, LayerRef, bool]:
    assert isinstance(step, PipStep)
    # Keyed on the requirement strings, not on what they resolve to today: a warm cache then
    # builds offline and fast. Pin versions (==) to make the result reproducible.
    key = _cache_key("pip", below=ctx.below(), requirements=step.pip)

    async def build() -> LayerRef:
        store = ctx.store
        paths = [store.layer_path(x.digest) for x in ctx.stack]
        async with mounted_layers(paths, ctx.scratch(f"step{i}-pip-lower")) as lower:
            target = await asyncio.to_thread(python_version_in, lower)
            glibc = await asyncio.to_thread(glibc_version_in, lower)
        if target is None:
            raise RecipeError(
                "no python3 in the stack below; use a base such as python:3.11 or an apt step with python3"
            )
        ctx.get_client()  # fail fast, before downloading, if there is no daemon
        host_dir = ctx.scratch(f"step{i}-pip")
        wheels, boot, cwd = host_dir / "wheels", host_dir / "bootstrap", ctx.scratch(f"step{i}-pip-cwd")
        await asyncio.to_thread(cwd.mkdir, parents=True)
        # Wheels only, whatever the image's Python: building an sdist (or a source tree, a VCS
        # URL) runs its setup.py / build backend, which must not happen as root on the node.
        # --only-binary=:all: alone does not stop pip from building a direct URL, even one in a
        # wheel's dependencies; the guard does. Run from an empty directory, so that no name is
        # taken for a file there.
        pip = [sys.executable, "-c", _PIP_GUARD, str(cwd), "--disable-pip-version-check"]
        python = f"{target[0]}.{target[1]}"
        # The image's libc decides which manylinux wheels run in it, not the host's; without a
        # glibc found, pip's default is the host's platform.
        platforms = _manylinux_platforms(glibc, platform.machine()) if glibc else []
        ctx.report(i, "pip", f"fetching wheels for python {python}", 0.1)
        try:
            await fsutil.run(
                *pip, "download", "--quiet", "--only-binary=:all:", "--dest", str(wheels),
                "--python-version", python, "--implementation", "cp",
                "--abi", f"cp{target[0]}{target[1]}", "--abi", "abi3", "--abi", "none",
                *[arg for tag in platforms for arg in ("--platform", tag)],
                "--", *step.pip, what="pip download",
            )  # fmt: skip
        except ImageError as exc:
            where = f"python {python}" + (f", glibc {glibc[0]}.{glibc[1]}" if glibc else "")
            raise RecipeError(f"{exc}\nA requirement without a wheel for {where}? {_WHEELS_ONLY}") from None
        # pip only ever downloads here: anything but wheels would mean the guard failed.
        others = sorted(p.name for p in wheels.iterdir() if not p.name.endswith(".whl"))
        if others:
            raise RecipeError(f"pip download fetched non-wheels {others}: {_WHEELS_ONLY}")
        try:
            # The image need not have pip: the host's pip version, as a wheel, runs straight from
            # the zip (`python3 pip.whl/pip install`) and is not installed into the layer.
            await fsutil.run(
                *pip, "download", "--quiet", "--no-deps", "--only-binary=:all:", "--dest", str(boot),
                f"pip=={metadata.version('pip')}", what="pip download pip",
            )  # fmt: skip
        except ImageError as exc:
            raise RecipeError(str(exc)) from None
        boot_wheel = sorted(p.name for p in boot.glob("pip-*.whl"))
        if not boot_wheel:
            raise RecipeError("pip download pip produced no wheel")

        async def work(sb: AsyncSandbox) -> None:
            ctx.report(i, "pip", "uploading wheels", 0.3)
            await sb.files.upload(host_dir, PIP_DIR)
            ctx.report(i, "pip", f"pip install {' '.join(step.pip)}", 0.4)
            argv = [
                "python3", f"{PIP_DIR}/bootstrap/{boot_wheel[0]}/pip", "install", "--no-index",
                "--find-links", f"{PIP_DIR}/wheels", "--no-cache-dir", "--no-warn-script-location",
                "--root-user-action=ignore", "--disable-pip-version-check", "--", *step.pip,
            ]  # fmt: skip
            # PIP_BREAK_SYSTEM_PACKAGES: Debian marks its Python EXTERNALLY-MANAGED; an image
            # layer is exactly where we do want the packages (other Pythons ignore it).
            # PIP_CONFIG_FILE: a pip.conf in the image (index URLs) would be useless offline.
            env = {**ctx.env, "PIP_BREAK_SYSTEM_PACKAGES": "1", "PIP_CONFIG_FILE": os.devnull}
            result = await sb.exec(argv, env=env, timeout=1800, output_limit=1024**2)
            _check_exec("pip install", result)

        layer = await _in_build_sandbox(
            ctx,
            i,
            "pip",
            work,
            exclude=[PIP_DIR, "/root/.cache"],
            resources=step.resources,
            lifetime=2400,
            description=f"pip install {' '.join(step.pip)}"[:300],
        )
        await asyncio.to_thread(fsutil.rmtree, host_dir)
        return layer

    layer, hit = await ctx.cached(key, build)
    return key, layer, hit


_STEP_BUILDERS: dict[str, Callable[[_Ctx, int, Any], Awaitable[tuple[str, LayerRef, bool]]]] = {
    "apt": _step_apt,
    "pip": _step_pip,
    "copy": _step_copy,
    "git": _step_git,
    "run": _step_run,
}


__all__ = [
    "BUILD_ID_LABEL",
    "BUILD_LABEL",
    "BUILD_STEP_LABEL",
    "AptStep",
    "BuildResult",
    "CopySpec",
    "CopyStep",
    "GitSpec",
    "GitStep",
    "MmdebstrapBase",
    "MmdebstrapSpec",
    "PipStep",
    "Recipe",
    "RecipeError",
    "RunStep",
    "Step",
    "StepResult",
    "build_recipe",
    "hash_tree",
    "prune_build_cache",
]
