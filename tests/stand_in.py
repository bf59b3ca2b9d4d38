"""The parts of vLLM's ``VllmConfig`` the consensus proposer reads, for
tests that build it without an engine (its docstring lists them)."""

from types import SimpleNamespace


def stand_in_config(k: int, max_model_len: int, max_num_seqs: int, options: dict | None = None,
                    device: str | None = None) -> SimpleNamespace:
    cfg = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=max_model_len),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        additional_config={"consensus_spec": dict(options)} if options else {},
    )
    if device is not None:
        cfg.device_config = SimpleNamespace(device_type=device)
    return cfg
