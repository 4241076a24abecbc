"""Every operation of the HTTP API, declared once.

An `Operation` says what a call is: its name, method(s) and path, what it names and so how it is
scoped (`scope`), what the caller must be allowed (`access`), its answer's model and status, and how a
cluster gateway serves it. The rest is read from this table:
- the node's routes (daemon/api/): each handler is registered by `Api.route(router, name)`, which
  takes the method, path, answer and status from here and, with `[iam]` projects configured, adds the
  project scoping as a route dependency (`Tenancy.admit`, daemon/security/tenancy.py) made from
  `scope` and `access`; a declared operation without a handler, or a handler registered twice, stops
  the app from being made;
- the OpenAPI document (FastAPI derives it from those routes; docs/openapi.json is checked against it);
- the cluster gateway's routes (cluster/gateway.py): one per operation, to the gateway handler
  `gateway` names, or by default the one of its scope (a call on a sandbox goes to the node holding it).

How to add an operation: a line here, a handler in the router of its resource calling the concern
module that does the work, tests, and the docs; docs/architecture.md has the recipe.

Plain data, importable by the SDK's side as much as by the daemon and the gateway (pydantic models).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import quote

from pydantic import BaseModel

from sandfleet import models as m

# What an operation names, which decides how it is scoped to the caller's project and where a gateway
# sends it:
# - sandbox / snapshot / trajectory: one of the caller's (its path names it); another project's answers
#   not_found, word for word as one that does not exist; a gateway sends it to the node holding it;
# - placed: makes sandboxes or runs a call somewhere (in the caller's project, within its quotas);
# - fanned_out: over everything the caller sees (lists, label-wide calls); a gateway asks every node;
# - node: about the node itself.
Scope = Literal["sandbox", "snapshot", "trajectory", "placed", "fanned_out", "node"]
# What the caller must be: anyone who may read, one who may act, the root (node-wide data), or an admin
# of the root (node-wide changes).
Access = Literal["read", "write", "root", "admin"]

# A gateway's handler when an operation names none: that of its scope.
GATEWAY_DEFAULT: dict[str, str] = {
    "sandbox": "sandbox_call",
    "snapshot": "snapshot_call",
    "trajectory": "trajectory_call",
}


@dataclass(frozen=True)
class Operation:
    name: str  # unique
    methods: tuple[str, ...]
    path: str  # as the node's router declares it (`{ref:path}`: a parameter holding slashes)
    scope: Scope
    access: Access
    answer: type[BaseModel] | None = None  # None: a response class of its own (a stream, bytes)
    status: int = 200
    gateway: str = ""  # the gateway's handler ("" : its scope's); "node_only": not passed on, see `why`
    needs: str = ""  # root/admin: what needs the root (the refusal says it)
    why: str = ""  # gateway "node_only": why a gateway does not pass it on
    handler: str = ""  # the route's name when not `name` (FastAPI's operationId starts with it)

    def path_of(self, **params: str) -> str:
        """The path with its parameters filled in (each value quoted: it is one segment)."""
        return self.path.format(**{k: quote(v, safe="") for k, v in params.items()})

    @property
    def route_name(self) -> str:
        return self.handler or self.name

    @property
    def gateway_handler(self) -> str:
        return self.gateway or GATEWAY_DEFAULT.get(self.scope, "")

    @property
    def writes(self) -> bool:
        return self.access in ("write", "admin")


def _op(
    name: str,
    method: str | tuple[str, ...],
    path: str,
    scope: Scope,
    access: Access,
    answer: type[BaseModel] | None = None,
    **more: object,
) -> Operation:
    methods = (method,) if isinstance(method, str) else method
    return Operation(name, methods, path, scope, access, answer, **more)  # type: ignore[arg-type]


SB = "/v1/sandboxes/{sandbox_id}"
TRAJ = "/v1/trajectories/{trajectory_id}"
_AUDIT = "reading the node's audit stream"
PROXY_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")

OPERATIONS: tuple[Operation, ...] = (
    # -- the node ---------------------------------------------------------------------------------
    _op("health", "GET", "/v1/health", "node", "read", m.Health, gateway="health"),
    _op("whoami", "GET", "/v1/whoami", "node", "read", m.WhoAmI, gateway="whoami"),
    _op("prometheus", "GET", "/metrics", "node", "root", needs="the node's metrics", gateway="prometheus"),
    _op(
        "load",
        "GET",
        "/v1/node/load",
        "node",
        "root",
        m.NodeLoad,
        needs="the node's load",
        gateway="node_only",
        why="read by the gateways from each node; through a gateway, GET /v1/cluster/nodes",
    ),
    _op(
        "drain",
        "POST",
        "/v1/node/drain",
        "node",
        "admin",
        m.NodeLoad,
        needs="draining the node",
        gateway="node_only",
        why="one node's switch: through a gateway, POST /v1/cluster/nodes/{key}/drain",
    ),
    _op(
        "fence",
        "POST",
        "/v1/node/fence",
        "node",
        "admin",
        m.NodeLoad,
        needs="fencing the node",
        gateway="node_only",
        why="sent by `sandfleet cluster up` to a node that rejoins, to that node alone",
    ),
    _op(
        "ack",
        "POST",
        "/v1/sandboxes/ack",
        "node",
        "write",
        m.Ok,
        gateway="node_only",
        why="a gateway's own call to the node that made a sandbox",
    ),
    _op(
        "keys",
        "POST",
        "/v1/sandboxes/keys",
        "node",
        "write",
        m.KeysHeld,
        gateway="node_only",
        why="a gateway's own call to the nodes, to find where a key made its sandbox",
    ),
    _op("audit", "GET", "/v1/audit", "fanned_out", "root", m.AuditList, gateway="audit", needs=_AUDIT),
    _op(
        "follow_audit",
        "GET",
        "/v1/audit/follow",
        "node",
        "root",
        needs=_AUDIT,
        gateway="node_only",
        why="a node's own stream: follow each node (GET /v1/cluster/nodes), or page GET /v1/audit",
    ),
    # -- sandboxes --------------------------------------------------------------------------------
    _op("create", "POST", "/v1/sandboxes", "placed", "write", m.SandboxInfo, status=201, gateway="create"),
    _op("create_batch", "POST", "/v1/sandboxes/batch", "placed", "write", m.CreateBatchResult, gateway="create_batch"),
    _op("list_sandboxes", "GET", "/v1/sandboxes", "fanned_out", "read", m.SandboxList, gateway="list_sandboxes"),
    _op("jobs", "GET", "/v1/jobs", "fanned_out", "read", m.JobList, gateway="jobs"),
    _op("job_stats", "GET", "/v1/jobs/{job:path}", "fanned_out", "read", m.JobStats, gateway="job_stats"),
    _op("alerts", "GET", "/v1/alerts", "fanned_out", "read", m.AlertList, gateway="alerts"),
    _op("update_lifetimes", "POST", "/v1/sandboxes/lifetimes", "fanned_out", "write", m.IdList, gateway="by_label"),
    _op("stop_many", "POST", "/v1/sandboxes/stop", "fanned_out", "write", m.StopManyResult, gateway="by_label"),
    _op("pause_many", "POST", "/v1/sandboxes/pause", "fanned_out", "write", m.IdList, gateway="by_label"),
    _op("resume_many", "POST", "/v1/sandboxes/resume", "fanned_out", "write", m.IdList, gateway="by_label"),
    _op("usage", "GET", SB + "/usage", "sandbox", "read", m.Usage),
    _op("pause", "POST", SB + "/pause", "sandbox", "write", m.SandboxInfo),
    _op("resume", "POST", SB + "/resume", "sandbox", "write", m.SandboxInfo),
    _op("get", "GET", SB, "sandbox", "read", m.SandboxInfo),
    _op("update_lifetime", "PATCH", SB, "sandbox", "write", m.SandboxInfo),
    _op("stop", "DELETE", SB, "sandbox", "write", m.SandboxInfo),
    _op("set_labels", "PUT", SB + "/labels", "sandbox", "write", m.SandboxInfo),
    _op("events", "GET", SB + "/events", "sandbox", "read", m.EventList),
    # -- snapshots, fork, pack --------------------------------------------------------------------
    _op("snapshot", "POST", SB + "/snapshots", "sandbox", "write", m.SnapshotInfo, status=201),
    _op("fork", "POST", SB + "/fork", "sandbox", "write", m.CreateBatchResult, gateway="copies"),
    _op(
        "pack",
        "POST",
        SB + "/pack",
        "sandbox",
        "admin",
        m.ImageInfo,
        status=201,
        needs="packing into the node's shared image store",
    ),
    # -- checkpoints: states of one sandbox it goes back to in place ---------------------------------
    _op("checkpoint", "POST", SB + "/checkpoints", "sandbox", "write", m.CheckpointInfo, status=201),
    _op("list_checkpoints", "GET", SB + "/checkpoints", "sandbox", "read", m.CheckpointList),
    _op("delete_checkpoint", "DELETE", SB + "/checkpoints/{checkpoint_id}", "sandbox", "write", m.Ok),
    _op("rollback", "POST", SB + "/rollback", "sandbox", "write", m.RollbackResult),
    _op("list_snapshots", "GET", "/v1/snapshots", "fanned_out", "read", m.SnapshotList, gateway="list_snapshots"),
    _op("get_snapshot", "GET", "/v1/snapshots/{snapshot_id}", "snapshot", "read", m.SnapshotInfo),
    _op("delete_snapshot", "DELETE", "/v1/snapshots/{snapshot_id}", "snapshot", "write", m.Ok),
    _op(
        "restore",
        "POST",
        "/v1/snapshots/{snapshot_id}/restore",
        "snapshot",
        "write",
        m.CreateBatchResult,
        gateway="copies",
    ),
    # -- commands and processes -------------------------------------------------------------------
    _op("exec_", "POST", SB + "/exec", "sandbox", "write", m.ExecResult),
    _op("exec_stream", "POST", SB + "/exec/stream", "sandbox", "write"),
    _op("run_code", "POST", "/v1/run", "placed", "write", m.ExecResult, gateway="one_node"),
    _op("run_code_many", "POST", "/v1/run/batch", "placed", "write", gateway="one_node"),
    # SandboxFusion's run_code (verl's `sandbox_fusion.url`), at its own path and under /v1
    _op("fusion_run_code", "POST", "/run_code", "placed", "write", gateway="one_node", handler="run_code"),
    _op("fusion_run_code_v1", "POST", "/v1/fusion/run_code", "placed", "write", gateway="one_node", handler="run_code"),
    _op("run_code_in", "POST", SB + "/run", "sandbox", "write", m.ExecResult),
    _op("start_process", "POST", SB + "/processes", "sandbox", "write", m.ProcessInfo, status=201),
    _op("list_processes", "GET", SB + "/processes", "sandbox", "read", m.ProcessList),
    _op("get_process", "GET", SB + "/processes/{process_id}", "sandbox", "read", m.ProcessInfo),
    _op("kill_process", "DELETE", SB + "/processes/{process_id}", "sandbox", "write", m.ProcessInfo),
    _op("process_stdin", "POST", SB + "/processes/{process_id}/stdin", "sandbox", "write", m.Ok),
    _op("process_output", "GET", SB + "/processes/{process_id}/output", "sandbox", "read"),
    _op("start_process_stream", "POST", SB + "/processes/stream", "sandbox", "write"),
    _op("terminal_doc", "GET", SB + "/terminal", "sandbox", "write", status=101),
    # -- shell sessions ---------------------------------------------------------------------------
    _op("create_session", "POST", SB + "/sessions", "sandbox", "write", m.SessionInfo, status=201),
    _op("list_sessions", "GET", SB + "/sessions", "sandbox", "read", m.SessionList),
    _op("get_session", "GET", SB + "/sessions/{session_id}", "sandbox", "read", m.SessionInfo),
    _op("session_run", "POST", SB + "/sessions/{session_id}/run", "sandbox", "write", m.ExecResult),
    _op("session_run_stream", "POST", SB + "/sessions/{session_id}/run/stream", "sandbox", "write"),
    _op("session_stdin", "POST", SB + "/sessions/{session_id}/stdin", "sandbox", "write", m.Ok),
    _op("close_session", "DELETE", SB + "/sessions/{session_id}", "sandbox", "write", m.Ok),
    # -- files ------------------------------------------------------------------------------------
    _op("read_file", "GET", SB + "/files/content", "sandbox", "read"),
    _op("write_file", "PUT", SB + "/files/content", "sandbox", "write", m.FileInfo),
    _op("list_files", "GET", SB + "/files/list", "sandbox", "read", m.FileList),
    _op("stat_file", "GET", SB + "/files/stat", "sandbox", "read", m.FileInfo),
    _op("mkdir", "POST", SB + "/files/mkdir", "sandbox", "write", m.FileInfo),
    _op("remove", "DELETE", SB + "/files", "sandbox", "write", m.Ok),
    _op("download", "GET", SB + "/files/tar", "sandbox", "read"),
    _op("upload", "PUT", SB + "/files/tar", "sandbox", "write", m.Ok),
    _op("watch", "GET", SB + "/files/watch", "sandbox", "read"),
    # -- network ----------------------------------------------------------------------------------
    _op("set_network", "PUT", SB + "/network", "sandbox", "write", m.SandboxInfo),
    _op("set_network_many", "POST", "/v1/sandboxes/network", "fanned_out", "write", m.IdList, gateway="by_label"),
    _op("expose", "POST", SB + "/ports", "sandbox", "write", m.ExposedPort, status=201),
    _op("list_exposed", "GET", SB + "/ports", "sandbox", "read", m.ExposedPortList),
    _op("unexpose", "DELETE", SB + "/ports/{port}", "sandbox", "write", m.Ok),
    # What a server in the sandbox answers: reading or acting as its HTTP method says (a read-only
    # token may GET; the route's dependency asks no more than to see the sandbox).
    _op("to_port", PROXY_METHODS, SB + "/ports/{port}/{path:path}", "sandbox", "read"),
    # -- RL: trajectories and verification --------------------------------------------------------
    _op("open_trajectory", "POST", "/v1/trajectories", "placed", "write", m.TrajectoryInfo, gateway="open_trajectory"),
    _op(
        "list_trajectories",
        "GET",
        "/v1/trajectories",
        "fanned_out",
        "read",
        m.TrajectoryList,
        gateway="list_trajectories",
    ),
    _op("get_trajectory", "GET", TRAJ, "trajectory", "read", m.TrajectoryInfo),
    _op("delete_trajectory", "DELETE", TRAJ, "trajectory", "write", m.Ok),
    _op("step", "POST", TRAJ + "/steps", "trajectory", "write", m.StepResult),
    _op("steps", "GET", TRAJ + "/steps", "trajectory", "read", m.StepList),
    _op("verify_trajectory", "POST", TRAJ + "/verify", "trajectory", "write", m.VerifyResult),
    _op("close_trajectory", "POST", TRAJ + "/close", "trajectory", "write", m.TrajectoryInfo),
    _op("record", "GET", TRAJ + "/record", "trajectory", "read", m.ReproRecord),
    _op("verify", "POST", SB + "/verify", "sandbox", "write", m.VerifyResult),
    # -- images -----------------------------------------------------------------------------------
    _op("images", "GET", "/v1/images", "fanned_out", "read", m.ImageList, gateway="list_images"),
    _op(
        "delete_image",
        "DELETE",
        "/v1/images/{ref:path}",
        "fanned_out",
        "admin",
        m.Ok,
        gateway="images_everywhere",
        needs="deleting from the node's image store",
    ),
    _op(
        "gc_images",
        "POST",
        "/v1/images/gc",
        "fanned_out",
        "admin",
        m.GcResult,
        gateway="images_everywhere",
        needs="collecting the node's image store",
    ),
    _op(
        "push_image",
        "POST",
        "/v1/images/push",
        "fanned_out",
        "admin",
        m.ImageInfo,
        gateway="images_everywhere",
        needs="pushing to the shared image store",
    ),
    _op(
        "import_image",
        "POST",
        "/v1/images/import",
        "fanned_out",
        "admin",
        m.ImageInfo,
        gateway="images_everywhere",
        needs="importing an archive from the node's disk",
    ),
    _op("build_image", "POST", "/v1/images/build", "fanned_out", "write", m.ImageInfo, gateway="images_everywhere"),
    _op(
        "build_recipe",
        "POST",
        "/v1/images/recipes",
        "placed",
        "admin",
        gateway="one_node",
        needs="a recipe build (it reads the node's files)",
    ),
)

OPERATION = {op.name: op for op in OPERATIONS}
