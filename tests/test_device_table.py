"""The device table's torch walk (``ContextTable.draft``) drafts what the
host's walk drafts from the same tries (``lagged.table_contexts``, then the
forest's joint greedy walk), row for row and step for step, on the
recorded fixture: the device route's drafts are the host drafter's, padded
to K as the route pads them."""

import numpy as np
import pytest
import torch

from consensus_spec.device_route.options import RouteOptions
from consensus_spec.device_route.route import DeviceRoute
from consensus_spec.drafting import DrafterOptions, lagged
from tests import draft_fixture

K = 4


def host_drafts(route, buf, lens, paths):
    """K tokens per row from the host's tries: the walk from the contexts
    the table looks up; a short draft padded with its last token, a miss
    with the row's last token."""
    d = route.tries.drafter
    o, f = d.options, d.forest
    a, b = lagged.table_contexts(*f.arena(), o.max_depth, o.min_match, buf, lens,
                                 d.group_roots(paths, attach=False), d.cross_root)
    toks, _, got = f.draft_many(a, b, o.cross_group_weight, np.full(len(paths), K), K, 0.0,
                                o.min_match, o.prior)
    out = []
    for i, n in enumerate(got.tolist()):
        row = toks[i, :n].tolist()
        out.append(row + [row[-1]] * (K - n) if n else [int(buf[i, lens[i] - 1])] * K)
    return out


@pytest.mark.parametrize("lag", [0, 2])
@pytest.mark.parametrize("small", [False, True])
def test_the_table_drafts_what_the_host_walk_drafts(lag, small):
    problems = draft_fixture.load_problems()
    rng = np.random.default_rng(lag)
    # small: the arena's halves rotate and the cross-group trie restarts under way
    options = DrafterOptions(**({"max_trie_nodes": 6000, "cross_group_tokens": 800,
                                 "prompt_tokens": 64} if small else {}))
    rows = 8
    route = DeviceRoute(options, RouteOptions(route="device", lag=lag), rows, 3, "cpu")
    width = max(len(p) + max(map(len, c)) for p, c in problems) + 8
    token_ids = torch.zeros((rows, width), dtype=torch.int64)
    total_len = torch.zeros(rows, dtype=torch.int64)
    queue = [(p, s) for p in range(len(problems)) for s in range(len(problems[p][1]))]
    batch, prompts = [], {}  # batch: [request id, sequence, tokens so far]
    drafted = hits = 0
    while queue or batch:
        batch = [r for r in batch if r[2] < len(r[1])]
        counts = []
        for r in batch:  # each row wrote 1-3 tokens this step
            c = min(int(rng.integers(1, 4)), len(r[1]) - r[2])
            r[2] += c
            counts.append(c)
        while len(batch) < rows and queue:
            p, s = queue.pop(0)
            prompt, outputs = problems[p]
            req = f"{p}-{s}"
            prompts[req] = prompt
            batch.append([req, prompt + outputs[s], len(prompt) + 1])
            counts.append(1)
        for i, (_, seq, n) in enumerate(batch):
            token_ids[i, :n] = torch.tensor(seq[:n])
            total_len[i] = n
        live = {r[0] for r in batch}
        req_ids = [r[0] for r in batch]
        drafts = route.step(req_ids, live.__contains__, lambda q: (prompts[q], []),
                            torch.arange(len(batch)), token_ids, total_len,
                            torch.tensor(counts), K)
        paths = np.array([route.paths[q] for q in req_ids], np.int64)
        lens = total_len[:len(batch)].numpy()
        want = host_drafts(route, token_ids[:len(batch)].numpy(), lens, paths)
        assert drafts.tolist() == want
        drafted += len(want)
        hits += sum(w != [int(token_ids[i, lens[i] - 1])] * K for i, w in enumerate(want))
    assert drafted > 500 and hits > drafted // 4  # most rows found a context
    if small:
        assert route.tries.drafter.evictions > 0 and route.tries.cross_restarts > 0
