"""E2B's network options as sandfleet's egress policy.

E2B allows all egress unless told otherwise, with `allowOut` / `denyOut` lists of addresses, CIDR
blocks and domains (`allowOut` winning). sandfleet's policy is an allow list through the node's
egress proxy: nothing but what it lists (services, host patterns, addresses). So:

- `allow_internet_access: false`, or a `denyOut` of all traffic with no `allowOut`: no egress;
- `allowOut`: those hosts, domains (`*.example.com` too) and single addresses (a /32 or /128
  block), the rest denied whatever `denyOut` says: a `denyOut` beside it may only be all traffic;
- neither: the node's default policy (sandfleet's own default is none: a node's operator decides);
- what an allow list cannot say (a wider block, denying some hosts and allowing the rest) and what
  sandfleet's proxy does not do (per-host rules, an egress proxy of the caller's, masking the
  request's host, HTTPS ports) is refused as `unsupported`, never dropped in silence. DNS servers
  need no rule: the proxy resolves names itself.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from sandfleet.errors import InvalidArgumentError, UnsupportedError
from sandfleet.models import NetworkPolicy

ALL_TRAFFIC = ("0.0.0.0/0", "::/0")
UNSERVED = {
    "rules": "per-host request rules",
    "egressProxy": "an egress proxy of the caller's",
    "maskRequestHost": "masking the request's host",
    "httpsPorts": "HTTPS ports",
}


def policy(network: Any, allow_internet_access: Any = None) -> NetworkPolicy | None:
    """The egress policy of a create's or an update's network options (None: the node's default)."""
    if allow_internet_access is not None and not isinstance(allow_internet_access, bool):
        raise InvalidArgumentError("allow_internet_access must be a boolean")
    if network is None:
        return NetworkPolicy() if allow_internet_access is False else None
    if not isinstance(network, dict):
        raise InvalidArgumentError("network must be an object")
    for name, what in UNSERVED.items():
        if network.get(name) not in (None, False, [], {}):
            raise UnsupportedError(f"network.{name}: sandfleet's egress proxy does not do {what}")
    allow, deny = _list(network, "allowOut"), _list(network, "denyOut") or []
    if any(d not in ALL_TRAFFIC for d in deny):
        raise UnsupportedError(
            "network.denyOut: sandfleet's policy is an allow list (allowOut; everything else is denied), "
            "so denyOut may only name all traffic (0.0.0.0/0)"
        )
    if allow is None:
        if deny or allow_internet_access is False:
            return NetworkPolicy()
        return None
    try:
        return NetworkPolicy(allow=[_entry(a) for a in allow])
    except ValueError as exc:  # an entry sandfleet's policy refuses
        raise InvalidArgumentError(f"network.allowOut: {exc}"[:500]) from exc


def _list(network: dict[str, Any], name: str) -> list[str] | None:
    value = network.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidArgumentError(f"network.{name} must be a list of strings")
    return value


def _entry(address: str) -> str:
    """An allowOut entry as a policy entry: a domain or an address as it is, a CIDR block of one
    address as that address."""
    if "/" not in address:
        try:
            return f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
        except ValueError:
            return address  # a domain
    try:
        block = ipaddress.ip_network(address, strict=False)
    except ValueError as exc:
        raise InvalidArgumentError(f"network.allowOut: {address!r} is not a CIDR block") from exc
    if block.num_addresses != 1:
        raise UnsupportedError(
            f"network.allowOut: {address!r}: sandfleet's policy allows hosts and single addresses, not address blocks"
        )
    address = str(block.network_address)
    return f"[{address}]" if block.version == 6 else address
