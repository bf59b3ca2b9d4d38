"""lm-eval's dataset for the ``consensus_synthetic_sc`` tasks: the embedded
model's held-out arithmetic problems (``consensus_spec.model.synthetic.test_set``),
made here rather than read from a hub (``custom_dataset`` in the task YAML)."""

from __future__ import annotations


def docs(problems: int = 500, seed: int = 1234, **_) -> dict:
    """``{"test": Dataset}`` of ``problems`` test problems (question, answer)."""
    import datasets

    from consensus_spec.model.synthetic import test_set

    rows = [{"question": p["question"], "answer": str(p["answer"])}
            for p in test_set(int(problems), seed=int(seed))]
    return {"test": datasets.Dataset.from_list(rows)}
