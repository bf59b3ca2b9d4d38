"""The device table of contexts and the gather that drafts from it.

One entry per trie node: key = hash of (its trie's root id, its string) (see
:mod:`consensus_spec.drafting.lagged` for the hash), value = the node's total
count, most frequent next token and that token's count, stored by node id.
Keys are kept sorted, with the node each names, so a lookup is one
``torch.searchsorted``; new keys are merged in each step without a sort of
the whole table and without a device-to-host sync.

:meth:`ContextTable.draft` walks, for every row at once, the joint greedy
draft :meth:`ConsensusDrafter.draft` walks on the host (group trie at weight
1, cross-group trie at ``cross_group_weight``, no probability cut): at each
of K steps it looks up every suffix of the row's text (its last tokens plus
what it drafted so far) in both tries, backs off to the longest suffix with
a continuation, and takes the better-scoring source. Every row gets exactly
K tokens: a draft shorter than K is padded with its last token, and a row
with nothing to draft gets K copies of its last token (as vLLM's
``NgramGPUSpeculator`` fills a miss).

Plain torch ops (shapes fixed by the batch), so it runs on any device; on
the CPU it is what the tests and the replay drive.
"""

from __future__ import annotations

import torch

from ..drafting.lagged import KEY_A, KEY_B, hash_powers


class _SortedKeys:
    """Sorted int64 keys with the node and trie each names."""

    def __init__(self, device):
        self.device = device
        self.keys, self.nodes, self.owners = (torch.empty(0, dtype=torch.int64, device=device)
                                              for _ in range(3))
        self.size = 0  # kept on the host: no sync

    def merge(self, other: "_SortedKeys") -> None:
        """Take in ``other``'s entries by rank (equal keys: other's first)."""
        n, m = self.size, other.size
        if not m:
            return
        new_at = torch.searchsorted(self.keys, other.keys) + torch.arange(m, device=self.device)
        old_at = torch.searchsorted(other.keys, self.keys, right=True) + torch.arange(n, device=self.device)
        merged = []
        for old, new in ((self.keys, other.keys), (self.nodes, other.nodes), (self.owners, other.owners)):
            out = torch.empty(n + m, dtype=torch.int64, device=self.device)
            out.scatter_(0, old_at, old)
            out.scatter_(0, new_at, new)
            merged.append(out)
        self.keys, self.nodes, self.owners = merged
        self.size = n + m

    def drop(self, drop_nodes, drop_owners) -> None:
        keep = torch.ones_like(self.keys, dtype=torch.bool)
        for lo, hi in drop_nodes:
            keep &= (self.nodes < lo) | (self.nodes >= hi)
        for owner in drop_owners:
            keep &= self.owners != owner
        self.keys, self.nodes, self.owners = self.keys[keep], self.nodes[keep], self.owners[keep]
        self.size = int(self.keys.numel())

    def find(self, queries):
        """(hit, node) per query (flat)."""
        if not self.size:
            return torch.zeros_like(queries, dtype=torch.bool), torch.zeros_like(queries)
        idx = torch.searchsorted(self.keys, queries).clamp_(max=self.size - 1)
        return self.keys[idx] == queries, self.nodes[idx]


