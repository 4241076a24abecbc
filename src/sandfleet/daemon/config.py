"""Daemon configuration (one pydantic model; loadable from TOML, overridable by CLI flags)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sandfleet.backends.config import BackendConfig, ContainerBackendConfig, FncallBackendConfig
from sandfleet.daemon.net.policy import NetworkConfig
from sandfleet.daemon.node.alerts import AlertsConfig
from sandfleet.daemon.node.pool import PoolConfig
from sandfleet.daemon.rl.trajectories import TrajectoryConfig
from sandfleet.daemon.rl.verify import VerifyConfig
from sandfleet.daemon.security.detectors import DetectorsConfig
from sandfleet.daemon.security.iam import IamConfig, token_hash
from sandfleet.models import LABEL_KEY, ByteSize

DEFAULT_SOCKET = Path("/run/sandfleet/sandfleet.sock")


def _default_tiers() -> list[BackendConfig]:
    return [ContainerBackendConfig(), FncallBackendConfig()]


class AuditConfig(BaseModel):
    """The node's audit stream (`[audit]`)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="keep the audit stream (GET /v1/audit)")
    dir: Path | None = Field(None, description="where its files go (default <state_dir>/audit)")
    max_bytes: ByteSize = Field(64 * 1024**2, description="retention: the oldest records go past this size")


class JobsConfig(BaseModel):
    """What an operator watches (`[jobs]`): the jobs' figures and the alerts."""

    model_config = ConfigDict(extra="forbid")

    label: str = Field(
        "job",
        pattern=LABEL_KEY.pattern,
        description="the label whose values are the jobs the node counts figures of (GET /v1/jobs/{job})",
    )
    alerts: AlertsConfig = Field(default_factory=AlertsConfig, description="when the node's alerts fire")


