"""The device route's vLLM speculator itself, driven by the replay.

:class:`SpeculatorDrafter` is what the replay calls for ``device-lagL``: it
builds ``ConsensusDeviceSpeculator`` as vLLM's Model Runner V2 does, with a
real ``RequestState`` and ``InputBatch`` holding CPU tensors, and plays the
runner's part each step: requests leave (``remove_request``) and arrive
(``add_request``), the step's sampled tokens are written into
``all_token_ids`` / ``total_len`` as ``post_update`` writes them, and
``propose`` gets the batch, ``num_sampled`` and the scheduled K. Its drafts
are the returned tensor's first K columns.

On this CPU vLLM's UVA buffers would ask for pinned memory, which has no
allocator here: ``RequestState`` is built with vLLM's non-UVA fallback, and
the staged writes its ``add_request`` queues are dropped (applying them
needs Triton) after the harness writes the same tokens directly.
"""

from __future__ import annotations

import dataclasses
import hashlib
from types import SimpleNamespace

import numpy as np


def _cpu_request_state(max_rows: int, max_len: int, k: int):
    import torch
    from vllm.v1.worker.gpu import buffer_utils
    from vllm.v1.worker.gpu.states import RequestState

    uva = buffer_utils.is_uva_available
    buffer_utils.is_uva_available = lambda: False  # no pinned memory on this CPU
    try:
        return RequestState(max_rows, max_len, max_rows * (k + 1), k, 1 << 21,
                            torch.device("cpu"), use_dense_all_token_ids=True)
    finally:
        buffer_utils.is_uva_available = uva


def _batch_template(max_rows: int):
    import torch
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    return InputBatch.make_dummy(1, 1, InputBuffers(max_rows, max_rows, torch.device("cpu")))


class SpeculatorDrafter:
    """``(sampled, batch) -> drafts`` through ``ConsensusDeviceSpeculator``."""

    def __init__(self, lag: int, k_at, k: int, max_len: int, max_rows: int, options: dict | None = None):
        import torch

        from consensus_spec.vllm.device_route import speculator_class

        self.k_at, self.k = k_at, k
        torch.set_num_threads(1)  # "device" ops on a shared 2-core machine: threads only contend
        section = {**(options or {}), "route": "device", "lag": lag}
        cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                              scheduler_config=SimpleNamespace(max_num_seqs=max_rows),
                              model_config=SimpleNamespace(max_model_len=max_len),
                              additional_config={"consensus_spec": section})
        self.states = _cpu_request_state(max_rows, max_len, k)
        self.speculator = speculator_class()(cfg, torch.device("cpu"), self.states)
        self.template = _batch_template(max_rows)
        self.torch = torch
        self.digest = hashlib.sha1()
        self.calls = 0

    def _drop_staged(self) -> None:
        for t in (self.states.total_len, self.states.all_token_ids, self.states.num_computed_tokens):
            for buf in (t._staged_write_indices, t._staged_write_starts,
                        t._staged_write_contents, t._staged_write_cu_lens):
                buf.clear()

    def __call__(self, sampled, batch) -> list[list[int]]:
        torch, rs = self.torch, self.states
        rows = len(sampled)
        req_ids = list(batch.req_ids[:rows])
        present = set(req_ids)
        for req in [r for r in rs.req_id_to_index if r not in present]:
            rs.remove_request(req)  # the runner's finish_requests
        counts = np.fromiter(map(len, sampled), np.int64, rows)
        ends = np.asarray(batch.num_tokens_no_spec[:rows], np.int64)
        for i, req in enumerate(req_ids):
            if req not in rs.req_id_to_index:
                n = int(batch.num_prompt_tokens[i])
                rs.add_request(req, n, batch.token_ids_cpu[i, :n].tolist(), n, 1 << 20)
                slot = rs.req_id_to_index[req]
                rs.all_token_ids.gpu[slot, :n] = torch.from_numpy(batch.token_ids_cpu[i, :n])
                rs.total_len.gpu[slot] = n
        self._drop_staged()
        slots = np.fromiter((rs.req_id_to_index[r] for r in req_ids), np.int64, rows)
        # post_update: this step's tokens at [total_len, total_len + num_sampled)
        flat_rows = np.repeat(slots, counts)
        flat_pos = np.repeat(ends - counts, counts) + (np.arange(counts.sum())
                                                       - np.repeat(np.cumsum(counts) - counts, counts))
        tokens = np.fromiter((t for s in sampled for t in s), np.int32, int(counts.sum()))
        at = (torch.from_numpy(flat_rows), torch.from_numpy(flat_pos))
        rs.all_token_ids.gpu[at] = torch.from_numpy(tokens)
        rs.total_len.gpu[torch.from_numpy(slots)] = torch.from_numpy(ends.astype(np.int32))
        idx = torch.from_numpy(slots)
        input_batch = dataclasses.replace(self.template, req_ids=req_ids, num_reqs=rows,
                                          num_reqs_after_padding=rows, idx_mapping=idx,
                                          idx_mapping_np=slots)
        k = int(self.k_at(rows))
        out = self.speculator.propose(input_batch, None, None, None, None,
                                      torch.from_numpy(counts.astype(np.int32)),
                                      torch.zeros(rows, dtype=torch.int32), rs.last_sampled_tokens,
                                      rs.next_prefill_tokens, None, None, num_speculative_tokens=k)
        drafts = out[:, :max(k, 0)].numpy()
        self.digest.update(np.ascontiguousarray(drafts, np.int64).tobytes())
        self.calls += 1
        return drafts.tolist()

    def route_stats(self) -> dict:
        return {**self.speculator.stats(), "drafts_sha1": self.digest.hexdigest(),
                "drafter_calls": self.calls}
