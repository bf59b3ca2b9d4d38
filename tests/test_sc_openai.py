"""The OpenAI-shaped self-consistency routes through the clients people run:
the ``openai`` client's ``completions.create`` and ``chat.completions.create``
with ``base_url=.../v1/self_consistency``, lm-evaluation-harness's
``local-completions`` on a local task, litellm; every malformed request a
4xx naming the field; a client that hangs up aborts every path.  On the
server tests/conftest.py starts (the embedded model, consensus drafting)."""

import importlib.util
import json
import re
import time
import uuid

import pytest

assert importlib.util.find_spec("vllm") is not None, "vLLM (a declared dependency) is not installed"

from tests import sc_soak, server_soak  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PATTERN = r"The answer is (\-?[0-9]+)"  # how the harness below reads the embedded model's answer


@pytest.fixture(scope="module")
def client(sc_server):
    import openai

    return openai.OpenAI(base_url=sc_server.base_url + sc_soak.ROUTE, api_key="-", max_retries=0,
                         timeout=180)


@pytest.fixture(scope="module")
def probs():
    return sc_soak.problems(8, seed=4321)


def _vote(choice) -> dict:
    return choice.model_extra["self_consistency"]


def test_completions_create_gives_one_choice_the_voted_paths_text(client, probs):
    out = client.completions.create(model=server_soak.SERVED_NAME, prompt=probs[0]["prompt"],
                                    n=8, max_tokens=96, seed=7,
                                    extra_body={"answer_pattern": PATTERN})
    assert out.object == "text_completion" and len(out.choices) == 1
    choice = out.choices[0]
    vote = _vote(choice)
    assert choice.index == 0 and choice.finish_reason in ("stop", "length")
    # the harness's own regex reads the voted answer from the choice's text
    found = re.findall(PATTERN, choice.text)
    assert vote["answer"] is not None and found and found[0] == vote["answer"]
    assert out.usage.completion_tokens == vote["tokens"]  # every path's tokens, aborted ones too
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert vote["paths_sampled"] <= 8 and vote["seeds"] == [7, 7 + vote["paths_sampled"] - 1]
    assert vote["count"] <= vote["paths_finished"] and 0 < vote["agreement"] <= 1


