"""A consensus proposer whose drafter raises on chosen steps, for checking
that vLLM's engine survives a failing proposer (tests/engine_run.py).

``additional_config={"fault_injection": {"steps": [1, 40]}}`` fails the
drafter on those propose calls (1-based); ``{"every": true}`` on every call.
"""

from __future__ import annotations

from consensus_spec.vllm.proposer import ConsensusProposer


class FaultyProposer(ConsensusProposer):
    def __init__(self, vllm_config, **options):
        plan = (getattr(vllm_config, "additional_config", None) or {}).get("fault_injection", {})
        self.fault_steps = set(plan.get("steps", ()))
        self.fault_every = bool(plan.get("every", False))
        self.calls = 0
        self.faults = 0
        self._armed = False  # not during warm-up
        super().__init__(vllm_config, **options)
        self._armed = True

    def _reset(self) -> None:
        super()._reset()
        extend_and_draft = self.drafter.extend_and_draft

        def faulty(*args, **kwargs):  # fails inside the drafter, after row tracking moved on
            if self._armed and (self.fault_every or self.calls in self.fault_steps):
                self.faults += 1
                raise RuntimeError(f"injected drafter fault at propose call {self.calls}")
            return extend_and_draft(*args, **kwargs)

        self.drafter.extend_and_draft = faulty

    def _propose(self, *args, **kwargs):
        if self._armed:
            self.calls += 1
        return super()._propose(*args, **kwargs)
