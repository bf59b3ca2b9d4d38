"""The device route, one call per engine step: host tries fed sibling tokens
``lag`` steps late, a device table of contexts refreshed from the host's
delta, and a gather on the device by each row's current tokens.

Per call (:meth:`DeviceRoute.step`), in this order:

1. paths: requests gone since the last call are released once their queued
   tokens are in; new ones become paths in their prompt's group (the prompt
   comes with the request: not lagged);
2. the tokens each row wrote this step (the tail of its token row) are
   copied to host memory without blocking, on a side stream where there is
   one; they are appended to the tries ``lag`` calls later, once the copy is
   done (polled, never waited for, except at lag 0, a reference setting);
3. the host appends what is due and computes the table's delta (the nodes
   those appends touched), stages it in host memory and copies it to the
   device without blocking, ordered before this step's gather;
4. the gather drafts K tokens per row from each row's last ``max_depth``
   tokens on the device.

Knows nothing of vLLM: it reads a token matrix, lengths, slots and sampled
counts as tensors. Host memory is pinned only where CUDA is available.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..drafting.drafter import DrafterOptions
from ..drafting.lagged import LaggedTries
from .options import RouteOptions, drafter_options
from .table import ContextTable


HOST_WINDOW = 4096  # calls whose host time the percentiles cover


class DeviceRoute:
    def __init__(self, options: DrafterOptions, route: RouteOptions, max_rows: int,
                 max_sampled: int, device):
        self.route = route
        self.device = torch.device(device)
        self.options = drafter_options(options, route, max_rows, max_sampled)
        self.tries = LaggedTries(route.lag, self.options)
        o = self.options
        self.table = ContextTable(o.max_trie_nodes, o.max_depth, o.min_match, o.prior,
                                  o.cross_group_weight, self.device)
        self.max_sampled = max_sampled
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._pin = cuda
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self.paths: dict[str, int] = {}  # request id -> path
        self.host_paths_s = 0.0     # thread CPU time registering and releasing paths
        self.host_feed_s = 0.0      # ... appending due tokens to the tries
        self.host_refresh_s = 0.0   # ... computing and staging the table's delta
        self.host_calls = 0
        self.staged_bytes = 0       # host -> device bytes of the table's deltas (and group ids)
        self._recent_host_s = np.zeros(HOST_WINDOW)  # feed + refresh of the last calls (a ring)

    # -- host <-> device copies -------------------------------------------

    def _to_host(self, *xs: torch.Tensor):
        """Host copies of ``xs`` and one ``ready()`` poll for all of them."""
        if self._copy_stream is None:
            return [x.cpu().numpy() for x in xs], None
        hosts = [torch.empty(x.shape, dtype=x.dtype, pin_memory=True) for x in xs]
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            for host, x in zip(hosts, xs):
                host.copy_(x, non_blocking=True)
                x.record_stream(self._copy_stream)
            event = torch.cuda.Event()
            event.record()
        return [h.numpy() for h in hosts], event.query

    def _to_device(self, arrays):
        """Device copies of host arrays, ordered before the main stream's next work."""
        if self._copy_stream is None:
            return [torch.from_numpy(np.ascontiguousarray(a)).to(self.device) for a in arrays]
        out = []
        with torch.cuda.stream(self._copy_stream):
            for a in arrays:
                staged = torch.from_numpy(np.ascontiguousarray(a)).pin_memory()
                out.append(staged.to(self.device, non_blocking=True))
        torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
        for t in out:
            t.record_stream(torch.cuda.current_stream(self.device))
        return out

    # -- one engine step ---------------------------------------------------

    def step(self, req_ids, live, prompt_of, slots: torch.Tensor, token_ids: torch.Tensor,
             total_len: torch.Tensor, num_sampled: torch.Tensor, k: int) -> torch.Tensor:
        """Drafts ``(len(req_ids), k)`` int64 on the device.

        ``req_ids``: the batch's request ids; ``live(req_id)``: whether a
        request seen before still exists; ``prompt_of(req_id)``: (prompt
        tokens, tokens it already wrote) of a request new to the route;
        ``slots``: each row's row of ``token_ids`` (max_reqs, max_len) and
        ``total_len``; ``num_sampled``: tokens each row wrote this step (the
        last ones of its token row)."""
        t0 = time.thread_time()
        tries = self.tries
        tries.begin_call()
        for req in sorted(r for r in self.paths if not live(r)):
            tries.leave(self.paths.pop(req))
        earlier = []
        for req in req_ids:
            if req not in self.paths:
                prompt, written = prompt_of(req)
                self.paths[req] = tries.add(prompt)
                if len(written):  # a resumed request: what it wrote goes in as if just written
                    earlier.append((self.paths[req], np.asarray(written, np.int64)))
        rows = len(req_ids)
        paths = np.fromiter((self.paths[r] for r in req_ids), np.int64, rows)
        for path, written in earlier:
            tries.push(np.array([path]), written[None, :], np.array([len(written)]))
        t1 = time.thread_time()
        d = self.options.max_depth
        s = self.max_sampled
        ends = total_len[slots].long()
        if rows:
            cols = ends[:, None] - num_sampled.long()[:, None] + torch.arange(s, device=self.device)
            sampled = token_ids[slots[:, None], cols.clamp(min=0)]
            (tokens, counts), ready = self._to_host(sampled, num_sampled)
            tries.push(paths, tokens, counts, ready)
        t2 = time.thread_time()
        fed = tries.advance(self._copy_stream.synchronize if self._copy_stream else None)
        t3 = time.thread_time()
        roots = tries.roots(paths) if k > 0 and rows else np.zeros(0, np.int64)
        delta = tries.delta(fed)
        arrays = [delta.keys, delta.key_nodes, delta.key_owners, delta.nodes, delta.values, roots]
        keys, key_nodes, key_owners, nodes, values, groups = self._to_device(arrays)
        self.staged_bytes += sum(a.nbytes for a in arrays)
        t4 = time.thread_time()
        self.table.apply(delta.drop_nodes, delta.drop_owners, keys, key_nodes, key_owners,
                         nodes, values)
        self.host_paths_s += t1 - t0
        self.host_feed_s += t3 - t2
        self.host_refresh_s += t4 - t3
        self._recent_host_s[self.host_calls % HOST_WINDOW] = (t3 - t2) + (t4 - t3)
        self.host_calls += 1
        if k <= 0 or not rows:
            return torch.empty((rows, max(k, 0)), dtype=torch.int64, device=self.device)
        cols = ends[:, None] - d + torch.arange(d, device=self.device)
        text = token_ids[slots[:, None], cols.clamp(min=0)].long()
        text = torch.where(cols >= 0, text, -1)
        return self.table.draft(text, ends.clamp(max=d), groups, tries.drafter.cross_root, k)

    def stats(self) -> dict:
        rows, hits, cross_hits = self.table.lookups.tolist()
        calls = max(self.host_calls, 1)
        recent = self._recent_host_s[:min(self.host_calls, HOST_WINDOW)] * 1e6
        return {"lag": self.route.lag, "device_lookups": rows, "hit_rate": hits / max(rows, 1),
                "cross_hit_share": cross_hits / max(hits, 1), "table_entries": self.table.size,
                "table_cross_entries": self.tries.cross_entries,
                "table_cross_entries_max": self.tries.cross_entries_max,
                "cross_restarts": self.tries.cross_restarts,
                "table_cross_cap": self.route.cross_entries, "late_feeds": self.tries.late_feeds,
                "host_paths_us_per_call": self.host_paths_s * 1e6 / calls,
                "host_feed_us_per_call": self.host_feed_s * 1e6 / calls,
                "host_refresh_us_per_call": self.host_refresh_s * 1e6 / calls,
                # feed + refresh per call over the last HOST_WINDOW calls
                "host_us_median": float(np.median(recent)) if len(recent) else 0.0,
                "host_us_p90": float(np.percentile(recent, 90)) if len(recent) else 0.0}
