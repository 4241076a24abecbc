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

import os
import posixpath
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal
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

from sandfleet.models import AbsPath, EnvVars, Resources, UserName

from .builders import DEBIAN_SUITE
from .models import (
    DIGEST_RE,
    ImageError,
    InvalidRefError,
    canonical_ref,
)

# Bump when the meaning of a cache key's inputs changes, so old entries stop matching.
CACHE_VERSION = 1
STEP_KINDS = ("apt", "pip", "copy", "git", "run")
# At most this many layers under a build sandbox (SandboxSpec.layers' max_length, the daemon's
# MAX_LAYERS: one overlay's mount options must fit a page).
MAX_BUILD_LAYERS = 32


class RecipeError(ImageError):
    """A recipe is invalid or one of its steps failed; the message says which step and why."""


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


def _is_url(url: str) -> bool:
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", url) or re.match(r"^[^/:]+@[^/:]+:", url))


__all__ = [
    "AptStep",
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
]
