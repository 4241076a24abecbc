"""A mini-swe-agent environment whose commands run in a sandfleet sandbox.

mini-swe-agent loads environments by class path, so a config selects this one with
`environment_class: sandfleet.adapters.minisweagent.SandfleetEnvironment` (plus the fields of
`SandfleetEnvironmentConfig`). It behaves like mini-swe-agent's own `DockerEnvironment`: each action
is one fresh `interpreter + [command]` process (no shell state carries over between actions, so an
agent trajectory replays the same way on either), stdout and stderr come back merged, a timeout or
any failure of the sandbox comes back as an error dict (returncode -1) rather than an exception,
and the magic first output line `COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` raises `Submitted`.

mini-swe-agent's environment interface is synchronous, so this adapter uses the sync `Client`.
"""

from __future__ import annotations

import logging
import os
import platform
import subprocess
from typing import Any

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel

from sandfleet import Client, Sandbox, SandboxSpec
from sandfleet.errors import SandboxError

__all__ = ["SUBMIT_MARKER", "SandfleetEnvironment", "SandfleetEnvironmentConfig"]

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
"""The first output line by which mini-swe-agent's agents say they are done (its environments' contract)."""


class SandfleetEnvironmentConfig(BaseModel):
    """The fields of mini-swe-agent's `DockerEnvironmentConfig` that mean something here, plus where
    the sandfleet daemon is and what the sandbox looks like."""

    image: str
    """The sandbox's image (`python:3.11`, or one built with `fleet.build_recipe` / `sb.pack`)."""
    cwd: str = "/"
    """Working directory of every command (absolute, or relative to the sandbox's workdir)."""
    env: dict[str, str] = {}
    """Environment variables of every command (they win over `forward_env`)."""
    forward_env: list[str] = []
    """Host environment variables passed on to every command, those that are set."""
    timeout: int = 30
    """Seconds a command may run (execute's `timeout` overrides it)."""
    interpreter: list[str] = ["bash", "-lc"]
    """The argv the command string is appended to (`["sh", "-c"]` for images without bash)."""
    output_limit: int | None = None
    """Bytes of output kept per command (None: the daemon's default, 1 MiB)."""
    socket: str | None = None
    """The daemon's unix socket (None and no `url`: the default socket)."""
    url: str | None = None
    """The daemon's TCP URL (then `token` authenticates)."""
    token: str | None = None
    labels: dict[str, str] = {}
    """Labels of the sandbox (`fleet.list(labels=...)`, `fleet.stop_many(...)` find it by them)."""
    sandbox: dict[str, Any] = {}
    """More `SandboxSpec` fields: resources, network, idle_ttl, max_lifetime, layers, backend, ..."""
    startup_timeout: float = 120.0
    """Seconds to wait for the sandbox (a full node's refusals are retried until then)."""


