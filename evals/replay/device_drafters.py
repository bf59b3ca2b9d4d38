"""The device route as the replay drives it, two ways that must draft the same
tokens (``drafts_sha1``): the emulation the route was decided on
(:class:`DeviceRouteDrafter`, ``device-emul-lagL``) and vLLM's speculator
itself (:class:`SpeculatorDrafter`, ``device-lagL``).

**The emulation**: consensus drafting as it would run on the GPU under async
scheduling (Model Runner V2's speculator slot).  The host's tries (a
:class:`ConsensusDrafter`) get the tokens written at call t at call t + lag;
each row gets K tokens, what a device table keyed by its current context
would hold, or K fill tokens on a miss; every ``ACCOUNT_EVERY``-th call with
K > 0 counts the table's entries and its changed contexts.  docs/async.md
("What was replayed", "The table and its refresh cost") gives the full account.

**The speculator**: ``ConsensusDeviceSpeculator`` built as Model Runner V2
builds it, with a real ``RequestState`` and ``InputBatch`` holding CPU
tensors, the harness playing the runner's part each step: requests leave
(``remove_request``) and arrive (``add_request``), the step's sampled tokens
are written into ``all_token_ids`` / ``total_len`` as ``post_update`` writes
them, and ``propose`` gets the batch, ``num_sampled`` and the scheduled K; its
drafts are the returned tensor's first K columns.  On this CPU vLLM's UVA
buffers would ask for pinned memory, which has no allocator here:
``RequestState`` is built with vLLM's non-UVA fallback, and the staged writes
its ``add_request`` queues are dropped (applying them needs Triton) after the
harness writes the same tokens directly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections import deque
from types import SimpleNamespace

import numpy as np

from consensus_spec.drafting.drafter import ConsensusDrafter, DrafterOptions
from consensus_spec.drafting import lagged

DEVICE_LOOKUP_MS = 0.03  # assumed device time per step of the gather (in the CUDA graph)
KEY_BYTES, TOKEN_BYTES = 8, 4
ACCOUNT_EVERY = 16

def device_us_per_row(batch: int) -> float:
    """The drafter time the projection charges the device route per row-step:
    the gather only; the host's tries and table refresh run off the critical path."""
    return DEVICE_LOOKUP_MS * 1000.0 / max(batch, 1)


