"""Ids that say which node holds what they name.

A sandbox id is `sb-` + the node's key (6 hex digits) + 10 random hex digits; a snapshot id is
`snap-` + the same. Any cluster gateway routes a call by reading the node out of the id, with no
lookup table to keep or lose. The key is the node's own (kept in its state dir), never an IP or a
Ray node id: both change across restarts, and every node of a one-machine test cluster shares an IP.
"""

from __future__ import annotations

import re
import secrets

NODE_KEY_LEN = 6
_NODE_KEY_RE = re.compile(rf"^[0-9a-f]{{{NODE_KEY_LEN}}}$")
_ID_RE = re.compile(rf"^(?:sb|snap)-([0-9a-f]{{{NODE_KEY_LEN}}})[0-9a-f]{{10}}$")


def new_node_key() -> str:
    return secrets.token_hex(NODE_KEY_LEN // 2)


def is_node_key(key: str) -> bool:
    return bool(_NODE_KEY_RE.match(key))


def new_id(prefix: str, node_key: str) -> str:
    """`prefix`-<node key><10 random hex digits>: 16 hex digits, as ids had before they carried a node."""
    return f"{prefix}-{node_key}{secrets.token_hex(5)}"


def node_of(object_id: str) -> str | None:
    """The key of the node holding a sandbox or snapshot id, or None for a string that is neither."""
    m = _ID_RE.match(object_id)
    return m.group(1) if m else None
