"""Projects, tokens and quotas: the IAM core, shared by the node daemon and the cluster gateway.

No I/O and nothing of the node: configuration models, who a request comes from (`Principal`), and
`Iam`, which authenticates an `Authorization` header and decides whether a create fits the quotas
of its project and of every project above it.

The model:

- **Projects** form a tree by path (`org/team/job`). A listed project (`[[iam.projects]]`) may carry a
  quota: live sandboxes, their CPU limits, their memory limits, creates per second. A quota binds
  everything in the project's subtree (a sandbox of `acme/rl/job-17` counts against `acme/rl` and
  `acme` if those are listed). A child is never granted more than any listed ancestor holds, on any
  dimension: such a configuration is refused at load. Children's quotas may add up to more than
  their parent's (they are caps, not reservations): the parent's still binds them all together.
- **Tokens** (`[[iam.tokens]]`) are scoped to a project, or to the root (no project: the whole node or
  cluster), with a role: `admin`, `user` (create and use sandboxes), `read-only` (look, never act). A
  token's project must be a listed project or lie under one, so that no token escapes every quota by
  a typo. Tokens are given in clear (`token`) or as the hex SHA-256 of the secret (`token_sha256`);
  either way only the hash is kept, and a request's token is found by the hash of what it presents.
- A principal **sees** its project's subtree; a root principal sees everything; sandboxes without a
  project are seen by root principals only.
"""

from __future__ import annotations

import contextvars
import hashlib
import math
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from sandfleet.errors import PermissionDeniedError, ResourceExhaustedError, UnauthenticatedError
from sandfleet.models import Alert, ByteSize, ProjectPath, QuotaUse

Role = Literal["admin", "user", "read-only"]

# What a project's live sandboxes hold: (sandboxes, CPU limits, memory limits in bytes), as
# `SandboxTable.project_usage` gives it (per project, not rolled up; '' for none).
Usage = tuple[int, float, int]
UsageMap = Mapping[str, Usage]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@:-]{0,63}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
MIN_TOKEN_LENGTH = 16
_CHAIN_CACHE_MAX = 10_000  # projects named in creates whose quota chain is remembered


class Quota(BaseModel):
    """Caps on what a project's subtree holds at once (None: no cap of its own; its ancestors' still apply)."""

    model_config = ConfigDict(extra="forbid")

    sandboxes: int | None = Field(None, ge=0, description="live sandboxes (creating, running, paused, stopping)")
    cpu: float | None = Field(None, ge=0, description="sum of the live sandboxes' CPU limits (cores)")
    memory: ByteSize | None = Field(None, ge=0, description="sum of the live sandboxes' memory limits ('64GiB')")
    creates_per_second: float | None = Field(
        None, gt=0, description="sandbox creates (and forks, restores) per second, with a burst of one second's worth"
    )

    def bounds(self) -> bool:
        """Whether it caps what is held (sandboxes, CPU or memory)."""
        return self.sandboxes is not None or self.cpu is not None or self.memory is not None


class ProjectConfig(BaseModel):
    """One project of the tree (`[[iam.projects]]`)."""

    model_config = ConfigDict(extra="forbid")

    path: ProjectPath = Field(description="'org', 'org/team', 'org/team/job', ...")
    quota: Quota = Field(default_factory=Quota, description="caps on the project's whole subtree")


