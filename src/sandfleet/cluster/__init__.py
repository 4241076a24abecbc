"""Cluster mode on Ray: stateless gateways serving the node's API, placement, membership, quotas.

Node daemons stay the node agents and run outside Ray; Ray is used for discovery and liveness only
(a small actor per node), never on the path of a sandbox call.
"""
