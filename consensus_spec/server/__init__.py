"""HTTP rooms over :mod:`consensus_spec.sampling`: ``POST /v1/self_consistency``
on vLLM's OpenAI server (:mod:`consensus_spec.server.endpoint`, request and
response in :mod:`consensus_spec.server.protocol`)."""
