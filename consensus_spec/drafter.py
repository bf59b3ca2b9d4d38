"""Sibling-consensus drafting over suffix tries, independent of any engine.

Paths that continue the same prompt form a sibling group sharing one trie
over the prompt (its tail) and every sibling's output, so a path drafts what
its siblings wrote after the same context, and its own prompt and history
when they offer nothing better. A second, cross-group trie over all recent
outputs is the source, weighted below siblings. Groups are evicted least recently used
beyond a token budget and the cross-group trie starts afresh when full, so
memory stays bounded however many paths pass.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, fields

import numpy as np

from .budget import cost_model
from .trie import SuffixTrie


@dataclass(frozen=True)
class DrafterOptions:
    max_depth: int = 12             # longest context (tokens) matched in a trie
    min_prob: float = 0.05          # stop once P(this draft token accepted) < min_prob
    min_match: int = 1              # shortest context a draft may come from
    prior: float = 0.0              # pseudo-count added to each node's total
    cross_group_weight: float = 0.8  # other prompts' outputs count this much of siblings'
    prompt_tokens: int = 1024       # prompt tail indexed per group
    max_group_tokens: int = 400_000  # LRU budget over all groups' tries
    cross_group_tokens: int = 200_000  # the cross-group trie restarts beyond this
    cost_model: str = "h200_7b"     # step-cost model for the batch-aware budget, or "off"

    def __post_init__(self):
        if self.max_depth < 1 or self.min_match < 1 or self.min_match > self.max_depth:
            raise ValueError("need 1 <= min_match <= max_depth")
        if not 0.0 <= self.min_prob <= 1.0:
            raise ValueError("min_prob must be in [0, 1]")
        if self.prior < 0 or not 0.0 <= self.cross_group_weight <= 1.0:
            raise ValueError("prior must be >= 0 and cross_group_weight in [0, 1]")
        if min(self.prompt_tokens, self.max_group_tokens, self.cross_group_tokens) < 0:
            raise ValueError("token budgets must be >= 0")
        cost_model(self.cost_model)  # validates the name

    @classmethod
    def from_dict(cls, options: dict) -> "DrafterOptions":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown drafter option(s) {unknown}; known: {sorted(known)}")
        return cls(**options)


class Group:
    __slots__ = ("trie", "prompt_node", "num_paths", "alive")

    def __init__(self, max_depth: int, prompt_tail):
        self.trie = SuffixTrie(max_depth)
        self.prompt_node = self.trie.extend(SuffixTrie.ROOT, prompt_tail)
        self.num_paths = 0
        self.alive = True


class Path:
    """One sampled path: where it stands in its group's and the cross-group trie."""

    __slots__ = ("group", "node", "cross", "cross_node", "num_tokens")

    def __init__(self, group: Group, cross: SuffixTrie):
        self.group = group
        self.node = group.prompt_node
        self.cross = cross
        self.cross_node = SuffixTrie.ROOT
        self.num_tokens = 0  # output tokens seen


def prompt_key(prompt) -> bytes:
    return np.asarray(prompt, dtype=np.int64).tobytes()


class ConsensusDrafter:
    def __init__(self, options: DrafterOptions | None = None):
        self.options = options or DrafterOptions()
        self._groups: OrderedDict[bytes, Group] = OrderedDict()
        self._group_tokens = 0
        self._cross = SuffixTrie(self.options.max_depth)

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def num_nodes(self) -> int:
        """Trie nodes held (groups and cross-group), for memory checks."""
        return sum(len(g.trie) for g in self._groups.values()) + len(self._cross)

    def add_path(self, prompt) -> Path:
        """Register a new path continuing ``prompt`` (token ids)."""
        key = prompt_key(prompt)
        group = self._groups.get(key)
        if group is None:
            n = self.options.prompt_tokens
            tail = np.asarray(prompt[len(prompt) - n:] if n else prompt[:0]).tolist()
            group = Group(self.options.max_depth, tail)
            self._groups[key] = group
            self._group_tokens += group.trie.num_tokens
        else:
            self._groups.move_to_end(key)
        group.num_paths += 1
        self._evict()
        return Path(group, self._cross)

    def extend(self, path: Path, tokens) -> None:
        """Record output tokens the path has generated."""
        if not len(tokens):
            return
        if not path.group.alive:  # evicted under it: continue in a private group
            path.group = Group(self.options.max_depth, [])
            path.node = SuffixTrie.ROOT
        path.node = path.group.trie.extend(path.node, tokens)
        self._group_tokens += len(tokens)
        if path.cross is not self._cross:  # the cross-group trie was renewed
            path.cross = self._cross
            path.cross_node = SuffixTrie.ROOT
        path.cross_node = self._cross.extend(path.cross_node, tokens)
        path.num_tokens += len(tokens)
        if self._cross.num_tokens > self.options.cross_group_tokens:
            self._cross = SuffixTrie(self.options.max_depth)  # paths rejoin it as they extend
        if self._group_tokens > self.options.max_group_tokens:
            self._evict()

    def draft(self, path: Path, max_tokens: int) -> tuple[list[int], list[float]]:
        """Most likely continuation of ``path``, at most ``max_tokens`` long,
        with the estimated chance that each prefix is accepted.

        Each token comes from whichever source (siblings, or all recent
        outputs at ``cross_group_weight``) scores higher on
        ``weight * P(token | context) * (1 + context length)``; the draft ends
        once the running product of the chosen probabilities, the estimated
        chance that the token is accepted, drops below ``min_prob``.
        """
        o = self.options
        tries, nodes, weights = [], [], []
        if path.group.alive:
            tries.append(path.group.trie)
            nodes.append(path.node)
            weights.append(1.0)
        if o.cross_group_weight > 0 and path.cross is self._cross:
            tries.append(self._cross)
            nodes.append(path.cross_node)
            weights.append(o.cross_group_weight)
        out: list[int] = []
        probs: list[float] = []
        p = 1.0
        while len(out) < max_tokens:
            chosen, best_score, best_prob = None, 0.0, 0.0
            for s, trie in enumerate(tries):
                top = trie.top(nodes[s], o.min_match)
                if top is None:
                    continue
                prob = top[1] / (top[2] + o.prior)
                score = weights[s] * prob * (1 + top[3])
                if score > best_score:
                    chosen, best_score, best_prob = (s, top), score, prob
            if chosen is None:
                break
            p *= best_prob
            if p < o.min_prob:
                break
            s, (tok, _, _, _, child) = chosen
            out.append(tok)
            probs.append(p)
            for j, trie in enumerate(tries):
                nodes[j] = child if j == s else trie.step(nodes[j], tok)
        return out, probs

    def _evict(self) -> None:
        while self._group_tokens > self.options.max_group_tokens and len(self._groups) > 1:
            _, group = self._groups.popitem(last=False)
            self._group_tokens -= group.trie.num_tokens
            group.alive = False
            group.trie = SuffixTrie(1)  # free it even while parked paths point here
