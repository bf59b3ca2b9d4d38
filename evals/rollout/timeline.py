"""Per-step progress of one rollout batch, and what it says about the batch.

:class:`StepRecorder` wraps the engine client's ``get_output`` (what
``LLMEngine.step`` calls once per engine step) of an ``LLM`` while
``LLM.generate`` runs: the outputs pass through unchanged, and each step's
arrival time, the tokens it produced (``new_token_ids``: the accepted draft
tokens and the bonus token), the rows that produced them and the rows that
finished are noted.  Nothing inside vLLM changes.  :func:`summarize` turns
the steps into the figures docs/rollouts.md lists (draining starts with the
first step in which a row finished).
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class Step:
    t: float        # seconds since the batch was submitted, when the step's outputs arrived
    tokens: int     # tokens the step produced
    rows: int       # rows that produced at least one token
    finished: int   # rows that finished in it


class StepRecorder:
    """``with StepRecorder(llm) as rec: llm.generate(...)``; ``rec.steps``."""

    def __init__(self, llm):
        self.core = llm.llm_engine.engine_core
        self.steps: list[Step] = []
        self.t0 = 0.0

    def __enter__(self) -> "StepRecorder":
        inner = self.core.get_output

        def get_output(*args, **kwargs):
            out = inner(*args, **kwargs)
            t = time.perf_counter() - self.t0
            tokens = rows = finished = 0
            for o in getattr(out, "outputs", None) or ():
                n = len(o.new_token_ids)
                tokens += n
                rows += n > 0
                finished += o.finish_reason is not None
            if tokens or finished:
                self.steps.append(Step(t, tokens, rows, finished))
            return out

        self.core.get_output = get_output  # an instance attribute over the class's method
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        del self.core.get_output


def summarize(steps: list[Step], makespan: float, tail_share: float = 0.9) -> dict:
    """The batch's figures from its steps (``makespan``: seconds, submit to
    the last output)."""
    total = sum(s.tokens for s in steps)
    out = {"makespan_s": makespan, "tokens": total, "steps": len(steps),
           "tokens_per_s": total / makespan if makespan > 0 else None}
    if not steps or total == 0:
        return {**out, "tail_s": None, "tau_before_drain": None, "tau_after_drain": None,
                "drain_start_s": None, "steps_after_drain": 0}
    done, t_share = 0, steps[-1].t
    for s in steps:
        done += s.tokens
        if done >= tail_share * total:
            t_share = s.t
            break
    drain = next((i for i, s in enumerate(steps) if s.finished), len(steps) - 1)
    before, after = steps[:drain + 1], steps[drain + 1:]

    def tau(part):
        rows = sum(s.rows for s in part)
        return sum(s.tokens for s in part) / rows if rows else None

    return {**out, "tail_s": makespan - t_share, "tail_share": tail_share,
            "drain_start_s": steps[drain].t, "steps_after_drain": len(after),
            "tau_before_drain": tau(before), "tau_after_drain": tau(after),
            "mean_rows_after_drain": sum(s.rows for s in after) / len(after) if after else None,
            "row_steps": sum(s.rows for s in steps)}
