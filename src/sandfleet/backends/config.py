"""One configuration model per isolation tier, told apart by `type` (pure pydantic: loading a config
imports no tier's code; backends/tiers.py builds a tier's backend from its model).

A node runs the tiers its config lists (`[[backends]]` tables in the daemon's TOML, one per tier);
`SandboxSpec.backend` picks one per sandbox. Adding a tier means a folder under backends/, one config
model here (added to `BackendConfig`), and one branch in `tiers.build_backend`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ByteSize, ConfigDict, Field

from sandfleet.runtime.criu import DEFAULT_ROOT as CRIU_ROOT


class ContainerBackendConfig(BaseModel):
    """Settings of the container tier: namespaces, cgroups, seccomp, an overlay of EROFS layers."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["container"] = Field("container", description="the tier this configures")
    runtime: Literal["launcher", "crun", "runc"] = Field(
        "launcher",
        description="what starts a sandbox: sandfleet's own launcher (same isolation, ~10x faster) or an OCI runtime",
    )
    uid_base: int = Field(100000, ge=1, description="host uid/gid that root inside a sandbox maps to")
    cgroup_parent: str = Field("/sandfleet", description="cgroup under which sandbox cgroups are made")
    start_timeout: float = Field(20.0, gt=0, description="seconds to wait for the runtime and agent")
    mount_allowlist: list[str] = Field(
        default_factory=list, description="host directories whose subpaths sandboxes may bind-mount"
    )
    criu_root: Path = Field(
        CRIU_ROOT, description="where criu 4.x and its own libraries live (snapshot, restore, fork)"
    )


class VMBackendConfig(BaseModel):
    """Settings shared by the two QEMU tiers: `microvm` (QEMU's microvm machine, virtio-mmio, no
    firmware) and `vm` (q35 with PCI and ACPI, a copy-on-write disk, the image's own kernel if it has one)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["microvm", "vm"] = Field(description="the tier this configures")
    qemu: str = Field("qemu-system-x86_64", description="the QEMU binary (Debian's qemu-system-x86)")
    accel: Literal["auto", "kvm", "tcg"] = Field(
        "auto", description="auto: KVM when /dev/kvm runs a standard guest (probed once), else TCG"
    )
    guest_dir: Path = Field(
        Path("/opt/sandfleet/guest"), description="the guest kernel and its modules, unpacked by setup from Debian"
    )
    vcpus: int = Field(1, ge=1, le=64, description="vCPUs per VM when the spec's cpu limit does not say more")
    min_memory: ByteSize = Field(
        ByteSize(128 * 1024**2), ge=64 * 1024**2, description="guest RAM floor, bytes or '128MiB'"
    )
    tcg_cache_mib: int = Field(32, ge=8, description="TCG translation cache per VM (QEMU's default is 1 GiB)")
    uid_base: int = Field(100000, ge=1, description="uid that root inside the guest's sandbox maps to (in the guest)")
    jail_uid_base: int = Field(
        3_000_000, ge=1000, description="first host uid QEMU processes run as (one per live VM, never root)"
    )
    cgroup_parent: str = Field("/sandfleet-vm", description="cgroup under which each QEMU's cgroup is made")
    start_timeout: float = Field(120.0, gt=0, description="seconds for QEMU to boot and the agent to say hello")
    templates: bool = Field(
        True,
        description="a create restores a booted template of its image (built by the first create), "
        "guest memory shared copy-on-write, instead of booting; microvm forks share the snapshot's memory",
    )


class FncallBackendConfig(BaseModel):
    """Settings of the fncall tier: stateless calls forked from warm interpreters in pooled containers."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["fncall"] = Field("fncall", description="the tier this configures")
    workers: int = Field(4, ge=1, le=256, description="warm workers kept per (image, resources) pool")
    max_workers: int = Field(16, ge=1, le=4096, description="most workers alive per pool at once")
    worker_idle: float = Field(300.0, gt=0, description="seconds an idle worker above `workers` lives")
    preload: list[str] = Field(
        default_factory=list, description="Python modules every worker imports once, before forking calls"
    )
    cgroup_parent: str = Field(
        "/sandfleet-fncall", description="cgroup parent of the workers, when the node runs no container tier"
    )


# One member per tier.
BackendConfig = Annotated[
    Union[ContainerBackendConfig, VMBackendConfig, FncallBackendConfig],  # noqa: UP007
    Field(discriminator="type"),
]
