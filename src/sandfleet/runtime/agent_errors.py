"""How talking to the in-sandbox agent fails: the `AgentError` family."""

from __future__ import annotations


class AgentError(RuntimeError):
    """Base class for agent failures."""


class AgentBuildError(AgentError):
    """gcc failed; the message carries its stderr."""


class ProtocolError(AgentError):
    """Malformed message."""


class ChannelClosedError(AgentError):
    """The channel to the agent is gone."""


class ExecStartError(AgentError):
    """The agent could not start the command (chdir/setuid/exec failed)."""

    def __init__(self, errno_: int, message: str) -> None:
        super().__init__(errno_, message)
        self.errno = errno_
        self.message = message

    def __str__(self) -> str:
        return f"[Errno {self.errno}] {self.message}"