class DaemonConfig(BaseModel):
    """Settings of `sandfleet serve`."""

    model_config = ConfigDict(extra="forbid")

    state_dir: Path = Field(Path("/var/lib/sandfleet"), description="SQLite state, images, agent build")
    run_dir: Path = Field(Path("/run/sandfleet"), description="per-boot runtime files (mount points)")
    socket: Path = Field(DEFAULT_SOCKET, description="unix socket the API listens on (mode 0600)")
    tcp: str | None = Field(
        None, description="optional HOST:PORT to also listen on; requires `token` or tokens in `[iam]`"
    )
    token: str | None = Field(
        None,
        description="bearer token required on TCP (the socket is protected by mode 0600): an admin of the whole "
        "node, like root's socket",
    )
    iam: IamConfig | None = Field(
        None,
        description="projects, their quotas, and tokens scoped to them with roles (`[[iam.projects]]`, "
        "`[[iam.tokens]]`); see docs/architecture.md, 'Projects, tokens and quotas'",
    )
    image_dir: Path | None = Field(None, description="layer store root; default <state_dir>/images")
    shared_image_dir: Path | None = Field(
        None,
        description="a shared layer store (NFS, CephFS, ... mount) to use images from in place: their metadata "
        "is copied here, their file data read on demand (`sandfleet images push` publishes to it)",
    )
    import_dirs: list[Path] | None = Field(
        None,
        description="directories `images import` may read archives from (None: any path on the node; the API "
        "is root's socket or a bearer token, both in full control of the node)",
    )
    image_cache_max: ByteSize | None = Field(
        None, description="cap on the local copies of shared-store layers; least recently used unused ones go"
    )
    max_sandboxes: int = Field(10000, ge=1, description="admission limit: running sandboxes on this node")
    node_key: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{6}$",
        description="this node's key in sandbox and snapshot ids (6 hex digits); default: made once and kept "
        "in <state_dir>/node_key. Keys must differ across a cluster",
    )
    node_group: str = Field(
        "default",
        pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$",
        description="cluster mode: the node group (e.g. on-prem, burst) placement fills before spilling over",
    )
    node_labels: dict[str, str] = Field(
        default_factory=dict, description="cluster mode: labels a create may require of its node"
    )
    cpu_overcommit: float = Field(
        32.0, gt=0, description="admit while the sum of CPU requests stays under this many times the node's CPUs"
    )
    max_cpu_load: float | None = Field(
        0.95,
        gt=0,
        description="refuse creates while latency-sensitive sandboxes use more than this share of the node's "
        "CPUs (best-effort ones yield, so they do not count); none disables",
    )
    memory_overcommit: float = Field(
        16.0, gt=0, description="admit while the sum of memory limits stays under this many times MemTotal"
    )
    min_available_memory: ByteSize = Field(256 * 1024**2, description="refuse creates while MemAvailable is lower")
    max_task_fraction: float = Field(0.9, gt=0, le=1, description="refuse creates above this share of pid_max in use")
    stopped_retention: float = Field(300.0, ge=0, description="seconds a stopped sandbox stays listable")
    reaper_interval: float = Field(1.0, gt=0, description="seconds between TTL sweeps")
    claim_window: float = Field(
        120.0,
        gt=0,
        description="seconds a sandbox whose create answer never reached its caller (unacknowledged: a "
        "gateway or client that died) lives before it is stopped, unless a retry of its create or a call "
        "naming it claims it first",
    )
    build_missing_images: bool = Field(True, description="build a built-in image on first use")
    pools: list[PoolConfig] = Field(default_factory=list, description="warm pools kept ready")
    pool_adaptive_max: int = Field(
        0, ge=0, le=10000, description="extra warm sandboxes per image+shape, sized to the recent create rate"
    )
    pool_refill_concurrency: int = Field(2, ge=1, le=64, description="pool creates in flight at once")
    snapshot_dir: Path | None = Field(
        None,
        description="where snapshots are kept (default <state_dir>/snapshots); a directory shared by nodes "
        "lets any of them restore a snapshot (same agent build and uid_base)",
    )
    snapshot_retention: float | None = Field(
        None, gt=0, description="seconds a snapshot is kept unless its own ttl says otherwise (None: until deleted)"
    )
    snapshot_max_bytes: ByteSize | None = Field(
        None, description="disk the node's snapshots may use in all; past it, new snapshots are refused"
    )
    checkpoint_standbys: bool = Field(
        True,
        description="restore a sandbox's latest checkpoint ahead of a rollback (kept frozen, while the node "
        "keeps a quarter of its memory available): a rollback to it is then a swap of a few ms, not a restore; "
        "costs a restore's CPU per checkpoint taken or rolled back to, and its memory until used",
    )
    ksm: bool = Field(
        True,
        description="let restored and forked sandboxes share their identical memory pages (KSM): children of "
        "one snapshot then cost little more than one; the kernel's ksmd scans them (its CPU is capped)",
    )
    cgroup_favordynmods: bool = Field(
        True,
        description="give the host's cgroup2 root the kernel's favordynmods option (Linux >= 6.0): a create "
        "after an idle spell then waits for no RCU grace period when its first process joins its cgroups "
        "(15 ms on some hosts); every fork and exit on the host pays a memory barrier more",
    )
    zram_size: ByteSize | None = Field(
        None,
        description="compressed swap the daemon sets up for paused sandboxes when the host has no swap "
        "(default: a quarter of MemTotal; 0 disables)",
    )
    network: NetworkConfig = Field(
        default_factory=NetworkConfig, description="egress: named services, the proxy's resolver and limits"
    )
    trajectories: TrajectoryConfig = Field(
        default_factory=TrajectoryConfig,
        description="RL trajectories: the step log's durability, idle pause, retention",
    )
    verify: VerifyConfig = Field(
        default_factory=VerifyConfig, description="verification: the CPUs its checks may hold at once"
    )
    detectors: DetectorsConfig = Field(
        default_factory=DetectorsConfig, description="misbehaviour detectors: thresholds, and record, pause or kill"
    )
    audit: AuditConfig = Field(default_factory=AuditConfig, description="the audit stream")
    jobs: JobsConfig = Field(default_factory=JobsConfig, description="the jobs' figures and the alerts")
    metrics_per_sandbox: bool = Field(
        False,
        description="also export a series per sandbox on /metrics (memory, CPU, tasks); off, the usage is "
        "added up by state and QoS class, so a scrape stays small at 10,000 sandboxes",
    )
    monitor_interval: float = Field(
        5.0, gt=0, le=3600, description="seconds between sweeps of sandbox counters for the detectors"
    )
    backends: list[BackendConfig] = Field(
        default_factory=_default_tiers,
        min_length=1,
        description="the isolation tiers this node runs, one `[[backends]]` table each (`type` = container, fncall, "
        "microvm, vm); the first is the default of the warm pools. Default, and with a `[container]` table: "
        "container and fncall (whose workers are made by the container tier)",
    )

    @model_validator(mode="before")
    @classmethod
    def _container_table(cls, data: object) -> object:
        """A `[container]` table (the one-tier form) is the container entry of `backends`."""
        if isinstance(data, dict) and "container" in data:
            data = dict(data)
            container = {"type": "container", **data.pop("container")}
            if "backends" in data:
                raise ValueError("give the container tier's settings in [container] or in [[backends]], not both")
            data["backends"] = [container, {"type": "fncall"}]
        return data

    @model_validator(mode="after")
    def _tcp_needs_token(self) -> DaemonConfig:
        if self.tcp and not self.token and not (self.iam is not None and self.iam.tokens):
            raise ValueError("listening on TCP requires a bearer token (token = ..., or [[iam.tokens]])")
        if self.token and self.iam is not None:
            legacy = token_hash(self.token)
            for t in self.iam.tokens:
                if t.sha256 == legacy:
                    raise ValueError(f"[[iam.tokens]] {t.name}: its secret is the daemon's `token` too")
        if self.shared_image_dir is not None and "," in str(self.shared_image_dir):
            raise ValueError("shared_image_dir must not contain a comma (it goes into mount options)")
        tiers = [b.type for b in self.backends]
        if len(set(tiers)) != len(tiers):
            raise ValueError(f"each tier may be configured once (backends: {tiers})")
        return self

    @property
    def container(self) -> ContainerBackendConfig:
        """The container tier's settings (its defaults when the node does not run it)."""
        return next((b for b in self.backends if isinstance(b, ContainerBackendConfig)), ContainerBackendConfig())

    @property
    def images_root(self) -> Path:
        return self.image_dir or self.state_dir / "images"

    @classmethod
    def load(cls, path: Path | None, **overrides: object) -> DaemonConfig:
        data: dict[str, object] = {}
        if path is not None:
            data = tomllib.loads(path.read_text())
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(data)
