"""E2B's API served by sandfleet: a program written for E2B's SDK (`e2b`, `e2b-code-interpreter`) runs
on a sandfleet node or cluster with only its environment changed (docs/e2b.md).

A thin proxy, like the SDK's remote runtime: every E2B call becomes calls of sandfleet's own API
(`upstream`, a node's or a gateway's TCP address) made with the caller's E2B API key as its
sandfleet token, so authentication, projects, quotas, validation and auditing are sandfleet's own
and nothing crosses a project through this layer. `control` is E2B's REST control plane,
`envd` its in-sandbox daemon's Connect services and file routes, `interpreter` the code
interpreter's, `hosts` the routing of E2B's sandbox hosts (`<port>-<id>.<domain>`), `network` E2B's
network options as sandfleet's egress policy.
"""

from __future__ import annotations

from sandfleet.e2b.server import (
    BASE_IMAGE,
    BASE_RECIPE,
    CODE_INTERPRETER_IMAGE,
    CODE_INTERPRETER_RECIPE,
    TEMPLATE_RECIPES,
    E2BConfig,
    create_app,
)

__all__ = [
    "BASE_IMAGE",
    "BASE_RECIPE",
    "CODE_INTERPRETER_IMAGE",
    "CODE_INTERPRETER_RECIPE",
    "TEMPLATE_RECIPES",
    "E2BConfig",
    "create_app",
]