class SandfleetEnvironment:
    """mini-swe-agent's `Environment` protocol over one sandfleet sandbox, created on construction
    and stopped by `cleanup()` (or when the object is collected)."""

    def __init__(
        self,
        *,
        config_class: type[SandfleetEnvironmentConfig] = SandfleetEnvironmentConfig,
        logger: logging.Logger | None = None,
        client: Client | None = None,
        **kwargs: Any,
    ) -> None:
        """See `SandfleetEnvironmentConfig` for the keyword arguments. `client` reuses a connection
        to the daemon (it is then left open); otherwise one is made from `socket`/`url`/`token`."""
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self.sandbox: Sandbox | None = None
        self.config = config_class(**kwargs)
        self._owns_client = client is None
        self.client = client or Client(self.config.socket, url=self.config.url, token=self.config.token)
        self._uname: dict[str, str] | None = None
        try:
            spec = SandboxSpec(image=self.config.image, **{"labels": self.config.labels, **self.config.sandbox})
            self.sandbox = self.client.create(spec, timeout=self.config.startup_timeout)
        except BaseException:
            self._close_client()
            raise
        self.logger.info(f"Started sandbox {self.sandbox.id} from {self.config.image}")

    def execute(self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run `action["command"]` in the sandbox: {"output", "returncode", "exception_info"} (and
        "extra" on failure). Raises `Submitted` when the output starts with `SUBMIT_MARKER`."""
        command = action.get("command", "")
        limit = timeout or self.config.timeout
        try:
            output = self._run(command, cwd or self.config.cwd, limit)
        except (SandboxError, subprocess.TimeoutExpired) as exc:
            output = _failure(exc)
        self._check_finished(output)
        return output

    def _run(self, command: str, cwd: str, timeout: int) -> dict[str, Any]:
        if self.sandbox is None:
            raise RuntimeError("the sandbox was cleaned up")
        env = {k: v for k in self.config.forward_env if (v := os.getenv(k)) is not None} | self.config.env
        r = self.sandbox.exec(
            [*self.config.interpreter, command],
            cwd=cwd,
            env=env,
            timeout=timeout,
            merge_stderr=True,
            output_limit=self.config.output_limit,
        )
        if r.timed_out:  # what mini-swe-agent's own environments report: subprocess's timeout error
            raise subprocess.TimeoutExpired(command, timeout, output=r.stdout)
        return {"output": r.stdout, "returncode": r.exit_code, "exception_info": ""}

    @staticmethod
    def _check_finished(output: dict[str, Any]) -> None:
        """The agent's way out: a successful command whose first line is the marker submits the rest."""
        first, _, rest = output.get("output", "").lstrip().partition("\n")
        if output["returncode"] == 0 and first.strip() == SUBMIT_MARKER:
            raise Submitted(
                {"role": "exit", "content": rest, "extra": {"exit_status": "Submitted", "submission": rest}}
            )

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """The config, the sandbox's uname fields (system, node, release, version, machine) and kwargs."""
        return recursive_merge(self.config.model_dump(), self._sandbox_uname(), kwargs)

    def _sandbox_uname(self) -> dict[str, str]:
        """The sandbox's own uname (a VM tier's kernel is not the host's), asked once; the host's if
        the sandbox cannot say."""
        if self._uname is None:
            fields = ["system", "node", "release", "version", "machine"]
            self._uname = {k: v for k, v in platform.uname()._asdict().items() if k in fields}
            if self.sandbox is not None:
                try:
                    r = self.sandbox.exec(["uname", "-s", "-n", "-r", "-m"], timeout=10)
                    ver = self.sandbox.exec(["uname", "-v"], timeout=10)
                    parts = r.stdout.split()
                    if r.exit_code == 0 and ver.exit_code == 0 and len(parts) == 4:
                        self._uname = dict(zip(["system", "node", "release", "machine"], parts, strict=True))
                        self._uname["version"] = ver.stdout.strip()
                except SandboxError as exc:
                    self.logger.warning(f"uname in sandbox failed, using the host's: {exc}")
        return dict(self._uname)

    def serialize(self) -> dict[str, Any]:
        """The trajectory's record of this environment, in mini-swe-agent's layout."""
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json"),
                    "environment_type": f"{type(self).__module__}.{type(self).__name__}",
                }
            }
        }

    def cleanup(self) -> None:
        """Stop the sandbox (stopping one already gone is no error); idempotent."""
        sandbox, self.sandbox = getattr(self, "sandbox", None), None
        try:
            if sandbox is not None:
                try:
                    sandbox.stop()
                except SandboxError as exc:
                    self.logger.warning(f"stopping sandbox {sandbox.id} failed: {exc}")
        finally:
            self._close_client()

    def _close_client(self) -> None:
        if getattr(self, "_owns_client", False):
            self._owns_client = False
            self.client.close()

    def __del__(self) -> None:
        self.cleanup()


def _failure(exc: BaseException) -> dict[str, Any]:
    """The error dict mini-swe-agent's environments return for a command that did not complete."""
    raw = getattr(exc, "output", None)
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else (raw or "")
    return {
        "output": text,
        "returncode": -1,
        "exception_info": f"An error occurred while executing the command: {exc}",
        "extra": {"exception_type": type(exc).__name__, "exception": str(exc)},
    }
