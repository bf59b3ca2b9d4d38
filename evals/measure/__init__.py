"""Measurements other tools take as input: step-cost tables (``step-costs``),
host time per step (``host-time``), numba warm-up (``warmup``), and a local
model directory from a pip-shipped GGUF (``fetch-model``)."""
