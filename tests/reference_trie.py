"""Bounded-depth suffix trie with counts: the probabilistic token trie.

This pure-Python version is the readable reference; the drafter runs the
same structure compiled, many tries per arena (:mod:`consensus_spec.drafting.forest`).

Every substring of at most ``max_depth`` tokens of every inserted sequence is a
path from the root, and a node's count is how often that substring occurred.
A node's most frequent child, and that child's share of all continuations,
give the next draft token and its probability; walking drafts over several
tries is the caller's business.

Suffix links (node for ``s`` -> node for ``s[1:]``) let a sequence be extended
in O(max_depth) per token and let a draft back off to a shorter context
without rescanning anything. Nodes live in flat int32 arrays, not per-node objects; edges are one dict keyed by ``parent << 21 | token``.
"""

from __future__ import annotations

from array import array

_TOKEN_BITS = 21  # vocabularies up to 2M tokens
_TOKEN_LIMIT = 1 << _TOKEN_BITS


class SuffixTrie:
    """Counts of all substrings up to ``max_depth`` tokens, with suffix links."""

    ROOT = 0

    def __init__(self, max_depth: int = 16):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self._edges: dict[int, int] = {}
        self._token = array("i", [-1])  # token on the edge into the node
        self._depth = array("i", [0])
        self._count = array("i", [0])   # occurrences of the node's string
        self._total = array("i", [0])   # sum of children's counts
        self._best = array("i", [-1])   # most frequent child (ties: first to reach the count)
        self._link = array("i", [0])    # suffix link
        self.num_tokens = 0  # tokens inserted, for memory accounting

    def __len__(self) -> int:
        return len(self._depth)

    def depth(self, node: int) -> int:
        return self._depth[node]

    def extend(self, node: int, tokens) -> int:
        """Append ``tokens`` to a sequence whose longest suffix node is ``node``.

        Start a new sequence from ``SuffixTrie.ROOT``. Returns the node of the
        sequence's new longest suffix (at most ``max_depth`` tokens).
        """
        edges, depth, count, total, best, link = (
            self._edges, self._depth, self._count, self._total, self._best, self._link)
        max_depth = self.max_depth
        for tok in tokens:
            if not 0 <= tok < _TOKEN_LIMIT:
                raise ValueError(f"token id {tok} out of range")
            deepest = -1
            prev = -1
            n = node
            while True:
                if depth[n] < max_depth:
                    key = (n << _TOKEN_BITS) | tok
                    c = edges.get(key)
                    if c is None:
                        c = len(depth)
                        edges[key] = c
                        self._token.append(tok)
                        depth.append(depth[n] + 1)
                        count.append(0)
                        total.append(0)
                        best.append(-1)
                        link.append(0)
                    count[c] += 1
                    total[n] += 1
                    b = best[n]
                    if b < 0 or (b != c and count[c] > count[b]):
                        best[n] = c
                    if prev >= 0:
                        link[prev] = c
                    else:
                        deepest = c
                    prev = c
                if n == 0:
                    break
                n = link[n]
            link[prev] = 0  # the depth-1 node links to the root
            node = deepest
        self.num_tokens += len(tokens)
        return node

    def step(self, node: int, tok: int) -> int:
        """Node of the longest suffix of (``node``'s string + ``tok``) in the trie."""
        edges, depth, link, max_depth = self._edges, self._depth, self._link, self.max_depth
        while True:
            if depth[node] < max_depth:
                c = edges.get((node << _TOKEN_BITS) | tok)
                if c is not None:
                    return c
            if node == 0:
                return 0
            node = link[node]

    def match(self, tokens) -> int:
        """Node of the longest suffix of ``tokens`` present in the trie."""
        n = 0
        for tok in tokens[-self.max_depth:]:
            n = self.step(n, int(tok))
        return n

    def top(self, node: int, min_depth: int = 1):
        """Most frequent continuation of ``node``'s context, backing off along
        suffix links to the longest context (>= ``min_depth``) that has one.

        Returns ``(token, count, total, depth, child)``, or None.
        """
        total, depth, link = self._total, self._depth, self._link
        while total[node] == 0 and depth[node] > min_depth:
            node = link[node]
        if total[node] == 0 or depth[node] < min_depth:
            return None
        b = self._best[node]
        return self._token[b], self._count[b], total[node], depth[node], b


def joint_draft(sources, max_tokens: int, min_prob: float, min_match: int = 1,
                prior: float = 0.0) -> tuple[list[int], list[float]]:
    """Reference walk over several ``(trie, node, weight)`` sources at once.

    Each token comes from the source scoring highest on
    ``weight * P(token | context) * (1 + context length)`` (ties: the earlier
    source); the chosen source moves to the child, the others ``step`` by the
    token. The walk ends once the running product of the chosen probabilities
    (the estimated chance this token is accepted) drops below ``min_prob``.
    ``SuffixForest.draft_many`` computes the same for a whole batch.
    """
    tries = [t for t, _, _ in sources]
    nodes = [n for _, n, _ in sources]
    weights = [w for _, _, w in sources]
    out: list[int] = []
    probs: list[float] = []
    p = 1.0
    while len(out) < max_tokens:
        chosen, best_score, best_prob = None, 0.0, 0.0
        for s, trie in enumerate(tries):
            top = trie.top(nodes[s], min_match)
            if top is None:
                continue
            prob = top[1] / (top[2] + prior)
            score = weights[s] * prob * (1 + top[3])
            if score > best_score:
                chosen, best_score, best_prob = (s, top), score, prob
        if chosen is None:
            break
        p *= best_prob
        if p < min_prob:
            break
        s, (tok, _, _, _, child) = chosen
        out.append(tok)
        probs.append(p)
        for j, trie in enumerate(tries):
            nodes[j] = child if j == s else trie.step(nodes[j], tok)
    return out, probs
