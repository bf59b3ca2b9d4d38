"""DeepConf-style trace confidence (consensus_spec/voting/confidence.py) and
the vote that uses it (Voting(weighted=True, weight_method="confidence"))."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from consensus_spec.sampling.self_consistency import Voting, run_paths
from consensus_spec.voting.confidence import (RunningConfidence, confidence_weights, confident_paths,
                                              token_confidence, trace_confidence)
from tests.test_self_consistency import FakeEngine, params_factory


def test_token_confidence_reads_sampled_and_top_k_entries():
    assert token_confidence(-0.5) == -0.5
    assert token_confidence({7: SimpleNamespace(logprob=-0.25)}) == -0.25  # vLLM, logprobs=0
    assert token_confidence([-0.1, -3.0, -5.9]) == pytest.approx(3.0)  # top-k: minus the mean
    with pytest.raises(ValueError, match="empty"):
        token_confidence([])


def test_trace_confidence_is_the_worst_window():
    lps = [-0.1] * 20 + [-2.0] * 4 + [-0.1] * 20
    assert trace_confidence(lps, 4) == pytest.approx(-2.0)
    assert trace_confidence(lps, 8) == pytest.approx((-0.1 * 4 - 2.0 * 4) / 8)
    assert trace_confidence([-1.0, -3.0], 16) == pytest.approx(-2.0)  # shorter than a window
    assert trace_confidence([], 4) is None
    assert trace_confidence([-math.inf, -0.1], 2) < -100  # a forced token counts as very unsure
    with pytest.raises(ValueError, match="window"):
        trace_confidence([-1.0], 0)


def test_confident_paths_and_weights():
    conf = [-0.1, -2.0, None, -0.5, -1.0]
    assert confident_paths(conf, 0.5) == [0, 3]
    assert confident_paths(conf, 1.0) == [0, 1, 3, 4]
    assert confident_paths([None, None], 0.5) == [0, 1]  # no score: a plain vote
    assert confident_paths([-1.0, -1.0, -2.0], 0.3) == [0, 1]  # ties kept together
    paths = [[-0.1] * 4, [-2.0] * 4, [-0.5] * 4]
    w = confidence_weights(paths, keep=0.6, window=4)
    assert w[1] == 0.0 and w[0] == pytest.approx(math.exp(-0.1)) and w[2] == pytest.approx(math.exp(-0.5))
    assert confidence_weights([None, None], 0.5) == [1.0, 1.0]
    topk = [[[-0.1, -9.0]] * 4, [[-1.0, -1.5]] * 4]
    assert confidence_weights(topk, keep=1.0, window=4) == pytest.approx([4.55, 1.25])


def test_running_confidence_ends_a_path_once_a_full_window_is_low():
    run = RunningConfidence(window=3, threshold=-1.0)
    for lp in (-0.1, -5.0):
        run.add(lp)
        assert not run.low()  # not a full window yet
    run.add(-0.1)
    assert run.low() and run.current == pytest.approx(-5.2 / 3)
    run.add(-0.1)
    assert run.low()  # -5.0 is still in the window
    run.add(-0.1)
    assert not run.low() and run.current == pytest.approx(-0.1)


class LogprobEngine(FakeEngine):
    """FakeEngine whose outputs carry per-token logprobs: path k of a problem
    writes tokens with logprob ``table[k]``."""

    def __init__(self, script, token_lp):
        super().__init__(script)
        self.token_lp = token_lp

    def step(self):
        outs = super().step()
        for out in outs:
            k = int(out.request_id.rsplit("-", 1)[1])
            c = out.outputs[0]
            c.logprobs = [{7: SimpleNamespace(logprob=self.token_lp[k])} for _ in c.token_ids]
        return outs


def test_confidence_vote_drops_the_least_sure_paths():
    # three unsure paths say 4, two sure ones say 5: the plain vote says 4
    answers = ["4", "4", "4", "5", "5"]
    token_lp = [-3.0, -3.0, -2.5, -0.05, -0.1]

    def script(prompt, params):
        return ["x "] * 6 + [f"The answer is {answers[params.k]}."]

    (plain,) = run_paths(FakeEngine(script), ["q"], params_factory(), n=5)
    engine = LogprobEngine(script, token_lp)
    (sure,) = run_paths(engine, ["q"], params_factory(), n=5,
                        voting=Voting(weighted=True, weight_method="confidence", confidence_keep=0.4,
                                      confidence_window=4))
    assert plain.answer == "4" and sure.answer == "5"
    assert sure.weights[:3] == [0.0, 0.0, 0.0] and all(w > 0 for w in sure.weights[3:])
    for bad in ({"confidence_keep": 0.0}, {"confidence_window": 0}):
        with pytest.raises(ValueError, match="confidence"):
            Voting(**bad)


def test_confidence_command_on_traces_with_logprobs(tmp_path):
    """Sure paths give the gold answer, unsure ones a wrong one: filtering
    helps, and ending low paths saves tokens; a set without logprobs is
    reported and left out."""
    import json

    from tests.evals_cli import ok, read_json, run_evals

    lines = []
    for p in range(12):
        comps, lps, answers = [], [], []
        for k in range(8):
            sure = k % 4 != 0 if p % 2 else k < 3
            answers.append("7" if sure else str(10 + k))
            comps.append(f"work {k} The answer is {answers[-1]}.")
            lps.append([-0.05 if sure else -2.5] * (20 + k))
        lines.append({"id": f"p{p}", "prompt": "q", "completions": comps, "answers": answers,
                      "gold": "7", "logprobs": lps})
    path = tmp_path / "conf.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    bare = tmp_path / "bare.jsonl"
    bare.write_text(json.dumps({"id": "x", "prompt": "q", "completions": ["a 1", "b 2"]}) + "\n")
    run = run_evals("confidence", "--traces", path, bare, "--window", "4", "--keep", "0.5", "--perms", "2",
                    "--out", tmp_path / "c")
    text = ok(run)
    assert "bare: no problems with per-path logprobs" in run.stderr
    rows = read_json(tmp_path / "c.json")["results"]
    filtered = next(r for r in rows if r["kind"] == "filtered")
    assert filtered["acc"] == 1.0 and filtered["acc_w"] == 1.0
    full = next(r for r in rows if r["kind"] == "ended" and r["keep"] is None and r["rule"] == "off")
    ended = next(r for r in rows if r["kind"] == "ended" and r["keep"] == 0.5 and r["rule"] == "off")
    assert full["tokens"] == 1.0 and ended["tokens"] < 1.0 and ended["ended"] > 0
    assert "top 50% by confidence" in text
