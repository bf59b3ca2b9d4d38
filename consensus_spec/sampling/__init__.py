"""Sampling: ``self_consistency`` over a vLLM engine, the wave planner, stop
rules, data-parallel routing and the engine loop. Uses voting; knows
nothing of drafting."""
