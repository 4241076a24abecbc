"""Egress policy: the node's named services, and what a sandbox's `NetworkPolicy` lets it reach.

Pure logic (no sockets): the egress proxy (egress.py) asks `Policy.rule_for(host, port)` before it
resolves anything and `Policy.address_refusal(ip, rule)` for every address the name resolved to,
then connects to a checked address only, so a DNS answer cannot change between the check and the
connect (no rebinding). Addresses the host itself owns are refused by the proxy (it asks the kernel:
see egress.py), whatever the policy.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sandfleet.errors import InvalidArgumentError
from sandfleet.models import NetworkPolicy, split_host_port

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

MAX_CA_BUNDLE = 16 * 1024**2

# Never reachable, whatever the policy: this host and its loopback, link-local (and with it the
# cloud metadata address 169.254.169.254), multicast, broadcast and reserved space.
_NEVER = [
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "224.0.0.0/4",
        "240.0.0.0/4",
        "255.255.255.255/32",
        "::/128",
        "::1/128",
        "fe80::/10",
        "ff00::/8",
        "fd00:ec2::254/128",
    )
]
# Reachable only when a service names them (`cidrs`): the private and shared ranges a node's own
# networks (and its other machines) live in.
_PRIVATE = [
    ipaddress.ip_network(n)
    for n in (
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",
        "192.0.0.0/24",
        "198.18.0.0/15",
        "fc00::/7",
        "64:ff9b::/96",
    )
]


class ServiceConfig(BaseModel):
    """A named destination a policy can allow (`[network.services.NAME]`)."""

    model_config = ConfigDict(extra="forbid")

    hosts: list[str] = Field(min_length=1, description="host names (`*.example.com` matches subdomains) or IPs")
    ports: list[int] = Field([443], min_length=1, description="TCP ports allowed on those hosts")
    cidrs: list[str] = Field(
        default_factory=list,
        description="private ranges these hosts may resolve to (refused otherwise, as any private address is)",
    )
    description: str = ""

    @field_validator("ports")
    @classmethod
    def _ports(cls, v: list[int]) -> list[int]:
        if any(not 1 <= p <= 65535 for p in v):
            raise ValueError("ports are 1-65535")
        return v

    @field_validator("cidrs")
    @classmethod
    def _cidrs(cls, v: list[str]) -> list[str]:
        for c in v:
            net = ipaddress.ip_network(c, strict=False)
            if any(net.overlaps(n) for n in _NEVER):
                raise ValueError(f"{c} overlaps loopback, link-local or reserved space, which no service may reach")
        return v

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, v: list[str]) -> list[str]:
        return [h.lower() for h in v]


# What a task usually needs, overridable by a service of the same name in the node's config.
BUILTIN_SERVICES: dict[str, ServiceConfig] = {
    "pypi": ServiceConfig(
        hosts=["pypi.org", "files.pythonhosted.org"], ports=[443], description="the Python package index"
    ),
    "npm": ServiceConfig(hosts=["registry.npmjs.org"], ports=[443], description="the npm registry"),
    "debian": ServiceConfig(
        hosts=["deb.debian.org", "security.debian.org"], ports=[80, 443], description="Debian's package mirrors"
    ),
}


class NetworkConfig(BaseModel):
    """The node's egress settings (`[network]`)."""

    model_config = ConfigDict(extra="forbid")

    services: dict[str, ServiceConfig] = Field(
        default_factory=dict,
        description="named destinations; a built-in (pypi, npm, debian) of the same name is replaced",
    )
    hosts: dict[str, list[str]] = Field(
        default_factory=dict,
        description="static names for the proxy's resolver, like /etc/hosts (checked like any DNS answer)",
    )
    proxy_port: int = Field(3128, ge=1, le=65535, description="the egress proxy's port on a sandbox's 127.0.0.1")
    connect_timeout: float = Field(10.0, gt=0, le=120, description="seconds to connect to an allowed destination")
    max_connections: int = Field(
        256,
        ge=1,
        le=65536,
        description="connections a sandbox may hold open at once to the proxy (counted from accept: those "
        "still to send their request too), and again to its exposed ports together; more are answered 503 at once",
    )
    max_node_connections: int = Field(
        2048,
        ge=1,
        le=1_000_000,
        description="connections the node holds open for all sandboxes together (proxied and exposed ports; "
        "each takes up to 6 file descriptors); never more than a twelfth of the daemon's open-file limit",
    )
    head_timeout: float = Field(
        10.0, gt=0, le=300, description="seconds a connection to the proxy has to send its request head"
    )
    idle_timeout: float = Field(600.0, gt=0, description="close a proxied connection silent this many seconds")
    ca_bundle: Path | None = Field(
        None,
        description="a PEM file of the CA certificates the commands of networked sandboxes trust instead of "
        "their images' own (behind a TLS-inspecting egress: a bundle with its CA, e.g. this host's "
        "/etc/ssl/certs/ca-certificates.crt); read at start",
    )

    @field_validator("ca_bundle")
    @classmethod
    def _readable_bundle(cls, v: Path | None) -> Path | None:
        if v is not None:
            read_ca_bundle(v)  # a bad file stops the daemon before it listens, not after
        return v

    @field_validator("hosts", mode="before")
    @classmethod
    def _one_or_many(cls, v: object) -> object:
        if isinstance(v, dict):
            return {k.lower(): [x] if isinstance(x, str) else x for k, x in v.items()}
        return v

    @field_validator("hosts")
    @classmethod
    def _addresses(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        for addrs in v.values():
            for a in addrs:
                ipaddress.ip_address(a)
        return v

    def all_services(self) -> dict[str, ServiceConfig]:
        return {**BUILTIN_SERVICES, **self.services}


@dataclass(frozen=True)
class Rule:
    """One allowed destination: a host pattern on some ports, and the private ranges it may use."""

    pattern: str  # lower case; "*.x.y" matches subdomains of x.y, an IP literal matches itself
    ports: frozenset[int]
    cidrs: tuple[IPNetwork, ...]
    source: str  # the policy entry it came from (a service name or the pattern itself)

    def matches(self, host: str, port: int) -> bool:
        if port not in self.ports:
            return False
        if self.pattern.startswith("*."):
            return host.endswith(self.pattern[1:])  # "*.x.y": any name under x.y
        return host == self.pattern


@dataclass(frozen=True)
class Policy:
    """A sandbox's `NetworkPolicy` made concrete against the node's services."""

    spec: NetworkPolicy
    rules: tuple[Rule, ...]

    @property
    def none(self) -> bool:
        return not self.rules

    def rule_for(self, host: str, port: int) -> Rule | None:
        host = normalize_host(host)
        return next((r for r in self.rules if r.matches(host, port)), None)

    def address_refusal(self, ip: IPAddress, rule: Rule) -> str | None:
        """Why `ip` may not be connected to under `rule`, or None."""
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if any(ip in n for n in _NEVER):
            return f"{ip} is a loopback, link-local, multicast or reserved address"
        if any(ip in n for n in rule.cidrs):
            return None
        # The ranges above, not `ip.is_private`: that also counts documentation ranges (TEST-NET),
        # which some sites' resolvers answer for public names.
        if any(ip in n for n in _PRIVATE):
            return f"{ip} is a private address no allowed service names"
        return None


def normalize_host(host: str) -> str:
    host = host.strip().lower().rstrip(".")
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def compile_policy(spec: NetworkPolicy, config: NetworkConfig) -> Policy:
    """The rules of `spec`; an unknown service name is the caller's mistake (InvalidArgumentError)."""
    services = config.all_services()
    rules: list[Rule] = []
    for entry in spec.allow:
        if ":" not in entry and "." not in entry and not entry.startswith("["):
            svc = services.get(entry)
            if svc is None:
                known = ", ".join(sorted(services))
                raise InvalidArgumentError(f"unknown network service {entry!r} (this node has: {known})")
            cidrs = tuple(ipaddress.ip_network(c, strict=False) for c in svc.cidrs)
            rules += [Rule(normalize_host(h), frozenset(svc.ports), cidrs, entry) for h in svc.hosts]
            continue
        host, port = split_host_port(entry)
        rules.append(Rule(normalize_host(host), frozenset([port] if port else [80, 443]), (), entry))
    return Policy(spec, tuple(rules))


def ip_literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(normalize_host(host))
    except ValueError:
        return None


def read_ca_bundle(path: Path) -> bytes:
    """The node's CA bundle, checked: a daemon told to make sandboxes trust a file that is not
    there or holds no certificate must not start as if it had been told nothing."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CA_BUNDLE + 1)
    except OSError as exc:
        raise ValueError(f"[network] ca_bundle {path}: {exc.strerror}") from exc
    if len(data) > MAX_CA_BUNDLE:
        raise ValueError(f"[network] ca_bundle {path}: larger than {MAX_CA_BUNDLE} bytes")
    if b"-----BEGIN CERTIFICATE-----" not in data:
        raise ValueError(f"[network] ca_bundle {path}: no PEM certificate in it")
    return data