class DeviceRouteDrafter:
    """``(sampled, batch) -> drafts``: the device route as the replay calls it.
    ``k_at(rows)``: the step's K (vLLM's scheduled k at that batch size)."""

    def __init__(self, lag: int, k_at, options: DrafterOptions | None = None):
        if lag < 0:
            raise ValueError("lag must be >= 0")
        self.lag, self.k_at = lag, k_at
        self.drafter = ConsensusDrafter(options or DrafterOptions())
        lagged.kernel.compile()  # table_contexts
        self.calls = 0
        self.paths: dict[str, int] = {}       # request id -> drafter path
        self.pending: deque = deque()          # (due call, paths, token lists) not yet appended
        self.releases: deque = deque()         # (due call, path)
        self.hits = self.cross_hits = self.misses = 0
        self.feed_s = 0.0                      # host CPU time appending to the tries
        self.accounted = []                    # (K, table entries, changed contexts) per sample
        self.refresh_s = 0.0                   # host CPU time recomputing changed contexts' entries
        self.digest = hashlib.sha1()           # of every call's drafts (to compare with the speculator)

    def __call__(self, sampled, batch) -> list[list[int]]:
        self.calls += 1
        rows = len(sampled)
        req_ids = list(batch.req_ids[:rows])
        lens = np.asarray(batch.num_tokens_no_spec[:rows], np.int64)
        gone = set(self.paths) - set(req_ids)
        for req in sorted(gone):  # its tokens are all queued already; release once they are in
            self.releases.append((self.calls + self.lag, self.paths.pop(req)))
        for i, req in enumerate(req_ids):
            if req not in self.paths:  # the prompt arrives with the request: not lagged
                prompt = batch.token_ids_cpu[i, :int(batch.num_prompt_tokens[i])]
                self.paths[req] = self.drafter.add_path(prompt)
        paths = np.array([self.paths[r] for r in req_ids], np.int64)
        self.pending.append((self.calls + self.lag, paths, [list(s) for s in sampled]))
        k = int(self.k_at(rows))
        account = k > 0 and self.calls % ACCOUNT_EVERY == 0
        before = self._snapshot() if account else None
        self._feed()
        if account:
            self._account(k, before)
        if k <= 0 or rows == 0:
            return [[] for _ in range(rows)]
        drafts = self._lookup(paths, batch, lens, k)
        self.digest.update(np.asarray(drafts, np.int64).reshape(rows, k).tobytes())
        return drafts

    def _feed(self) -> None:
        t0 = time.process_time()
        while self.pending and self.pending[0][0] <= self.calls:
            _, paths, tokens = self.pending.popleft()
            self.drafter.extend(paths, tokens)
        while self.releases and self.releases[0][0] <= self.calls:
            self.drafter.release(self.releases.popleft()[1])
        self.feed_s += time.process_time() - t0

    def _lookup(self, paths, batch, lens, k: int) -> list[list[int]]:
        d, o = self.drafter, self.drafter.options
        forest = d.forest
        group_roots = d.group_roots(paths)  # (re)builds any evicted group trie
        cross = d.cross_root
        buf = np.asarray(batch.token_ids_cpu[:len(paths)])
        a, b = lagged.table_contexts(*forest.arena(), o.max_depth, o.min_match, buf, lens,
                                     group_roots, cross)
        toks, _, got = forest.draft_many(a, b, o.cross_group_weight, np.full(len(paths), k),
                                         k, 0.0, o.min_match, o.prior)
        drafts = []
        for i, n in enumerate(got.tolist()):
            if n:
                self.hits += 1
                self.cross_hits += int(a[i] < 0)
                row = toks[i, :n].tolist()
                drafts.append(row + [row[-1]] * (k - n))
            else:  # miss: K fill tokens, the row's last token
                self.misses += 1
                drafts.append([int(buf[i, lens[i] - 1])] * k)
        return drafts

    def _snapshot(self):
        return self.drafter.evictions, self.drafter.forest.counts_snapshot()

    def _account(self, k: int, before) -> None:
        evictions, counts = before
        d = self.drafter
        forest = d.forest
        if d.evictions != evictions:  # a half was dropped meanwhile: node ids were reused
            return
        dirty = forest.changed_since(counts)
        t0 = time.process_time()  # the host recomputing those contexts' K-token entries
        forest.draft_many(dirty, np.full(len(dirty), -1), 0.0, np.full(len(dirty), k), k, 0.0,
                          d.options.min_match, d.options.prior)
        self.refresh_s += time.process_time() - t0
        roots = set(d.group_roots(list(self.paths.values()), attach=False).tolist()) | {d.cross_root}
        roots = [r for r in roots if r >= 0]
        entries = int(forest.root_sizes(roots).sum()) - len(roots)  # roots hold no context
        self.accounted.append((k, entries, len(dirty)))

    def route_stats(self) -> dict:
        """What the replay row records about the route (see the module doc)."""
        lookups = self.hits + self.misses
        acc = np.array(self.accounted, np.float64).reshape(-1, 3)
        entry_bytes = KEY_BYTES + TOKEN_BYTES * acc[:, 0]
        mean = lambda x: float(x.mean()) if len(x) else 0.0  # noqa: E731
        return {"lag": self.lag, "device_lookups": lookups, "drafts_sha1": self.digest.hexdigest(),
                "hit_rate": self.hits / max(lookups, 1),
                "cross_hit_share": self.cross_hits / max(self.hits, 1),
                "table_entries": mean(acc[:, 1]), "table_entries_max": float(acc[:, 1].max(initial=0)),
                "refresh_full_bytes": mean(acc[:, 1] * entry_bytes),
                "refresh_delta_bytes": mean(acc[:, 2] * entry_bytes),
                "changed_contexts": mean(acc[:, 2]),
                "host_feed_us_per_call": self.feed_s * 1e6 / max(self.calls, 1),
                "host_refresh_us_per_call": self.refresh_s * 1e6 / max(len(acc), 1)}


# -- The speculator: vLLM's classes on CPU tensors


class SpeculatorDrafter:
    """``(sampled, batch) -> drafts`` through ``ConsensusDeviceSpeculator``."""

    def __init__(self, lag: int, k_at, k: int, max_len: int, max_rows: int, options: dict | None = None):
        import torch
        from vllm.v1.worker.gpu import buffer_utils
        from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
        from vllm.v1.worker.gpu.states import RequestState

        from consensus_spec.vllm.device_speculator import speculator_class

        self.k_at, self.k = k_at, k
        torch.set_num_threads(1)  # "device" ops on a shared 2-core machine: threads only contend
        section = {**(options or {}), "route": "device", "lag": lag}
        cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                              scheduler_config=SimpleNamespace(max_num_seqs=max_rows),
                              model_config=SimpleNamespace(max_model_len=max_len),
                              additional_config={"consensus_spec": section})
        cpu, uva = torch.device("cpu"), buffer_utils.is_uva_available
        buffer_utils.is_uva_available = lambda: False  # no pinned memory on this CPU
        try:
            self.states = RequestState(max_rows, max_len, max_rows * (k + 1), k, 1 << 21, cpu,
                                       use_dense_all_token_ids=True)
        finally:
            buffer_utils.is_uva_available = uva
        self.speculator = speculator_class()(cfg, cpu, self.states)
        self.template = InputBatch.make_dummy(1, 1, InputBuffers(max_rows, max_rows, cpu))
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
