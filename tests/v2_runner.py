"""A stand-in for vLLM's Model Runner V2 around the device route's
speculator, with vLLM's own ``RequestState`` and ``InputBatch`` on CPU
tensors: requests are added and removed as the runner does, each step's
sampled tokens are written where ``post_update`` writes them, and
``propose`` is called with the runner's arguments.

vLLM's UVA buffers want pinned memory, which this CPU has no allocator for:
``RequestState`` is built with vLLM's non-UVA fallback; its ``add_request``
stages writes that only a Triton kernel applies, so the tokens are written
directly instead and the staged copies dropped.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import torch


def config(k: int, max_rows: int, max_len: int, **section):
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                           scheduler_config=SimpleNamespace(max_num_seqs=max_rows),
                           model_config=SimpleNamespace(max_model_len=max_len),
                           additional_config={"consensus_spec": {"route": "device", **section}})


class Runner:
    def __init__(self, k: int = 4, max_rows: int = 8, max_len: int = 256, **section):
        from vllm.v1.worker.gpu import buffer_utils
        from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
        from vllm.v1.worker.gpu.states import RequestState

        from consensus_spec.vllm.device_speculator import speculator_class

        uva = buffer_utils.is_uva_available
        buffer_utils.is_uva_available = lambda: False
        try:
            self.states = RequestState(max_rows, max_len, max_rows * (k + 1), k, 1 << 21,
                                       torch.device("cpu"), use_dense_all_token_ids=True)
        finally:
            buffer_utils.is_uva_available = uva
        self.k = k
        self.speculator = speculator_class()(config(k, max_rows, max_len, **section),
                                             torch.device("cpu"), self.states)
        self.template = InputBatch.make_dummy(1, 1, InputBuffers(max_rows, max_rows, torch.device("cpu")))
        self.text: dict[str, list[int]] = {}

    def add(self, req_id: str, prompt: list[int]) -> None:
        rs = self.states
        rs.add_request(req_id, len(prompt), list(prompt), len(prompt), 1 << 20)
        slot = rs.req_id_to_index[req_id]
        rs.all_token_ids.gpu[slot, :len(prompt)] = torch.tensor(prompt, dtype=torch.int32)
        rs.total_len.gpu[slot] = len(prompt)
        for t in (rs.total_len, rs.all_token_ids, rs.num_computed_tokens):
            for buf in (t._staged_write_indices, t._staged_write_starts,
                        t._staged_write_contents, t._staged_write_cu_lens):
                buf.clear()
        self.text[req_id] = list(prompt)

    def remove(self, req_id: str) -> None:
        self.states.remove_request(req_id)
        del self.text[req_id]

    def batch(self, req_ids):
        slots = np.array([self.states.req_id_to_index[r] for r in req_ids], np.int64)
        return dataclasses.replace(self.template, req_ids=list(req_ids), num_reqs=len(req_ids),
                                   num_reqs_after_padding=len(req_ids),
                                   idx_mapping=torch.from_numpy(slots), idx_mapping_np=slots)

    def step(self, sampled: dict[str, list[int]], k: int | None = None, dummy_run: bool = False):
        """Rows ``sampled`` (request id -> tokens written this step); the drafts per row."""
        rs = self.states
        req_ids = list(sampled)
        for req, toks in sampled.items():
            slot = rs.req_id_to_index[req]
            n = len(self.text[req])
            rs.all_token_ids.gpu[slot, n:n + len(toks)] = torch.tensor(toks, dtype=torch.int32)
            rs.total_len.gpu[slot] = n + len(toks)
            if toks:
                rs.last_sampled_tokens[slot, 0] = toks[-1]
            self.text[req] += toks
        num_sampled = torch.tensor([len(t) for t in sampled.values()], dtype=torch.int32)
        k = self.k if k is None else k
        out = self.speculator.propose(self.batch(req_ids), None, None, None, None, num_sampled,
                                      torch.zeros(len(req_ids), dtype=torch.int32),
                                      rs.last_sampled_tokens, rs.next_prefill_tokens, None, None,
                                      dummy_run=dummy_run, num_speculative_tokens=k)
        return {r: out[i, :k].tolist() for i, r in enumerate(req_ids)}
