"""The self-consistency routes' parsing and response shapes, without a
server: vLLM's own request models behind the OpenAI-shaped routes, the run
options and server defaults, the representative path, answer patterns."""

from __future__ import annotations

import time

import pytest

from consensus_spec.sampling.results import ProblemResult, Sample
from consensus_spec.server.openai_protocol import (CHAT, COMPLETION, choices_json, parse_openai,
                                                   representative, stream_chunks)
from consensus_spec.server.options import BadRequest, Limits, parse_defaults
from consensus_spec.voting.answers import extract_answer, extract_final_answer
from consensus_spec.voting.patterns import AnswerPattern
from consensus_spec.voting.vote import majority_vote

OK = {"model": "m", "prompt": "Question: 1 + 1?\nAnswer:", "n": 4, "max_tokens": 8}


def _bad(body, kind=COMPLETION, limits=Limits(), defaults=None) -> BadRequest:
    with pytest.raises(BadRequest) as e:
        parse_openai(body, kind, limits, defaults or {})
    return e.value


def test_every_vllm_field_is_taken_and_the_options_ride_along():
    req, opts = parse_openai({**OK, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
                              "stop": ["\n\n"], "seed": 3, "logprobs": 1, "early_stop": "decided",
                              "schedule": "4", "answer_pattern": {"pattern": "is (\\d+)",
                                                                  "select": -1}},
                             COMPLETION, Limits(), {})
    assert req.top_k == 5 and req.n == 4 and opts.stop_rule.kind == "decided"
    assert opts.schedule.describe() == "4" and opts.voting.extract("is 2, is 3") == "3"
    params = req.to_sampling_params(8, {})
    assert params.top_k == 5 and params.min_p == 0.1 and params.stop == ["\n\n"]


@pytest.mark.parametrize("body,field", [
    ({**OK, "best_of_n": 2}, "best_of_n"),
    ({**OK, "echo": True}, "echo"),
    ({**OK, "use_beam_search": True}, "use_beam_search"),
    ({**OK, "n": 0}, "n"),
    ({**OK, "n": 65}, "n"),
    ({**OK, "prompt": ["a"] * 65}, "prompt"),
    ({**OK, "seed": 2**63 - 2}, "seed"),
    ({**OK, "early_stop": {"kind": "sometimes"}}, "early_stop.kind"),
    ({**OK, "answer_pattern": "("}, "answer_pattern"),
    ({**OK, "logprobs": -2}, "logprobs"),
])
def test_refused_fields_are_named(body, field):
    assert _bad(body).param == field


def test_chat_refuses_tool_calls_and_takes_its_own_fields():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}
    assert _bad({**chat, "tools": [{"type": "function", "function": {"name": "f"}}]},
                CHAT).param == "tools"
    req, _ = parse_openai({**chat, "max_completion_tokens": 9, "top_logprobs": 2, "logprobs": True},
                          CHAT, Limits(), {})
    assert req.max_completion_tokens == 9 and req.top_logprobs == 2
    assert _bad({**chat, "bogus": 1}, CHAT).param == "bogus"


