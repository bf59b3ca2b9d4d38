"""Self-consistency driver logic against a fake engine (no vLLM needed),
plus one real vLLM run on a tiny random model."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import math_verify  # noqa: F401 - declared dependency: a missing one fails, never skips
import pytest

from consensus_spec.sampling.options import parse_stop_rule, vote_is_settled  # noqa: E402
from consensus_spec.sampling.path_book import _tokens_saved  # noqa: E402
from consensus_spec.sampling.self_consistency import (  # noqa: E402
    Schedule,
    SpecDecodeStats,
    StopRule,
    Voting,
    _removed_keywords,
    _render_prompt,
    read_spec_counters,
    run_paths,
    self_consistency,
    spec_stats_delta,
)
from consensus_spec.voting.vote import majority_vote  # noqa: E402

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
    (r,) = run_paths(engine, ["q"], params_factory(logprob=confident), n=3,
                     voting=Voting(weighted=True))
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
        run_paths(engine, ["q"], params_factory(), n=3, voting=Voting(extract=extract))
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
# Waves, stopping and batch fill in the engine loop (planner alone: test_waves.py)
# ---------------------------------------------------------------------------


def finishes(engine):
    return [tuple(int(x) for x in rid.split("-")[1:]) for kind, rid in engine.log if kind == "finish"]


def aborts(engine):
    return {tuple(int(x) for x in rid.split("-")[1:]) for kind, rid in engine.log if kind == "abort"}


def test_waves_run_in_order_and_pipeline_across_problems():
    # 3 problems, 8 paths each in waves 2, 2, rest; path k is 2 + k chunks long
    table = [[(str(p), 2 + k) for k in range(8)] for p in range(3)]
    engine = FakeEngine(script_from(table), slots=4)
    res = run_paths(engine, ["a", "b", "c"], params_factory(), n=8,
                    schedule=Schedule(waves=(2, 2, "rest"), capacity=4, fill_idle=False))
    order, done = adds(engine), finishes(engine)
    for p in range(3):
        mine = [k for q, k in order if q == p]
        assert mine == list(range(8))  # paths go out in wave order
        # wave w+1 of p is submitted only after all of wave w finished
        log_pos = {tuple(int(x) for x in rid.split("-")[1:]): i for i, (kind, rid)
                   in enumerate(engine.log) if kind == "add"}
        fin_pos = {tuple(int(x) for x in rid.split("-")[1:]): i for i, (kind, rid)
                   in enumerate(engine.log) if kind == "finish"}
        assert log_pos[(p, 2)] > max(fin_pos[(p, 0)], fin_pos[(p, 1)])
        assert log_pos[(p, 4)] > max(fin_pos[(p, 2)], fin_pos[(p, 3)])
    # while problem 0 waits for its first wave, problems 1 and 2 are admitted
    assert order.index((1, 0)) < order.index((0, 2)) and order.index((2, 0)) < order.index((0, 4))
    assert sorted(done) == [(p, k) for p in range(3) for k in range(8)]
    assert all(r.answer == str(r.index) and len(r.samples) == 8 and r.waves == 3 for r in res)
    assert res.engine_steps > 0 and 0 < res.batch_fill <= 1



def test_idle_fill_starts_later_waves_on_free_rows():
    # one problem, 8 paths in waves 2, 2, rest on 8 rows: strictly 3 waves in
    # a row; with idle fill every wave starts at once (no stop rule: all finish)
    table = [[("1", 2 + k) for k in range(8)]]
    runs = {}
    for fill in (False, True):
        engine = FakeEngine(script_from(table), slots=8)
        runs[fill] = run_paths(engine, ["q"], params_factory(), n=8,
                               schedule=Schedule(waves=(2, 2, "rest"), capacity=8, fill_idle=fill))
    assert runs[True].engine_steps < runs[False].engine_steps
    assert runs[True].batch_fill > runs[False].batch_fill
    assert all(len(r[0].samples) == 8 and r[0].answer == "1" for r in runs.values())


def test_batch_fill_is_mean_inflight_over_capacity():
    # one problem, 4 paths at once; path k finishes at engine step k + 2
    table = [[("1", k + 1) for k in range(4)]]
    engine = FakeEngine(script_from(table))
    run = run_paths(engine, ["q"], params_factory(), n=4, schedule=Schedule(waves=("rest",), capacity=8))
    # in flight per step: 4, 4, 3, 2, 1
    assert run.engine_steps == 5
    assert run.mean_inflight == pytest.approx(14 / 5)
    assert run.batch_fill == pytest.approx(14 / 5 / 8)
    unbounded = run_paths(FakeEngine(script_from(table)), ["q"], params_factory(), n=4)
    assert unbounded.batch_fill is None and unbounded.mean_inflight == pytest.approx(14 / 5)


def test_capacity_keeps_the_batch_full_until_the_tail():
    rng = __import__("random").Random(3)
    table = [[(str(rng.randint(0, 1)), rng.randint(1, 9)) for _ in range(8)] for _ in range(12)]
    engine = FakeEngine(script_from(table), slots=6)
    seen = []
    orig = engine.step

    def step():
        seen.append(len(engine.waiting) + len(engine.running))
        return orig()

    engine.step = step
    run = run_paths(engine, [str(i) for i in range(12)], params_factory(), n=8,
                    schedule=Schedule(waves=(2, 3, "rest"), capacity=6))
    assert max(seen) == 6  # never more than capacity in flight
    # full on every step until the last problem has been admitted and opened its last wave
    first_short = next(i for i, x in enumerate(seen) if x < 6)
    assert first_short > len(seen) // 2
    assert run.batch_fill == pytest.approx(sum(seen) / len(seen) / 6)


def test_stop_at_wave_boundary_never_aborts():
    # problem 0 unanimous: the predictive rule stops after its first wave of 4;
    # problem 1 split 50/50: runs all 16 paths in waves of 4
    table = [[("5", 2 + k % 3) for k in range(16)], [(str(k % 2), 2 + k % 3) for k in range(16)]]
    engine = FakeEngine(script_from(table))
    a, b = run_paths(engine, ["a", "b"], params_factory(), n=16, stop_rule=StopRule(),
                     schedule=Schedule(waves=(4,)))
    assert a.stopped_early and len(a.samples) == 4 and a.waves == 1
    assert a.num_aborted == 12 and a.aborted_tokens == 0
    assert a.est_tokens_saved == round(12 * sum(s.num_tokens for s in a.samples) / 4)
    assert not any(p == 0 and k >= 4 for p, k in adds(engine))
    assert not b.stopped_early and len(b.samples) == 16 and b.waves == 4
    assert not aborts(engine)  # a stop at a wave boundary has nothing running


def test_default_schedule_with_stopping_is_waves():
    table = [[("5", 2)] * 16]
    engine = FakeEngine(script_from(table))
    (r,) = run_paths(engine, ["q"], params_factory(), n=16, stop_rule=StopRule())
    # default waves of 2; the default rule's first possible stop is 4 votes of 4
    assert Schedule().sizes(16)[0] == 2
    assert len(r.samples) == 4 and r.waves == 2 and r.stopped_early
    # without a stop rule, everything goes out at once
    engine = FakeEngine(script_from(table))
    run = run_paths(engine, ["q"], params_factory(), n=16)
    assert len(adds(engine)) == 16 and run.config["schedule"] == "all"
    assert run.config["stop_rule"] == "off"


def test_path_check_aborts_running_paths_and_counts_their_tokens():
    # 8 paths all answering 5 finish in path order; decided after 5 (lead 5 > 3)
    table = [[("5", 2 + 3 * k) for k in range(8)]]
    engine = FakeEngine(script_from(table))
    (r,) = run_paths(engine, ["q"], params_factory(delta=True), n=8, delta=True,
                     schedule=Schedule(waves=("rest",), check="path"),
                     stop_rule=StopRule(kind="decided"))
    assert r.stopped_early and len(r.samples) == 5 and r.num_aborted == 3
    assert aborts(engine) == {(0, k) for k in range(5, 8)}
    assert r.aborted_tokens == sum(engine.generated(0, k) for k in range(5, 8)) > 0
    assert r.est_tokens_saved == 0  # every aborted path had run past the mean length
    assert r.num_tokens == sum(s.num_tokens for s in r.samples) + r.aborted_tokens
    assert not engine.has_unfinished_requests()


def test_path_check_margin_stop_skips_unsent_paths():
    table = [[("5", 2 + 3 * k) for k in range(8)]]
    engine = FakeEngine(script_from(table), slots=5)
    (r,) = run_paths(engine, ["q"], params_factory(delta=True), n=8, delta=True,
                     schedule=Schedule(waves=("rest",), capacity=5, check="path"),
                     stop_rule=StopRule(kind="margin", margin=2, min_samples=2))
    # paths 0 and 1 agree: lead 2; path 5 took path 0's row, 6 and 7 were never sent
    assert r.stopped_early and [s.path for s in r.samples] == [0, 1]
    assert r.num_aborted == 6 and aborts(engine) == {(0, k) for k in (2, 3, 4, 5)}
    assert not any(k >= 6 for _, k in adds(engine))
    mean_len = (3 + 6) / 2
    expected = sum(max(0.0, mean_len - engine.generated(0, k)) for k in range(2, 8))
    assert r.est_tokens_saved == round(expected)


def test_close_race_runs_every_path():
    table = [[(str(k % 2), 2 + k) for k in range(6)]]
    (r,) = run_paths(FakeEngine(script_from(table)), ["q"], params_factory(delta=True), n=6,
                     delta=True, schedule=Schedule(waves=(2, "rest"), check="path"),
                     stop_rule=StopRule(kind="decided"))
    assert not r.stopped_early and len(r.samples) == 6 and r.num_aborted == 0
    assert r.est_tokens_saved == 0 and r.answer == "0"


def test_on_problem_done_called_once_per_problem_when_complete():
    table = [[("5", 2 + k) for k in range(8)], [(str(k % 2), 3 + k) for k in range(8)]]
    engine = FakeEngine(script_from(table), slots=3)
    done = []

    def record(p):
        done.append(p)
        assert any(q == p for q, _ in finishes(engine))  # only after some path of p finished

    res = run_paths(engine, ["a", "b"], params_factory(), n=8, stop_rule=StopRule(kind="sequential"),
                    schedule=Schedule(waves=(4, "rest"), capacity=3), on_problem_done=record)
    assert sorted(done) == [0, 1] and len(done) == 2
    assert res[0].stopped_early and not res[1].stopped_early


def test_tokens_saved_estimate():
    assert _tokens_saved([10, 20], [5, 0, 0], max_tokens=100) == 10 + 15 + 15
    assert _tokens_saved([], [3], max_tokens=50) == 47
    assert _tokens_saved([4], [9], max_tokens=50) == 0


def test_old_exact_rule_kept_for_reference():
    v = majority_vote(["5", "5", "5", "7"])  # lead 2
    assert vote_is_settled(v, remaining=1) and not vote_is_settled(v, remaining=2)
    assert not vote_is_settled(majority_vote([None, None]), remaining=0)
    weighted = majority_vote(["5", "7"], weights=[0.9, 0.2])
    assert vote_is_settled(weighted, remaining=0) and not vote_is_settled(weighted, remaining=1)


# ---------------------------------------------------------------------------
# Configs and their validation
# ---------------------------------------------------------------------------


def test_parse_stop_rule():
    assert parse_stop_rule(None) is None and parse_stop_rule(False) is None
    assert parse_stop_rule(True) == StopRule()
    assert parse_stop_rule("decided") == StopRule(kind="decided")
    rule = StopRule(kind="beta", error=0.1)
    assert parse_stop_rule(rule) is rule
    assert parse_stop_rule(3) == StopRule(kind="margin", margin=3, min_samples=1)
    assert parse_stop_rule(2.5).margin == 3


@pytest.mark.parametrize("early_stop", ["sometimes", -1, 0.0, float("inf"), [1]])
def test_bad_early_stop_values(early_stop):
    with pytest.raises(ValueError):
        parse_stop_rule(early_stop)


@pytest.mark.parametrize("kwargs,match", [
    (dict(weight_method="softmax"), None),
    (dict(weight_method="bogus"), "weight_method"),
    (dict(timeout_s=0), "timeout_s"),
    (dict(timeout_s=True), "timeout_s"),
    (dict(extract="not callable"), "extract"),
])
def test_voting_validation(kwargs, match):
    if match is None:
        assert Voting(**kwargs).weight_method == "softmax"
    else:
        with pytest.raises(ValueError, match=match):
            Voting(**kwargs)


def test_stopping_with_weighted_votes_is_refused():
    engine = FakeEngine(lambda prompt, params: ["#### 1"])
    with pytest.raises(ValueError, match="unweighted"):
        run_paths(engine, ["q"], params_factory(), n=2, stop_rule=StopRule(),
                  voting=Voting(weighted=True))
    assert not engine.log  # refused before anything was submitted


def test_schedule_must_be_a_schedule():
    with pytest.raises(ValueError, match="Schedule"):
        run_paths(FakeEngine(lambda p, q: ["x"]), ["q"], params_factory(), n=2, schedule=(2, "rest"))


def test_removed_keywords_say_what_to_write_instead():
    with pytest.raises(TypeError, match=r"scouts= -> schedule=Schedule\(waves=\(S, 'rest'\)\)"):
        _removed_keywords(dict(scouts=2))
    with pytest.raises(TypeError, match=r"weighted= -> voting=Voting\(weighted=...\)"):
        _removed_keywords(dict(weighted=True, capacity=4))
    with pytest.raises(TypeError, match="unexpected keyword argument.*bogus"):
        _removed_keywords(dict(bogus=1))
    with pytest.raises(TypeError, match="scouts"):  # through the public function, before any engine
        self_consistency(object(), ["q"], n=2, scouts=1)


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
    if os.environ.get("CONSENSUS_SKIP_VLLM"):
        pytest.skip("CONSENSUS_SKIP_VLLM set")
    from vllm import LLM

    from consensus_spec.sampling.self_consistency import self_consistency
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
    run = self_consistency(llm, probs, n=4, max_tokens=12, seed=1, logprobs=True,
                           schedule=Schedule(waves=(2, "rest")),
                           early_stop=StopRule(kind="margin", margin=3, min_samples=1))
    assert len(run) == 2 and run.wall_time_s > 0 and run.engine_steps > 0
    assert run.config["schedule"] == "2,rest" and run.config["capacity"] == 8  # max_num_seqs
    assert 0 < run.batch_fill <= 1
    for r in run:
        assert len(r.samples) + r.num_aborted == 4 and r.aborted_tokens == 0
        assert all(s.num_tokens > 0 and s.cumulative_logprob is not None for s in r.samples)
        assert all(s.cumulative_logprob <= 0 for s in r.samples)
        assert r.vote.num_votes + r.vote.num_abstained == len(r.samples)
    assert run.spec_decode is None  # no speculative decoding configured
    assert not llm.llm_engine.has_unfinished_requests()

    plain = self_consistency(llm, probs, n=4, max_tokens=12, seed=1)
    # logprobs cost vLLM work per draft token: only requested when asked or voting needs them
    assert all(s.cumulative_logprob is None for r in plain for s in r.samples)
    # per-path seeds: a path's text does not depend on waves or output kind
    assert [s.text for s in plain[0].samples][:2] == [s.text for s in run[0].samples][:2]

    # every path "agrees": a whole first wave of 3 decides the vote, the 4th never starts
    same = Voting(extract=lambda text: "same")
    agree = self_consistency(llm, probs, n=4, max_tokens=12, temperature=1.0, voting=same,
                             early_stop="decided", schedule=Schedule(waves=(3, "rest"), fill_idle=False))
    for r in agree:
        assert r.stopped_early and r.answer == "same" and r.agreement == 1.0
        assert len(r.samples) == 3 and r.num_aborted == 1 and r.aborted_tokens == 0

    # idle fill: the 8 rows take both 4th paths at once; each is aborted when its wave decides
    filled = self_consistency(llm, probs, n=4, max_tokens=12, temperature=1.0, voting=same,
                              early_stop="decided", schedule=Schedule(waves=(3, "rest")))
    for r in filled:
        assert r.stopped_early and r.answer == "same"
        assert len(r.samples) + r.num_aborted == 4 and r.num_aborted <= 1

    # checked after every path (all at once): the 4th is aborted, its tokens counted
    per_path = self_consistency(llm, probs, n=4, max_tokens=12, temperature=1.0, voting=same,
                                early_stop="decided",
                                schedule=Schedule(waves=("rest",), check="path"))
    for r in per_path:
        assert r.stopped_early and len(r.samples) == 3 and r.num_aborted == 1
    with pytest.raises(TypeError, match="scouts= -> schedule=Schedule"):  # 0.1's keywords name the new ones
        self_consistency(llm, probs[:1], n=4, max_tokens=12, scouts=2, capacity=4)
    assert not llm.llm_engine.has_unfinished_requests()


def _drafter_counters(worker):
    return worker.model_runner.drafter.counters()


@pytest.mark.slow
@pytest.mark.vllm
def test_self_consistency_with_consensus_drafting_and_waves_on_vllm(monkeypatch):
    """The default path a user takes: consensus drafting, waves and the stop
    rule, on the embedded model; vLLM's spec-decode counters agree with the
    proposer's own."""
    import consensus_spec
    from consensus_spec.model import model_path
    from consensus_spec.model.synthetic import format_prompt, test_set
    from vllm import LLM

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the proposer in this process
    llm = LLM(model_path(), **consensus_spec.engine_args(8), max_model_len=512, seed=0,
              dtype="float32", disable_log_stats=False, enforce_eager=True, max_num_seqs=32,
              gpu_memory_utilization=0.05)
    try:
        problems = [p["question"] for p in test_set(8)]
        run = consensus_spec.self_consistency(llm, problems, n=8, temperature=0.8, max_tokens=96,
                                              prompt_template=format_prompt, early_stop=True)
        counters = next(c for c in llm.collective_rpc(_drafter_counters) if c)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert len(run) == 8 and all(r.answer is not None for r in run)
    # votes are taken path by path in path order (a path that idle fill
    # started early may finish before the stop: it is kept in the vote)
    assert all(1 <= r.stopped_after < 8 if r.stopped_early else len(r.samples) == 8 for r in run)
    assert all(r.ended_in_flight == r.num_sent - len(r.samples) >= 0 for r in run)
    spec = run.spec_decode
    assert spec is not None and spec.num_accepted_tokens > 0
    assert counters["num_failures"] == 0 and not counters["disabled"]
    # the proposer counts what it proposed, and what it saw accepted on the
    # next step (rows that finish take their verdict with them); vLLM counts
    # the drafts it scheduled (dropped for finished rows) and accepted
    assert counters["num_accepted"] <= spec.num_accepted_tokens <= spec.num_draft_tokens
    assert spec.num_draft_tokens <= counters["num_drafted"]
    assert counters["num_accepted"] >= 0.8 * spec.num_accepted_tokens
    assert counters["num_drafted"] - spec.num_draft_tokens <= 0.2 * counters["num_drafted"]
    assert counters["steps_timed"] > 0  # the budget learned from this engine's steps
