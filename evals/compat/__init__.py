"""Compatibility with vLLM releases: ``check-vllm`` reads a release's source
(installed, or its wheel) and checks each assumption listed in
``consensus_spec/vllm/assumptions.py``."""
