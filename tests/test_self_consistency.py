"""Self-consistency driver logic against a fake engine (no vLLM needed),
plus one real vLLM run on a tiny random model (skipped without vLLM)."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest

pytest.importorskip("math_verify")

from consensus_spec.self_consistency import (  # noqa: E402
    PathPlanner,
    SpecDecodeStats,
    _render_prompt,
    _tokens_saved,
    read_spec_counters,
    run_paths,
    should_stop,
    spec_stats_delta,
)
from consensus_spec.voting import majority_vote  # noqa: E402

TOKEN_LOGPROB = -0.1


class FakeEngine:
    """The slice of vllm's LLMEngine that run_paths uses.  Each step emits one
    token per running request; at most ``slots`` requests run (FCFS)."""

    def __init__(self, script, slots=1000):
        self.script = script  # (prompt, params) -> list of text chunks
        self.slots = slots
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.reqs: dict[str, dict] = {}
        self.log: list[tuple[str, str]] = []

    def add_request(self, rid, prompt, params, arrival_time=None):
        assert rid not in self.reqs
        self.reqs[rid] = dict(params=params, chunks=self.script(prompt, params), pos=0)
        self.waiting.append(rid)
        self.log.append(("add", rid))

    def abort_request(self, ids):
        for rid in ids:
            for q in (self.waiting, self.running):
                if rid in q:
                    q.remove(rid)
            self.log.append(("abort", rid))

    def has_unfinished_requests(self):
        return bool(self.waiting or self.running)

    def step(self):
        while self.waiting and len(self.running) < self.slots:
            self.running.append(self.waiting.pop(0))
        outs = []
        for rid in list(self.running):
            r = self.reqs[rid]
            r["pos"] += 1
            done = r["pos"] == len(r["chunks"])
            delta = r["params"].delta
            text = r["chunks"][r["pos"] - 1] if delta else "".join(r["chunks"][: r["pos"]])
            completion = SimpleNamespace(
                text=text,
                token_ids=[7] if delta else [7] * r["pos"],
                cumulative_logprob=r["params"].logprob * r["pos"],
                finish_reason="stop" if done else None,
            )
            if done or delta:  # FINAL_ONLY requests report only when finished
                outs.append(SimpleNamespace(request_id=rid, outputs=[completion], finished=done))
            if done:
                self.running.remove(rid)
                self.log.append(("finish", rid))
        return outs

    def generated(self, p, k):
        """Tokens produced so far by path k of problem p (0 if never added)."""
        rid = next((r for r in self.reqs if r.endswith(f"-{p}-{k}")), None)
        return self.reqs[rid]["pos"] if rid else 0


def params_factory(delta=False, logprob=TOKEN_LOGPROB):
    def make(p, k):
        lp = logprob(p, k) if callable(logprob) else logprob
        return SimpleNamespace(p=p, k=k, delta=delta, logprob=lp)
    return make


def script_from(table):
    """table[p][k] = (answer, length): path k of problem p writes ``length``
    filler chunks then "The answer is <answer>."."""
    def script(prompt, params):
        answer, length = table[params.p][params.k]
        return ["step "] * length + [f"The answer is {answer}."]
    return script


def adds(engine):
    return [tuple(int(x) for x in rid.split("-")[1:]) for kind, rid in engine.log if kind == "add"]


# ---------------------------------------------------------------------------
# Result assembly
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("delta", [False, True])
def test_results_are_assembled_from_outputs(delta):
    table = [
        [("5", 3), ("5", 1), ("0.5", 2), ("6", 4)],
        [(r"\frac12", 2), ("0.5", 2), ("1/2", 5), (r"\dfrac{1}{2}", 1)],
    ]
    engine = FakeEngine(script_from(table))
    res = run_paths(engine, ["q0", "q1"], params_factory(delta), n=4, delta=delta)
    assert [r.index for r in res] == [0, 1]
    r0, r1 = res
    assert [s.path for s in r0.samples] == [0, 1, 2, 3]
    assert [s.answer for s in r0.samples] == ["5", "5", "0.5", "6"]
    assert r0.samples[0].text == "step step step The answer is 5."
    assert [s.num_tokens for s in r0.samples] == [4, 2, 3, 5]
    assert r0.samples[3].cumulative_logprob == pytest.approx(5 * TOKEN_LOGPROB)
    assert r0.samples[3].mean_logprob == pytest.approx(TOKEN_LOGPROB)
    assert r0.samples[0].finish_reason == "stop"
    assert r0.answer == "5" and r0.counts == {"5": 2, "0.5": 1, "6": 1}
    assert r0.agreement == 0.5
    assert r1.answer == r"\frac12" and r1.agreement == 1.0 and len(r1.vote.classes) == 1
    assert r0.num_tokens == 14 and r0.num_aborted == 0 and not r0.stopped_early
    assert r0.best_of_n().index == 0  # equal mean logprobs: earliest wins
    assert not engine.has_unfinished_requests()


def test_weighted_vote_uses_mean_logprobs():
    table = [[("1", 2), ("1", 2), ("9", 2)]]
    confident = lambda p, k: -0.01 if k == 2 else -2.0  # noqa: E731
    engine = FakeEngine(script_from(table))
    (r,) = run_paths(engine, ["q"], params_factory(logprob=confident), n=3, weighted=True)
    assert r.answer == "9"
    assert r.weights == pytest.approx([math.exp(-2.0), math.exp(-2.0), math.exp(-0.01)])
    (plain,) = run_paths(FakeEngine(script_from(table)), ["q"], params_factory(), n=3)
    assert plain.answer == "1"


def test_no_answer_samples_abstain():
    engine = FakeEngine(lambda prompt, params: ["I give up"] if params.k else ["#### 3"])
    (r,) = run_paths(engine, ["q"], params_factory(), n=3)
    assert [s.answer for s in r.samples] == ["3", None, None]
    assert r.answer == "3" and r.agreement == 1.0 and r.vote.num_abstained == 2


def test_refuses_a_busy_engine():
    engine = FakeEngine(lambda prompt, params: ["x"])
    engine.add_request("someone-else", "p", SimpleNamespace(delta=False, logprob=0.0))
    with pytest.raises(RuntimeError):
        run_paths(engine, ["q"], params_factory(), n=2)


def test_error_mid_run_leaves_engine_idle():
    table = [[("1", 1), ("2", 6), ("3", 6)]]
    engine = FakeEngine(script_from(table))

    def extract(text):
        raise KeyError("boom")

    with pytest.raises(KeyError):
        run_paths(engine, ["q"], params_factory(), n=3, extract=extract)
    assert not engine.has_unfinished_requests()
    assert {rid for kind, rid in engine.log if kind == "abort"} == {
        rid for kind, rid in engine.log if kind == "add"} - {
        rid for kind, rid in engine.log if kind == "finish"}


def test_prompt_rendering():
    assert _render_prompt("2+2?", None) == "2+2?"
    tpl = r"Put the answer in \boxed{}. Problem: {problem}"
    assert _render_prompt("2+2?", tpl) == r"Put the answer in \boxed{}. Problem: 2+2?"
    assert _render_prompt({"q": "hi"}, lambda p: p["q"] + "!") == "hi!"
    seen = []
    engine = FakeEngine(lambda prompt, params: seen.append(prompt) or ["#### 1"])
    run_paths(engine, ["a", "b"], params_factory(), n=2, render=lambda p: {"rendered": p})
    assert seen == [{"rendered": "a"}] * 2 + [{"rendered": "b"}] * 2


# ---------------------------------------------------------------------------
# Scouts and admission
# ---------------------------------------------------------------------------


def test_planner_scouts_then_followups_pipelined():
    plan = PathPlanner(3, n=4, scouts=2, capacity=4)
    assert plan.admit() == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert plan.admit() == []  # full
    # one of problem 0's scouts finishes: room for problem 2's scouts
    assert plan.on_finish(0, 0, "a") == ([(2, 0), (2, 1)], [])
    # problem 0's last scout: its follow-ups go out even though we are full
    assert plan.on_finish(0, 1, "a") == ([(0, 2), (0, 3)], [])
    assert plan.on_finish(1, 1, "b") == ([], [])  # scout 0 of problem 1 still running
    assert plan.on_finish(1, 0, "b") == ([(1, 2), (1, 3)], [])
    for p, k in [(0, 2), (0, 3), (1, 2), (1, 3), (2, 0)]:
        assert plan.on_finish(p, k, "x") == ([], [])
    assert not plan.all_done
    assert plan.on_finish(2, 1, "x") == ([(2, 2), (2, 3)], [])
    plan.on_finish(2, 2, "x")
    plan.on_finish(2, 3, "x")
    assert plan.all_done and plan.num_inflight == 0


def test_planner_without_scouts_or_capacity_submits_everything():
    plan = PathPlanner(2, n=3)
    assert plan.admit() == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert PathPlanner(1, n=3, scouts=3).admit() == [(0, 0), (0, 1), (0, 2)]


@pytest.mark.parametrize("kwargs", [dict(n=0), dict(n=2, scouts=3), dict(n=2, scouts=-1)])
def test_planner_rejects_bad_args(kwargs):
    with pytest.raises(ValueError):
        PathPlanner(1, **kwargs)


def test_scouts_run_before_followups_in_the_engine():
    table = [[("1", 2 + k) for k in range(4)] for _ in range(3)]
    engine = FakeEngine(script_from(table))
    res = run_paths(engine, ["a", "b", "c"], params_factory(), n=4, scouts=1, capacity=2)
    order = adds(engine)
    assert order[:2] == [(0, 0), (1, 0)]  # capacity 2: two problems' scouts
    finished = [tuple(int(x) for x in rid.split("-")[1:]) for kind, rid in engine.log if kind == "finish"]
    for p in range(3):
        scout_done = engine.log.index(("finish", next(r for r in engine.reqs if r.endswith(f"-{p}-0"))))
        followups = [i for i, (kind, rid) in enumerate(engine.log)
                     if kind == "add" and rid.split("-")[2] != "0" and rid.split("-")[1] == str(p)]
        assert followups and min(followups) > scout_done
    # problem 0's follow-ups are submitted before problem 2 is admitted
    assert order.index((0, 1)) < order.index((2, 0))
    assert sorted(finished) == [(p, k) for p in range(3) for k in range(4)]
    assert all(r.answer == "1" and len(r.samples) == 4 for r in res)


# ---------------------------------------------------------------------------
# Early stop
# ---------------------------------------------------------------------------


def test_should_stop_rule():
    v = majority_vote(["5", "5", "5", "7"])  # lead 2
    assert should_stop(v, remaining=1)
    assert not should_stop(v, remaining=2)  # 2 more for 7 would tie
    assert should_stop(v, remaining=10, margin=2)
    assert not should_stop(v, remaining=10, margin=3)
    assert not should_stop(majority_vote([None, None]), remaining=0)
    assert should_stop(majority_vote(["1"]), remaining=0)
    weighted = majority_vote(["5", "7"], weights=[0.9, 0.2])
    assert should_stop(weighted, remaining=0) and not should_stop(weighted, remaining=1)


def test_tokens_saved_estimate():
    assert _tokens_saved([10, 20], [5, 0, 0], max_tokens=100) == 10 + 15 + 15
    assert _tokens_saved([], [3], max_tokens=50) == 47
    assert _tokens_saved([4], [9], max_tokens=50) == 0


def test_early_stop_when_decided():
    # 8 paths all answering 5; lengths make paths finish in path order
    table = [[("5", 2 + 3 * k) for k in range(8)]]
    engine = FakeEngine(script_from(table))
    (r,) = run_paths(engine, ["q"], params_factory(delta=True), n=8, early_stop=True, delta=True)
    # after 5 agreeing votes the lead (5) exceeds the 3 remaining paths
    assert r.stopped_early and len(r.samples) == 5 and r.num_aborted == 3
    assert r.answer == "5" and r.agreement == 1.0
    aborted = [(0, k) for k in range(5, 8)]
    assert {tuple(int(x) for x in rid.split("-")[1:]) for kind, rid in engine.log if kind == "abort"} == set(aborted)
    assert r.aborted_tokens == sum(engine.generated(*pk) for pk in aborted)
    # every aborted path had already run past the mean finished length
    assert r.est_tokens_saved == 0
    assert r.num_tokens == sum(s.num_tokens for s in r.samples) + r.aborted_tokens


def test_early_stop_margin_saves_unstarted_paths():
    table = [[("5", 2 + 3 * k) for k in range(8)]]
    engine = FakeEngine(script_from(table), slots=5)
    (r,) = run_paths(engine, ["q"], params_factory(delta=True), n=8, early_stop=2, delta=True)
    # paths 0 and 1 agree -> lead 2 reaches the margin; paths 6, 7 never started
    assert r.stopped_early and [s.path for s in r.samples] == [0, 1]
    assert r.num_aborted == 6
    assert engine.generated(0, 6) == engine.generated(0, 7) == 0
    mean_len = (3 + 6) / 2
    expected = sum(max(0.0, mean_len - engine.generated(0, k)) for k in range(2, 8))
    assert expected > 0 and r.est_tokens_saved == round(expected)
    assert r.aborted_tokens == sum(engine.generated(0, k) for k in range(2, 8))


def test_on_problem_done_called_once_per_problem_when_complete():
    # problem 0 stops early (all agree), problem 1 runs all paths
    table = [[("5", 2 + k) for k in range(4)], [(str(k % 2), 3 + k) for k in range(4)]]
    engine = FakeEngine(script_from(table), slots=3)
    done = []

    def record(p):
        done.append(p)
        samples_so_far = {k for kind, rid in engine.log if kind == "finish"
                          for q, k in [tuple(int(x) for x in rid.split("-")[1:])] if q == p}
        assert samples_so_far  # only after some path of p finished

    res = run_paths(engine, ["a", "b"], params_factory(delta=True), n=4, early_stop=True,
                    delta=True, capacity=3, on_problem_done=record)
    assert sorted(done) == [0, 1] and len(done) == 2
    assert res[0].stopped_early and not res[1].stopped_early


def test_early_stop_not_triggered_by_a_close_race():
    table = [[(str(k % 2), 2 + k) for k in range(6)]]
    engine = FakeEngine(script_from(table))
    (r,) = run_paths(engine, ["q"], params_factory(delta=True), n=6, early_stop=True, delta=True)
    assert not r.stopped_early and len(r.samples) == 6 and r.num_aborted == 0
    assert r.est_tokens_saved == 0 and r.answer == "0"


def test_scouts_with_margin_stop_skip_followups():
    table = [[("4", 3)] * 8, [("4", 3), ("5", 3), ("4", 3)] + [("4", 5)] * 5]
    engine = FakeEngine(script_from(table))
    res = run_paths(engine, ["a", "b"], params_factory(delta=True), n=8, scouts=3,
                    early_stop=3, delta=True)
    a, b = res
    assert a.stopped_early and len(a.samples) == 3 and a.num_aborted == 5
    assert a.aborted_tokens == 0  # nothing beyond the scouts ever ran
    assert a.est_tokens_saved == 5 * 4
    assert not any(p == 0 and k >= 3 for p, k in adds(engine))
    # problem b's scouts split 2-1: follow-ups run until the lead reaches 3
    assert b.stopped_early and b.counts["4"] - b.counts.get("5", 0) >= 3
    assert any(p == 1 and k >= 3 for p, k in adds(engine))


@pytest.mark.parametrize("early_stop", ["sometimes", -1, 0.0])
def test_bad_early_stop_values(early_stop):
    engine = FakeEngine(lambda prompt, params: ["#### 1"])
    with pytest.raises(ValueError):
        run_paths(engine, ["q"], params_factory(), n=2, early_stop=early_stop)


def test_early_stop_rejects_softmax_weights():
    engine = FakeEngine(lambda prompt, params: ["#### 1"])
    with pytest.raises(ValueError):
        run_paths(engine, ["q"], params_factory(), n=2, early_stop=True, weighted=True,
                  weight_method="softmax")


# ---------------------------------------------------------------------------
# Spec-decode metrics
# ---------------------------------------------------------------------------


class FakeLLM:
    def __init__(self, metrics):
        self.metrics = metrics

    def get_metrics(self):
        if isinstance(self.metrics, Exception):
            raise self.metrics
        return self.metrics


def counter(name, value, engine="0"):
    return SimpleNamespace(name=name, value=value, labels={"engine": engine})


def test_spec_counters_summed_and_diffed():
    before = read_spec_counters(FakeLLM([
        counter("vllm:spec_decode_num_drafts", 10),
        counter("vllm:spec_decode_num_draft_tokens", 40),
        counter("vllm:spec_decode_num_accepted_tokens", 20),
        counter("vllm:spec_decode_num_accepted_tokens", 5, engine="1"),
        SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[1, 2]),
        counter("vllm:generation_tokens", 999),
    ]))
    assert before == {"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 25}
    after = {"num_drafts": 30, "num_draft_tokens": 120, "num_accepted_tokens": 85}
    stats = spec_stats_delta(before, after)
    assert stats == SpecDecodeStats(num_drafts=20, num_draft_tokens=80, num_accepted_tokens=60)
    assert stats.acceptance_rate == 0.75
    assert stats.mean_acceptance_length == 4.0  # 1 + 60/20, bonus token included


def test_spec_counters_unavailable_is_none():
    assert read_spec_counters(FakeLLM(AssertionError("Stat logging disabled"))) is None
    assert read_spec_counters(FakeLLM([counter("vllm:generation_tokens", 5)])) is None
    assert spec_stats_delta(None, {"num_drafts": 1}) is None
    empty = SpecDecodeStats(0, 0, 0)
    assert empty.acceptance_rate is None and empty.mean_acceptance_length is None


# ---------------------------------------------------------------------------
# Real vLLM (tiny random model); slow
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.vllm
def test_self_consistency_on_vllm(tmp_path_factory):
    pytest.importorskip("vllm")
    if os.environ.get("CONSENSUS_SKIP_VLLM"):
        pytest.skip("CONSENSUS_SKIP_VLLM set")
    from vllm import LLM

    from consensus_spec.self_consistency import self_consistency
    try:
        from tests.tiny_model import build_tiny_llama
    except ImportError:  # tests/ not a package
        from tiny_model import build_tiny_llama

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    path = build_tiny_llama(str(tmp_path_factory.mktemp("tiny") / "llama"))
    llm = LLM(model=path, max_model_len=256, seed=0, dtype="float32", disable_log_stats=False,
              enforce_eager=True, max_num_seqs=8, gpu_memory_utilization=0.05)
    try:
        _check_real_engine(llm, self_consistency)
    finally:  # stop the engine process while pytest's output capture is live
        llm.llm_engine.engine_core.shutdown()


def _check_real_engine(llm, self_consistency):
    probs = ["one plus two is", "three times four is"]
    run = self_consistency(llm, probs, n=4, max_tokens=12, seed=1, scouts=2, early_stop=3)
    assert len(run) == 2 and run.wall_time_s > 0
    for r in run:
        assert len(r.samples) + r.num_aborted == 4
        assert all(s.num_tokens > 0 and s.cumulative_logprob is not None for s in r.samples)
        assert all(s.cumulative_logprob <= 0 for s in r.samples)
        assert r.vote.num_votes + r.vote.num_abstained == len(r.samples)
    assert run.spec_decode is None  # no speculative decoding configured
    assert not llm.llm_engine.has_unfinished_requests()

    plain = self_consistency(llm, probs, n=4, max_tokens=12, seed=1)
    # per-path seeds: a path's text does not depend on waves or output kind
    assert [s.text for s in plain[0].samples][:2] == [s.text for s in run[0].samples][:2]

    # every path "agrees": the vote is settled after 3 of 4 and the last is aborted
    agree = self_consistency(llm, probs, n=4, max_tokens=12, temperature=1.0,
                             early_stop=True, extract=lambda text: "same")
    for r in agree:
        assert r.stopped_early and r.answer == "same" and r.agreement == 1.0
        assert len(r.samples) == 3 and r.num_aborted == 1
    assert not llm.llm_engine.has_unfinished_requests()
