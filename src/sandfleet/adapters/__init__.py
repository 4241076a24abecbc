"""Thin adapters from the RL frameworks' own interfaces to sandfleet's AsyncClient.

Each module imports only its own framework (installed with `pip install 'sandfleet[rl]'`), so the
SDK itself never depends on any of them.
"""