def test_a_list_prompt_gives_a_choice_per_prompt_in_order(client, probs):
    prompts = [p["prompt"] for p in probs[:3]]
    out = client.completions.create(model=server_soak.SERVED_NAME, prompt=prompts, n=6,
                                    max_tokens=96, seed=100, extra_body={"early_stop": False,
                                                                         "return_paths": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    for i, c in enumerate(out.choices):
        vote = _vote(c)
        assert vote["seeds"] == [100 + 6 * i, 100 + 6 * i + 5]  # copies never share a seed
        assert vote["paths_finished"] == 6 and len(vote["paths"]) == 6
        rep = next(p for p in vote["paths"] if p["index"] == vote["representative_path"])
        assert rep["text"] == c.text and rep["answer"] == vote["answer"]
    assert out.usage.completion_tokens == sum(_vote(c)["tokens"] for c in out.choices)


def test_logprobs_and_token_ids_are_the_representative_paths(client, probs):
    out = client.completions.create(model=server_soak.SERVED_NAME, prompt=probs[1]["prompt"],
                                    n=4, max_tokens=64, logprobs=2,
                                    extra_body={"return_token_ids": True, "early_stop": False})
    c = out.choices[0]
    assert "".join(c.logprobs.tokens) == c.text
    assert len(c.logprobs.token_logprobs) == len(c.model_extra["token_ids"]) > 0
    assert all(len(top) <= 3 for top in c.logprobs.top_logprobs)  # the sampled token + top 2
    assert c.logprobs.text_offset[0] == 0


def test_chat_completions_create_votes_over_chat_paths(client, probs):
    out = client.chat.completions.create(
        model=server_soak.SERVED_NAME, n=6, max_tokens=96, logprobs=True, top_logprobs=2,
        messages=[{"role": "user", "content": probs[2]["question"]}],
        extra_body={"choices": "vote"})
    assert out.object == "chat.completion" and len(out.choices) == 1
    c = out.choices[0]
    vote = _vote(c)
    assert c.message.role == "assistant" and c.message.content
    assert vote["answer"] is None or vote["answer"] in c.message.content
    assert len(c.logprobs.content) > 0 and all(len(t.top_logprobs) <= 2 for t in c.logprobs.content)
    assert out.usage.completion_tokens == vote["tokens"]


def test_streams_send_the_text_then_the_vote_then_usage(client, probs):
    chunks = list(client.completions.create(
        model=server_soak.SERVED_NAME, prompt=probs[3]["prompt"], n=6, max_tokens=96,
        stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    last = [c for c in chunks if c.choices][-1].choices[0]
    assert texts[0] and texts[-1] == "" and last.finish_reason in ("stop", "length")
    assert _vote(last)["answer"] is None or _vote(last)["answer"] in texts[0]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == _vote(last)["tokens"]
    chat = list(client.chat.completions.create(
        model=server_soak.SERVED_NAME, n=4, max_tokens=96, stream=True,
        messages=[{"role": "user", "content": probs[3]["question"]}]))
    assert chat[0].choices[0].delta.content and chat[-1].choices[0].finish_reason
    assert "self_consistency" in chat[-1].choices[0].model_extra


@pytest.mark.parametrize("name", sorted(sc_soak.malformed_openai_bodies()))
def test_malformed_request_gets_a_4xx_naming_the_field(sc_server, name):
    res = sc_soak.send_malformed(sc_server.base_url, name, sc_soak.malformed_openai_bodies()[name])
    assert res["ok"], res


@pytest.mark.parametrize("route", [sc_soak.COMPLETIONS, sc_soak.CHAT])
def test_client_hang_up_aborts_every_path(sc_server, probs, route):
    body = {"model": server_soak.SERVED_NAME, "n": 16, "max_tokens": 200, "early_stop": False}
    if route == sc_soak.CHAT:
        body["messages"] = [{"role": "user", "content": probs[4]["question"]}]
    else:
        body["prompt"] = [p["prompt"] for p in probs[:8]]  # 128 paths: still running at 1 s
    rid = f"test-hangup-{uuid.uuid4().hex[:8]}"
    sc_soak.hang_up(sc_server.base_url, body, after_s=1.0, request_id=rid, route=route)
    assert sc_soak.wait_run_ended(sc_server.base_url, rid)["ended"]
    assert sc_soak.wait_idle(sc_server.base_url)["idle"]


def test_litellm_calls_the_base_url_as_an_openai_server(sc_server, probs):
    import litellm

    base = sc_server.base_url + sc_soak.ROUTE
    chat = litellm.completion(model="openai/" + server_soak.SERVED_NAME, api_base=base,
                              api_key="-", n=4, max_tokens=96,
                              messages=[{"role": "user", "content": probs[5]["question"]}])
    # n > 1 on chat: n choices, every path (lighteval reads them as n samples)
    assert len(chat.choices) == 4 and all(c.message.content for c in chat.choices)
    assert [c.index for c in chat.choices] == [0, 1, 2, 3]
    assert chat.usage.completion_tokens > 0
    text = litellm.text_completion(model="openai/" + server_soak.SERVED_NAME, api_base=base,
                                   api_key="-", prompt=probs[5]["prompt"], n=4, max_tokens=96)
    assert len(text.choices) == 1 and text.choices[0].text


def _lm_eval_task(tmp_path, count: int) -> list[dict]:
    """A local lm-eval task over the embedded model's own test problems."""
    from consensus_spec.model.synthetic import test_set

    docs = [{"question": p["question"], "answer": str(p["answer"])} for p in test_set(count, seed=99)]
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "sc_embedded.yaml").write_text(f"""task: sc_embedded
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["Question:"]
  do_sample: true
  temperature: 0.8
  max_gen_toks: 96
filter_list:
  - name: strict-match
    filter:
      - function: regex
        regex_pattern: "{PATTERN.replace(chr(92), chr(92) * 2)}"
      - function: take_first
metric_list:
  - metric: exact_match
""")
    return docs


def test_lm_eval_local_completions_runs_a_task_through_the_base_url(sc_server, tmp_path,
                                                                    monkeypatch):
    """lm-eval as users run it (``local-completions``, its ``--gen_kwargs`` as a
    JSON object), a batch of 2 prompts a request: every request answered, one
    text per prompt, each prompt's paths seeded apart."""
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    from consensus_spec.model import model_path

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    docs = _lm_eval_task(tmp_path, 6)
    seen: list[dict] = []
    parse = LocalCompletionsAPI.parse_generations

    def spy(outputs, **kwargs):  # the raw JSON lm-eval got back
        seen.extend(outputs if isinstance(outputs, list) else [outputs])
        return parse(outputs, **kwargs)

    monkeypatch.setattr(LocalCompletionsAPI, "parse_generations", staticmethod(spy))
    state0 = sc_soak.endpoint_state(sc_server.base_url)
    t0 = time.monotonic()
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model={server_soak.SERVED_NAME},base_url={sc_server.base_url}"
                   f"{sc_soak.COMPLETIONS},tokenizer={model_path()},tokenized_requests=False,"
                   "num_concurrent=2,max_retries=1",
        batch_size=2, tasks=["sc_embedded"], task_manager=TaskManager(include_path=str(tmp_path)),
        gen_kwargs={"n": 8, "answer_pattern": PATTERN}, log_samples=True)
    assert time.monotonic() - t0 < 600
    samples = results["samples"]["sc_embedded"]
    assert len(samples) == len(docs) and all(len(s["resps"][0]) == 1 for s in samples)
    assert all(isinstance(s["resps"][0][0], str) and s["resps"][0][0] for s in samples)
    choices = [c for out in seen for c in out["choices"]]
    assert len(choices) == len(docs)  # one text per prompt, 2 prompts a request
    assert sum(len(out["choices"]) for out in seen) == len(docs) and len(seen) == 3
    for out in seen:
        for i, c in enumerate(out["choices"]):
            vote = c["self_consistency"]
            assert c["index"] == i and vote["seeds"][0] == 1234 + 8 * i  # lm-eval's seed, + i n + k
            assert vote["paths_sampled"] >= 1 and vote["seeds"][1] - vote["seeds"][0] + 1 == \
                vote["paths_sampled"]
    assert any(c["self_consistency"]["distinct_texts"] > 1 for c in choices)  # not one text 8 times
    state = sc_soak.endpoint_state(sc_server.base_url)
    assert state["requests_total"] - state0["requests_total"] == 3
    assert state["requests_unfinished"] == state0["requests_unfinished"]
    accuracy = results["results"]["sc_embedded"]["exact_match,strict-match"]
    assert 0.0 <= accuracy <= 1.0
