"""One configuration model per isolation tier, told apart by `type` (pure pydantic: loading a config
imports no tier's code; backends/registry.py builds a tier from its model).

A node runs the tiers its config lists (`[[backends]]` tables in the daemon's TOML, one per tier);
`SandboxSpec.backend` picks one per sandbox. Adding a tier means a folder under backends/, one config
model here (added to `BackendConfig`), and one branch in `registry.build_backend`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

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


# The union grows by one member per tier (microvm, vm, fncall).
BackendConfig = Annotated[Union[ContainerBackendConfig], Field(discriminator="type")]  # noqa: UP007