def test_chat_with_n_returns_every_path_unless_the_vote_is_asked():
    """lighteval reads n chat choices as n samples: by default they are n real
    paths (early stop off); lm-eval's completions get one voted choice a prompt."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 4}
    _, opts = parse_openai(chat, CHAT, Limits(), {})
    assert opts.choices == "paths" and opts.stop_rule is None and opts.schedule.all_at_once
    _, opts = parse_openai({**chat, "n": 1}, CHAT, Limits(), {})
    assert opts.choices == "vote" and opts.stop_rule is not None
    _, opts = parse_openai({**chat, "choices": "vote"}, CHAT, Limits(), {})
    assert opts.choices == "vote" and opts.stop_rule.kind == "bayes"
    _, opts = parse_openai(OK, COMPLETION, Limits(), {})
    assert opts.choices == "vote" and opts.stop_rule is not None
    _, opts = parse_openai(OK, COMPLETION, Limits(), parse_defaults('{"choices": "paths"}'))
    assert opts.choices == "paths" and opts.stop_rule is None
    for off in (False, "off", None):  # every form of "no stop" agrees with every path
        assert parse_openai({**chat, "early_stop": off}, CHAT, Limits(), {})[1].stop_rule is None
    assert _bad({**chat, "early_stop": "bayes"}, CHAT).param == "early_stop"
    bad = _bad({**chat, "early_stop": True}, CHAT)  # every path, and a stop: a contradiction
    assert bad.param == "early_stop" and "choices='vote'" in str(bad)
    assert _bad({**chat, "choices": "some"}, CHAT).param == "choices"
    assert _bad({**chat, "schedule": "1,rest"}, CHAT).param == "schedule"  # never replaced silently
    # every path, weighted: no stop rule, so nothing to refuse
    _, opts = parse_openai({**chat, "voting": {"weighted": True}}, CHAT, Limits(), {})
    assert opts.voting.weighted and opts.stop_rule is None


def test_server_defaults_sit_under_the_requests_own_fields():
    defaults = parse_defaults('{"answer_pattern": "is (\\\\d+)", "early_stop": false}')
    _, opts = parse_openai(OK, COMPLETION, Limits(), defaults)
    assert opts.stop_rule is None and opts.voting.extract("it is 12") == "12"
    _, opts = parse_openai({**OK, "early_stop": True}, COMPLETION, Limits(), defaults)
    assert opts.stop_rule is not None
    assert parse_defaults(None) == {} and parse_defaults("") == {}
    for bad in ("[1]", "{nope", '{"early_stop": "never"}', '{"bogus": 1}'):
        with pytest.raises(ValueError, match="CONSENSUS_SPEC_SC_DEFAULTS"):
            parse_defaults(bad)


def _result(texts, finish, extract=extract_final_answer) -> ProblemResult:
    samples = [Sample(k, t, extract(t), 5, None, f, None, [1, 2], None)
               for k, (t, f) in enumerate(zip(texts, finish))]
    return ProblemResult(0, majority_vote([s.answer for s in samples]), samples, num_sent=len(texts))


def test_the_representative_states_the_voted_answer_and_ended_by_itself():
    r = _result(["The answer is 4.", "It is 5. The answer is 5.", "The answer is 5", "7 8"],
                ["stop", "length", "stop", "stop"])
    assert r.answer == "5" and representative(r).path == 2  # voted, and not cut at max_tokens
    assert representative(_result(["no", "none"], ["length", "stop"])).path == 1  # no winner


def test_choice_and_stream_chunks_have_openai_shapes():
    from types import SimpleNamespace

    r = _result(["The answer is 5.", "The answer is 5."], ["stop", "stop"])
    req = SimpleNamespace(n=2, seed=10, logprobs=None, return_token_ids=True,
                          return_tokens_as_token_ids=False)
    from consensus_spec.server.options import RunOptionsIn, resolve_options

    opts = resolve_options(RunOptionsIn(), Limits())
    (c,) = choices_json(COMPLETION, 1, r, req, opts, None, [7, 8])
    assert c["text"] == "The answer is 5." and c["index"] == 1 and c["token_ids"] == [1, 2]
    assert c["prompt_token_ids"] == [7, 8] and c["self_consistency"]["seeds"] == [12, 13]
    # every path: n choices of prompt 1 (indices 2, 3), the voted path first, seeds the prompt's
    opts = resolve_options(RunOptionsIn(choices="paths"), Limits())
    both = choices_json(COMPLETION, 1, r, req, opts, None, [7, 8])
    assert [x["index"] for x in both] == [2, 3]
    assert [x["self_consistency"]["representative_path"] for x in both] == [0, 1]
    assert all(x["self_consistency"]["seeds"] == [12, 13] for x in both)
    first, last = stream_chunks(COMPLETION, "id", "m", int(time.time()), c)
    assert first["choices"][0]["text"] == c["text"] and first["choices"][0]["finish_reason"] is None
    assert last["choices"][0]["finish_reason"] == "stop" and "self_consistency" in last["choices"][0]


def test_paths_without_a_stated_answer_abstain_on_the_routes():
    texts = ["She eats 10 - 1 = 11 eggs. She eats 11 - 1 = 10 eggs. She eats 10",
             "The answer is 2 x 2 = 4.", "The answer is 60 x 3."]
    assert [extract_final_answer(t) for t in texts] == [None, "4", None]
    assert [extract_answer(t) for t in texts] == ["10", "4", None]  # the library falls back


def test_answer_patterns_read_as_lm_eval_reads_and_time_out():
    sc = AnswerPattern(r"The answer is (\-?[0-9\.\,]*[0-9]+)")
    assert sc("The answer is 1,200. The answer is 3.") == "1,200"
    assert AnswerPattern(r"(-?[$0-9.,]{2,})|(-?[0-9]+)", select=-1)("got 3 then 45.") == "45."
    assert AnswerPattern("x")("") is None and AnswerPattern("(a)b")("cc") is None
    evil = AnswerPattern(r"(x+x+)+y", timeout_s=0.05)
    t0 = time.monotonic()
    assert evil("x" * 5000) is None
    assert time.monotonic() - t0 < 2.0
    for bad in ("", "(", "a" * 2000):
        with pytest.raises(ValueError):
            AnswerPattern(bad)
