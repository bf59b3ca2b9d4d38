"""Adaptive self-consistency replayed: when to stop sampling (``python -m
evals`` lists the commands)."""