class TokenConfig(BaseModel):
    """One API token (`[[iam.tokens]]`): give exactly one of `token` and `token_sha256`."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="who holds it: named in the audit stream and in error messages")
    token: SecretStr | None = Field(None, description=f"the secret itself (at least {MIN_TOKEN_LENGTH} characters)")
    token_sha256: str | None = Field(
        None, description="or the lowercase hex SHA-256 of the secret (the config then holds no secret)"
    )
    project: ProjectPath | None = Field(
        None, description="what it may see and act on: this project's subtree (None: the root, everything)"
    )
    role: Role = Field("user", description="admin, user (create and use sandboxes) or read-only (look only)")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError(f"invalid token name {v[:80]!r}: 1-64 characters of [A-Za-z0-9_.@:-]")
        return v

    @model_validator(mode="after")
    def _one_secret(self) -> TokenConfig:
        if (self.token is None) == (self.token_sha256 is None):
            raise ValueError(f"token {self.name}: give exactly one of token and token_sha256")
        if self.token is not None and len(self.token.get_secret_value()) < MIN_TOKEN_LENGTH:
            raise ValueError(f"token {self.name}: a token needs at least {MIN_TOKEN_LENGTH} characters")
        if self.token_sha256 is not None and not _SHA256_RE.match(self.token_sha256):
            raise ValueError(f"token {self.name}: token_sha256 must be 64 lowercase hex digits")
        return self

    @property
    def sha256(self) -> str:
        """The hex SHA-256 of the secret."""
        if self.token is not None:
            return token_hash(self.token.get_secret_value())
        assert self.token_sha256 is not None
        return self.token_sha256


class IamConfig(BaseModel):
    """Projects, their quotas, and the tokens scoped to them (`[iam]`)."""

    model_config = ConfigDict(extra="forbid")

    projects: list[ProjectConfig] = Field(default_factory=list, description="the project tree, any order")
    tokens: list[TokenConfig] = Field(default_factory=list, description="API tokens, each scoped to a project")

    @model_validator(mode="after")
    def _consistent(self) -> IamConfig:
        quotas: dict[str, Quota] = {}
        for p in self.projects:
            if p.path in quotas:
                raise ValueError(f"project {p.path} is listed twice")
            quotas[p.path] = p.quota
        for path, quota in quotas.items():
            for anc in ancestors(path)[:-1]:
                if anc in quotas:
                    _check_within(path, quota, anc, quotas[anc])
        names: set[str] = set()
        hashes: set[str] = set()
        for t in self.tokens:
            if t.name in names:
                raise ValueError(f"token name {t.name} is used twice")
            names.add(t.name)
            if t.sha256 in hashes:
                raise ValueError(f"token {t.name}: its secret is another token's too")
            hashes.add(t.sha256)
            if t.project is not None and not any(a in quotas for a in ancestors(t.project)):
                raise ValueError(
                    f"token {t.name}: project {t.project} is not listed in [[iam.projects]], nor under a listed one"
                )
        return self


def _check_within(path: str, quota: Quota, anc: str, held: Quota) -> None:
    """A child is never granted more than its ancestor holds."""
    for dim in ("sandboxes", "cpu", "memory", "creates_per_second"):
        mine, theirs = getattr(quota, dim), getattr(held, dim)
        if mine is not None and theirs is not None and mine > theirs:
            raise ValueError(
                f"project {path}: its quota of {_amount(dim, mine)} exceeds what its ancestor {anc} holds "
                f"({_amount(dim, theirs)}): a child is never granted more than its parent"
            )


def exhausted(q: QuotaUse) -> list[tuple[str, float, float]]:
    """The dimensions a project holds all its quota of (its creates are refused): (dim, used, cap)."""
    dims = (
        ("sandboxes", q.sandboxes, q.quota_sandboxes),
        ("cpu", q.cpu, q.quota_cpu),
        ("memory", q.memory, q.quota_memory),
    )
    return [(dim, used, cap) for dim, used, cap in dims if cap is not None and used >= cap]


def quota_alert(q: QuotaUse, dim: str, used: float, cap: float, since: float) -> Alert:
    """The alert that a project is at its quota (`quota_exhausted`: the node's and the gateway's)."""
    what = f"project {q.project} holds {used:g} of its {cap:g} {dim}: its creates are refused"
    labels = {"project": q.project, "dim": dim}
    return Alert(
        name="quota_exhausted", severity="critical", summary=what, labels=labels, value=used, threshold=cap, since=since
    )


def token_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def ancestors(project: str) -> list[str]:
    """'a/b/c' -> ['a', 'a/b', 'a/b/c'] (root-most first, the project itself last)."""
    parts = project.split("/")
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def within(project: str | None, scope: str | None) -> bool:
    """Whether `project` lies in `scope`'s subtree (scope None: the root, which holds everything;
    a sandbox without a project lies in the root's alone)."""
    if scope is None:
        return True
    return project is not None and (project == scope or project.startswith(scope + "/"))


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request comes from: a token's holder, or root on the node's unix socket.

    `named`: False for the two principals that are not a configured token (root's socket, and the
    daemon's single legacy `token`): the audit stream names them as it always did."""

    name: str
    project: str | None
    role: Role
    named: bool = True

    def sees(self, project: str | None) -> bool:
        """Whether a sandbox (snapshot, trajectory) of `project` is visible to this principal."""
        return within(project, self.project)

    @property
    def can_write(self) -> bool:
        """Whether it may act (create, exec, stop, ...); read-only principals only look."""
        return self.role != "read-only"

    @property
    def is_root(self) -> bool:
        """Scoped to the root: sees the whole node (or cluster)."""
        return self.project is None

    @property
    def is_root_admin(self) -> bool:
        """May change what the whole node shares (its image store)."""
        return self.project is None and self.role == "admin"

    def place(self, requested: str | None) -> str | None:
        """The project a new sandbox of this principal goes into: the one asked for if it lies in the
        principal's subtree, its own by default; PermissionDeniedError otherwise."""
        if requested is None:
            return self.project
        if not self.sees(requested):
            raise PermissionDeniedError(
                f"token {self.name} may not create in project {requested}: it holds project {self.project}"
            )
        return requested

    def require_write(self) -> None:
        if self.role == "read-only":
            raise PermissionDeniedError(f"token {self.name} is read-only")

    def require_root(self, doing: str) -> None:
        if self.project is not None:
            raise PermissionDeniedError(
                f"token {self.name} is scoped to project {self.project}: {doing} needs the root"
            )

    def require_root_admin(self, doing: str) -> None:
        if not self.is_root_admin:
            raise PermissionDeniedError(f"token {self.name}: {doing} needs an admin token of the root")

    def actor(self, host: str | None) -> str:
        """How the audit stream names the caller: `token:<name>@<host>`; root's socket is `unix`, the
        daemon's legacy token `token@<host>`."""
        if not self.named:
            return f"token@{host}" if host else "unix"
        return f"token:{self.name}@{host or 'unix'}"


ROOT = Principal("unix", None, "admin", named=False)  # root's unix socket: full control, as always
LEGACY = Principal("token", None, "admin", named=False)  # the daemon's single `token`

# The principal of the request being served: set by the API's authentication, read by tenancy
# (daemon/security/tenancy.py). None outside a request: tenancy then refuses.
CURRENT: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("sandfleet_principal", default=None)


def current() -> Principal:
    p = CURRENT.get()
    if p is None:
        raise UnauthenticatedError("no authenticated caller")
    return p


def _credential(header: str) -> str | None:
    """The token an Authorization header carries: `Bearer <token>`, or HTTP Basic with the token as
    the password (clients that only take a URL: `http://any:<token>@node:8600/run_code`)."""
    if header.startswith("Bearer "):
        return header[7:]
    if header.startswith("Basic "):
        import base64
        import binascii

        try:
            _, _, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError, binascii.Error):
            return None
        return password
    return None


