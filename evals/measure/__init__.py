"""Measurements the projections and the budget take as input (``python -m
evals`` lists the commands)."""
