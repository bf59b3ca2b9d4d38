"""RL rollouts: a fixed batch of groups, submitted at once and run to its last token."""