class Iam:
    """Authentication and quotas over an `IamConfig` (and the daemon's legacy single token).

    Not thread-safe; meant for one event loop. Quota checks keep no state: the caller passes what is in
    use. Rate buckets are this object's own (a gateway's share of the rate: `share`)."""

    def __init__(self, config: IamConfig | None = None, legacy_token: str | None = None) -> None:
        self.config = config or IamConfig()
        self.quotas: dict[str, Quota] = {p.path: p.quota for p in self.config.projects}
        self._by_hash: dict[str, Principal] = {}
        if legacy_token:
            self._by_hash[token_hash(legacy_token)] = LEGACY
        for t in self.config.tokens:
            if t.sha256 in self._by_hash:
                raise ValueError(f"token {t.name}: its secret is the daemon's `token` too")
            self._by_hash[t.sha256] = Principal(t.name, t.project, t.role)
        self._chains: dict[str, tuple[tuple[str, Quota], ...]] = {}
        self._buckets: dict[str, list[float]] = {}  # project -> [tokens, last refill (monotonic)]

    @property
    def scoped(self) -> bool:
        """Whether anything is scoped or capped (projects or tokens configured): without, every
        principal is a root admin and the node needs no scoping."""
        return bool(self.config.projects or self.config.tokens)

    # -- authentication --------------------------------------------------------------------------

    def authenticate(self, authorization: str) -> Principal:
        """The principal an Authorization header's token stands for; UnauthenticatedError if none.
        One SHA-256 and one dict lookup: the secret itself is never compared."""
        secret = _credential(authorization)
        p = self._by_hash.get(token_hash(secret)) if secret else None
        if p is None:
            raise UnauthenticatedError("missing or invalid bearer token")
        return p

    def enter(self, authorization: str, anonymous: Principal | None = None) -> Principal:
        """`authenticate`, and make the principal the current one of this context (`CURRENT`).
        `anonymous`: the principal of a request without an Authorization header (root's unix socket);
        None: such a request is refused."""
        p = anonymous if not authorization and anonymous is not None else self.authenticate(authorization)
        CURRENT.set(p)
        return p

    # -- quotas ----------------------------------------------------------------------------------

    def chain(self, project: str | None) -> tuple[tuple[str, Quota], ...]:
        """The listed projects `project` counts against, with their quotas: itself first, then its
        ancestors up to the top (those listed only)."""
        if project is None:
            return ()
        got = self._chains.get(project)
        if got is None:
            got = tuple((a, self.quotas[a]) for a in reversed(ancestors(project)) if a in self.quotas)
            if len(self._chains) >= _CHAIN_CACHE_MAX:
                self._chains.clear()
            self._chains[project] = got
        return got

    def bounded(self, project: str | None) -> bool:
        """Whether a create in `project` meets any cap on what is held (sandboxes, CPU, memory)."""
        return any(q.bounds() for _, q in self.chain(project))

    def rated(self, project: str | None) -> bool:
        """Whether a create in `project` meets any creates-per-second quota."""
        return any(q.creates_per_second is not None for _, q in self.chain(project))

    def rollup(self, usage: UsageMap, projects: tuple[str, ...]) -> dict[str, list[float]]:
        """What each of `projects` holds, its whole subtree counted, from per-project usage."""
        wanted = set(projects)
        out: dict[str, list[float]] = {p: [0, 0.0, 0] for p in projects}
        for key, (n, cpu, mem) in usage.items():
            if not key:
                continue
            for anc in ancestors(key):
                if anc in wanted:
                    row = out[anc]
                    row[0] += n
                    row[1] += cpu
                    row[2] += mem
        return out

    def uses(self, usage: UsageMap, projects: Iterable[str | None] | None = None) -> list[QuotaUse]:
        """The quotas `projects` count against (None: every listed project's that caps what is held),
        each with what its whole subtree holds, from per-project `usage`."""
        if projects is None:
            paths = {path for path, q in self.quotas.items() if q.bounds()}
        else:
            paths = {path for p in projects for path, q in self.chain(p) if q.bounds()}
        held = self.rollup(usage, tuple(sorted(paths)))
        out = []
        for path in sorted(paths):
            q = self.quotas[path]
            n, cpu, mem = held[path]
            out.append(
                QuotaUse(
                    project=path,
                    sandboxes=int(n),
                    cpu=round(cpu, 6),
                    memory=int(mem),
                    quota_sandboxes=q.sandboxes,
                    quota_cpu=q.cpu,
                    quota_memory=None if q.memory is None else int(q.memory),
                )
            )
        return out

    def check_create(
        self,
        project: str | None,
        cpu: float,
        memory: int,
        usage: UsageMap,
        *,
        count: int = 1,
        share: float = 1.0,
        baseline: UsageMap | None = None,
    ) -> None:
        """Whether `count` sandboxes of `cpu` and `memory` each fit in `project` and each listed
        ancestor; ResourceExhaustedError naming the first project (the innermost) whose quota they
        do not fit in.

        `usage`: per project (not rolled up: '' and every project on its own, as
        `SandboxTable.project_usage` gives it) what the caller counts as held, its own in-flight
        creates included. For every capped dimension of every project on the path, with U its
        rolled-up usage, B its rolled-up `baseline` (default: nothing) and Q its quota, the create is
        allowed when

            U + request <= B + share * (Q - B)

        so `share=1, baseline=None` is the plain rule `U + request <= Q` (a node). A gateway that
        knows the cluster's usage `B` as of its last refresh and counts `U = B + what it placed since`
        may take `share` of the headroom left then: with the shares of all gateways summing to 1 the
        quota is never exceeded, however stale `B` is. (With `baseline=None` and `share < 1`, each
        of n gateways gets a fixed `share = 1/n` of the quota and counts only its own.)"""
        chain = self.chain(project)
        if not chain or not any(q.bounds() for _, q in chain):
            return
        paths = tuple(p for p, q in chain if q.bounds())
        used = self.rollup(usage, paths)
        base = self.rollup(baseline, paths) if baseline is not None else None
        asked = (count, cpu * count, memory * count)
        for path in paths:
            q = self.quotas[path]
            for i, dim in enumerate(("sandboxes", "cpu", "memory")):
                limit = getattr(q, dim)
                if limit is None:
                    continue
                b = base[path][i] if base is not None else 0
                allowed = b + share * (limit - b)
                if used[path][i] + asked[i] > allowed + 1e-9:
                    raise ResourceExhaustedError(_refusal(path, dim, limit, used[path][i], asked[i], share))

    def take_create(self, project: str | None, count: int = 1, *, share: float = 1.0, now: float | None = None) -> None:
        """Take `count` creates from the creates-per-second quota of `project` and every listed
        ancestor, or ResourceExhaustedError naming the first (innermost) project refusing.

        A token bucket per project, refilled at `share * creates_per_second` and holding at most one
        second's worth (at least 1). A request is let through when every bucket on its path holds at
        least one create; it then takes `count` from each, going into debt that later requests wait
        out: the long-run rate holds, and a batch or fork is never refused for its size alone.
        Nothing is taken when any bucket refuses."""
        chain = self.chain(project)
        if not chain:
            return
        t = time.monotonic() if now is None else now
        rows: list[list[float]] = []
        for path, q in chain:
            if q.creates_per_second is None:
                continue
            rate = q.creates_per_second * share
            burst = max(1.0, rate)
            row = self._buckets.get(path)
            if row is None:
                row = self._buckets[path] = [burst, t]
            row[0] = min(burst, row[0] + max(0.0, t - row[1]) * rate)
            row[1] = t
            if row[0] < 1.0 - 1e-9:
                shown_share = f", this gateway's share {share:g}" if share != 1.0 else ""
                raise ResourceExhaustedError(
                    f"project {path}: quota of {q.creates_per_second:g} creates per second reached{shown_share}"
                )
            rows.append(row)
        for row in rows:
            row[0] -= count


def _refusal(path: str, dim: str, limit: float, used: float, asked: float, share: float) -> str:
    shown_share = f", this gateway's share {share:g}" if share != 1.0 else ""
    if dim == "sandboxes":
        return f"project {path}: quota of {int(limit)} sandboxes reached ({int(used)} in use{shown_share})"
    plain = _bytes if dim == "memory" else (lambda v: f"{round(v, 3):g}")
    return (
        f"project {path}: quota of {_amount(dim, limit)} reached "
        f"({plain(used)} in use, {plain(asked)} more asked{shown_share})"
    )


def _amount(dim: str, value: float) -> str:
    if dim == "memory":
        return f"{_bytes(value)} memory"
    if dim == "cpu":
        return f"{round(value, 3):g} CPUs"
    if dim == "creates_per_second":
        return f"{value:g} creates per second"
    return f"{int(value)} {dim}"


def _bytes(n: float) -> str:
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.0f}{unit}" if math.isclose(v, round(v)) else f"{v:.2f}{unit}"
    return f"{int(n)}B"
