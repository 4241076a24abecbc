"""Network policies and exposed ports."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any

from pydantic import AfterValidator, Field, field_validator, model_validator

from sandfleet.models.common import Labels, _Model, shown

_SERVICE_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")


_DNS_LABEL = r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?"


_DNS_PATTERN_RE = re.compile(rf"^(\*\.)?({_DNS_LABEL}\.)*{_DNS_LABEL}$")


MAX_ALLOW = 64


def split_host_port(entry: str) -> tuple[str, int | None]:
    """`host`, `host:port`, `[v6]` or `[v6]:port` -> (host, port or None)."""
    if entry.startswith("["):
        host, sep, rest = entry[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"bad address {shown(entry)}: expected [IPv6]:port")
        port = rest[1:] if rest else None
    else:
        host, sep, port_s = entry.rpartition(":")
        host, port = (host, port_s) if sep else (entry, None)
    if port is None:
        return host, None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"bad port in {shown(entry)}: expected 1-65535")
    return host, int(port)


def check_allow_entry(entry: str) -> str:
    """A service name (`pypi`), or a host pattern with an optional port: `example.com`,
    `*.example.com:8443`, `203.0.113.7:80`, `[2001:db8::1]:443`."""
    entry = entry.strip().lower()
    if _SERVICE_RE.match(entry):
        return entry
    host, _ = split_host_port(entry)
    try:
        ipaddress.ip_address(host)
        return entry
    except ValueError:
        pass
    if len(host) > 253 or "." not in host or not _DNS_PATTERN_RE.match(host):
        raise ValueError(
            f"invalid network allow entry {shown(entry)}: expected a service name (e.g. 'pypi') or "
            "host[:port] (e.g. 'example.com', '*.example.com:8443', '203.0.113.7:80')"
        )
    return entry


AllowEntry = Annotated[str, AfterValidator(check_allow_entry)]


class NetworkPolicy(_Model):
    """Where a sandbox may connect to. Nothing is reachable by default (`allow=[]`, written
    "none"): the sandbox has a loopback device and nothing else. Each entry of `allow` is a service
    the node defines (`pypi`, `npm`, `debian`, or one of its config's `[network.services]`) or a
    host pattern with an optional port (no port: 80 and 443). Connections go through the node's
    egress proxy (HTTP_PROXY and HTTPS_PROXY are set for every command); it checks each one, and
    the address a name resolves to, against the policy. Whatever the policy, the host, the node's
    other sandboxes, link-local and metadata addresses are never reachable, nor private ranges
    unless a service of the node names them.

    Also accepted: `"none"`, a list of entries, or `{"pypi": True, "npm": False}`."""

    allow: list[AllowEntry] = Field(default_factory=list, max_length=MAX_ALLOW)

    @model_validator(mode="before")
    @classmethod
    def _short_forms(cls, data: Any) -> Any:
        if data is None or data == "none":
            return {"allow": []}
        if isinstance(data, str):
            return {"allow": [data]}
        if isinstance(data, list | tuple):
            return {"allow": list(data)}
        if isinstance(data, dict) and "allow" not in data:
            if not all(isinstance(v, bool) for v in data.values()):
                raise ValueError("a network rule map takes booleans: {'pypi': True, 'npm': False}")
            return {"allow": [k for k, v in data.items() if v]}
        return data

    @field_validator("allow")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))

    @property
    def none(self) -> bool:
        return not self.allow

    def __str__(self) -> str:
        return ",".join(self.allow) or "none"


class NetworkUpdate(_Model):
    network: NetworkPolicy


class NetworkManyRequest(_Model):
    labels: Labels = Field(description="every running or paused sandbox carrying all these labels")
    network: NetworkPolicy


class ExposedPort(_Model):
    """A server listening inside a sandbox, reachable from the node: over HTTP at `path` of the
    daemon's API (its authentication applies; the SDK gives the full `url`), or as a byte stream at
    `socket`, a unix socket on the node only root can open. Gone with the sandbox."""

    port: int = Field(ge=1, le=65535)
    path: str
    socket: str | None = None
    url: str | None = None


class ExposeRequest(_Model):
    port: int = Field(ge=1, le=65535, description="a TCP port a server in the sandbox listens on (127.0.0.1)")


class ExposedPortList(_Model):
    ports: list[ExposedPort]
