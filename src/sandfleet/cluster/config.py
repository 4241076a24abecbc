"""The gateway's configuration: where it listens, how it finds nodes, who may call it.

One TOML file (`sandfleet gateway --config gateway.toml`). Nodes come from Ray (`ray_address`), or
from a fixed list (`nodes`) for a cluster without Ray; the two do not mix.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from sandfleet.daemon.security.iam import IamConfig


class StaticNode(BaseModel):
    """A node of a cluster without Ray: its key and where its API listens."""

    model_config = ConfigDict(extra="forbid")

    key: str = Field(pattern=r"^[0-9a-f]{6}$", description="the node's key (its `node_key`)")
    url: str = Field(description="the node's API, e.g. http://10.0.0.7:8600")
    group: str = Field("default", description="its node group")


class GatewayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    listen: str = Field("127.0.0.1:8600", description="HOST:PORT the gateway's HTTP API listens on")
    advertise: str | None = Field(
        None, description="the URL clients reach this gateway at (registered in Ray); default http://<listen>"
    )
    ray_address: str | None = Field(
        None, description="the Ray cluster to find nodes in ('auto', or HEAD:PORT); None: use `nodes`"
    )
    ray_namespace: str = Field("sandfleet", description="the Ray namespace nodes and gateways register in")
    nodes: list[StaticNode] = Field(default_factory=list, description="nodes of a cluster without Ray")
    node_token: SecretStr = Field(
        description="a token every node accepts as a root admin: the gateway reads nodes' load and drains "
        "them with it (callers' own tokens are passed on for everything they ask)"
    )
    token: SecretStr | None = Field(None, description="a root admin token for callers (as a node's `token`)")
    iam: IamConfig | None = Field(None, description="projects, tokens and quotas: the same table the nodes have")
    groups: list[str] = Field(
        default_factory=lambda: ["default"],
        description="node groups in spill-over order: creates go to the first group with room",
    )
    load_interval: float = Field(1.0, gt=0, le=60, description="seconds between reads of each node's load")
    unreachable_after: int = Field(
        3, ge=1, description="failed load reads in a row after which a node takes no creates"
    )
    lost_after: float = Field(
        60.0,
        ge=5,
        description="seconds a node's daemon may not answer on its own machine (its Ray node alive) before "
        "the cluster gives up on it as on a dead node: its ids answer sandbox_lost, `cluster up` fences it",
    )
    node_connections: int = Field(
        256, ge=1, le=65536, description="connections to each node for callers' calls passed on (streams hold one)"
    )
    create_attempts: int = Field(3, ge=1, le=10, description="nodes a refused create is tried on")
    choices: int = Field(2, ge=1, le=8, description="nodes compared per placement (power of d choices)")

    @model_validator(mode="after")
    def _one_source(self) -> GatewayConfig:
        if self.ray_address and self.nodes:
            raise ValueError("give either ray_address or nodes, not both")
        if not self.ray_address and not self.nodes:
            raise ValueError("the gateway needs nodes: ray_address or a nodes list")
        if not self.iam and not self.token:
            raise ValueError("the gateway needs callers' credentials: token or [iam] tokens")
        host = self.listen.rpartition(":")[0]
        if self.ray_address and not self.advertise and host in ("", "0.0.0.0", "::", "[::]"):
            raise ValueError(f"listening on {self.listen}: say where clients reach this gateway (advertise = ...)")
        return self

    @property
    def url(self) -> str:
        return self.advertise or f"http://{self.listen}"


def load_gateway_config(path: Path) -> GatewayConfig:
    return GatewayConfig.model_validate(tomllib.loads(path.read_text()))
