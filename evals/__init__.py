"""Benchmarks and math evals for consensus_spec, composed from its public API."""
