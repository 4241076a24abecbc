"""RL on the node: trajectories (exactly-once step logs) and verification apart from the agent."""