class ContextTable:
    def __init__(self, capacity: int, max_depth: int, min_match: int, prior: float,
                 cross_weight: float, device):
        self.device = torch.device(device)
        self.max_depth, self.min_match = max_depth, min_match
        self.prior, self.cross_weight = float(prior), float(cross_weight)
        # Two sorted levels: new keys merge into the small one each step; it
        # merges into the large one once an eighth of its size (amortised O(1)).
        self.base, self.recent = _SortedKeys(self.device), _SortedKeys(self.device)
        self.values = torch.zeros((capacity, 3), dtype=torch.int32, device=self.device)
        self.powers = torch.from_numpy(hash_powers(max_depth)[:max_depth]).to(self.device)
        self.lengths = torch.arange(1, max_depth + 1, dtype=torch.int64, device=self.device)
        self.lookups = torch.zeros(3, dtype=torch.int64, device=self.device)  # rows, hits, cross hits

    @property
    def size(self) -> int:
        return self.base.size + self.recent.size

    def apply(self, drop_nodes, drop_owners, keys, key_nodes, key_owners, nodes, values) -> None:
        """One step's delta (device tensors but the drop lists): drop, write
        statistics, insert keys. Drops sync (rare: a rotation or restart)."""
        if drop_nodes or drop_owners:
            self.base.drop(drop_nodes, drop_owners)
            self.recent.drop(drop_nodes, drop_owners)
        if nodes.numel():
            self.values[nodes] = values
        if keys.numel():
            new = _SortedKeys(self.device)
            order = torch.argsort(keys)
            new.keys, new.nodes, new.owners = keys[order], key_nodes[order], key_owners[order]
            new.size = int(keys.numel())
            self.recent.merge(new)
            if self.recent.size > max(4096, self.base.size // 8):
                self.base.merge(self.recent)
                self.recent = _SortedKeys(self.device)

    def _probe(self, queries):
        """(hit, values (..., 3)) per query key."""
        flat = queries.reshape(-1)
        hit, node = self.base.find(flat)
        hit_r, node_r = self.recent.find(flat)
        node = torch.where(hit_r, node_r, node)
        values = self.values[node].reshape(*queries.shape, 3)
        return (hit | hit_r).reshape(queries.shape), values

    def _lookup(self, text, end, avail, owners):
        """Every suffix (lengths 1..max_depth) of ``text[:, :end]`` in the
        tries ``owners`` (B,): (hit (B, D), values (B, D, 3))."""
        d = self.max_depth
        rev = text[:, end - d:end].flip(1)
        h = ((rev + 1) * self.powers).cumsum(1)  # h[:, L-1]: hash of the last L tokens
        keys = h * KEY_A + (owners[:, None] + 1) * KEY_B + self.lengths
        hit, values = self._probe(keys)
        return hit & (self.lengths <= avail[:, None]) & (owners[:, None] >= 0), values

    def _top(self, hit, values, length):
        """The longest suffix no longer than ``length`` with a continuation
        (as the host's back-off along suffix links): (found, its length,
        next token, P(next token))."""
        cand = hit & (values[..., 0] > 0) & (self.lengths >= self.min_match) \
            & (self.lengths <= length[:, None])
        ctx = torch.where(cand, self.lengths, 0).amax(1)
        at = (ctx - 1).clamp(min=0)
        v = values.gather(1, at[:, None, None].expand(-1, 1, 3))[:, 0]
        prob = v[:, 2].double() / (v[:, 0].double() + self.prior)
        return ctx > 0, ctx, v[:, 1].long(), prob

    def _step(self, hit, length):
        """Longest present suffix no longer than length + 1 (0: the root)."""
        bound = (length + 1).clamp(max=self.max_depth)
        return torch.where(hit & (self.lengths <= bound[:, None]), self.lengths, 0).amax(1)

    def draft(self, text, avail, groups, cross: int, k: int):
        """K tokens per row. ``text`` (B, max_depth) int64: each row's last
        tokens, right-aligned; ``avail`` (B,): how many are real; ``groups``
        (B,): each row's group trie; ``cross``: the cross-group trie (-1: none)."""
        b, d = text.shape
        lengths = self.lengths
        buf = torch.cat([text, text.new_full((b, k), -1)], 1)
        cross_ids = torch.full_like(groups, cross if self.cross_weight > 0 else -1)
        avail = avail.clone()
        hit_a, val_a = self._lookup(buf, d, avail, groups)
        hit_b, val_b = self._lookup(buf, d, avail, cross_ids)
        la = torch.where(hit_a, lengths, 0).amax(1)
        has_a = la >= self.min_match
        lb_all = torch.where(hit_b, lengths, 0).amax(1)
        lb_in_a = torch.where(hit_b & (lengths <= la[:, None]), lengths, 0).amax(1)
        lb = torch.where(has_a, lb_in_a, torch.where(lb_all >= self.min_match, lb_all, -1))
        lb = torch.where(cross_ids >= 0, lb, -1)
        la = torch.where(has_a, la, -1)
        active = (la >= 0) | (lb >= 0)
        drafted = torch.zeros(b, dtype=torch.int64, device=self.device)
        step_a = torch.zeros(b, dtype=torch.bool, device=self.device)
        step_b = torch.zeros_like(step_a)
        for s in range(k):
            if s:
                hit_a, val_a = self._lookup(buf, d + s, avail, groups)
                hit_b, val_b = self._lookup(buf, d + s, avail, cross_ids)
                la = torch.where(step_a, self._step(hit_a, la), la)
                lb = torch.where(step_b, self._step(hit_b, lb), lb)
            ok_a, ctx_a, tok_a, prob_a = self._top(hit_a, val_a, la)
            ok_b, ctx_b, tok_b, prob_b = self._top(hit_b, val_b, lb)
            score_a = torch.where(ok_a, prob_a * (1 + ctx_a), 0.0)
            from_b = ok_b & (self.cross_weight * prob_b * (1 + ctx_b) > score_a)
            active = active & (ok_a | from_b)
            tok = torch.where(from_b, tok_b, tok_a)
            buf[:, d + s] = torch.where(active, tok, -1)
            drafted += active
            avail += 1
            step_a = from_b & (la >= 0)
            step_b = ~from_b & (lb >= 0)
            la = torch.where(from_b, la, ctx_a + 1)
            lb = torch.where(from_b, ctx_b + 1, lb)
        out = buf[:, d:]
        cols = torch.arange(k, device=self.device)
        last = out.gather(1, (drafted - 1).clamp(min=0)[:, None])
        out = torch.where(cols < drafted[:, None], out, last)
        out = torch.where(drafted[:, None] > 0, out, text[:, -1:])  # a miss: the last token
        if k:  # no host values: capturable in a CUDA graph
            self.lookups[0] += b
            self.lookups[1] += (drafted > 0).sum()
            self.lookups[2] += ((drafted > 0) & ~has_a).sum()
        return out
