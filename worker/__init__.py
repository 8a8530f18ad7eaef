"""Block server: serves a contiguous span of transformer blocks to the swarm."""
