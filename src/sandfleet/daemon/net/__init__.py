"""Sandbox networks: the egress policy, a sandbox's network, and the egress proxy."""
