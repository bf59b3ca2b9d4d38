"""Consensus drafting behind vLLM's OpenAI server: a short soak.

A short run of ``tests/server_soak.py`` (``python -m tests.server_soak`` is
the full one): 24 requests with n=8 from 8 threads, a round of every kind of
malformed request sent concurrently, and 8 greedy prompts compared with a
server without speculation. Both servers run on 127.0.0.1 and are always
stopped (their whole process group) before the module's tests finish.
"""

import importlib.util

import openai  # noqa: F401 - declared (test extra): a missing one fails, never skips
import pytest
import requests  # noqa: F401 - declared (test extra)

assert importlib.util.find_spec("vllm") is not None, "vLLM (a declared dependency) is not installed"

from tests import server_soak  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

REQUESTS, THREADS, N, GREEDY = 24, 8, 8, 8


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("server_soak")
    # both servers boot at once (the plain one idles during the soak): one
    # start-up's wall time instead of two. The deadline only guards against
    # a hang; nothing here is judged by elapsed time.
    return server_soak.soak(REQUESTS, THREADS, N, greedy_count=GREEDY, bad_rounds=1,
                            log_dir=log_dir, deadline_s=1500.0, parallel_start=True,
                            verbose=False)


def _context(report) -> str:
    tail = ""
    if report.get("error"):
        tail = f"\nerror: {report['error']}"
    return f"logs in {report['config']['log_dir']}{tail}"


def test_servers_ran_and_were_stopped(report):
    assert not report.get("error"), _context(report)
    for name in ("spec_server", "plain_server"):
        server = report[name]
        assert server.get("ready_s") is not None, _context(report)
        assert server["alive_at_end"] and server["health_at_end"] == 200, _context(report)
        assert server["exit_code"] is not None  # reaped
        assert server_soak.process_group(server["pid"]) == [], f"{name} left processes behind"


def test_every_good_request_returned_n_nonempty_choices(report):
    soak = report["soak"]
    assert soak["requests"] == REQUESTS
    assert soak["ok"] == REQUESTS and soak["failed"] == 0, soak["failures"]
    assert soak["seeded"] > 0 and soak["seeded_ok"] == soak["seeded"]  # seeded requests survive
    assert sum(soak["finish_reasons"].values()) == REQUESTS * N


def test_every_malformed_request_gets_a_4xx(report):
    soak = report["soak"]
    kinds = set(server_soak.malformed_requests())
    assert soak["malformed_rounds_sent"] == 1
    assert set(soak["malformed_statuses"]) == kinds
    assert soak["malformed_not_4xx"] == {}, soak["malformed_rounds"]
    assert soak["malformed_statuses"]["unknown_model"] == [404]
    # uvicorn's access log has every completion request's status: the
    # malformed ones as 4xx, the rest 200, never a 5xx
    statuses = report["spec_log"]["completion_statuses"]
    assert sum(v for code, v in statuses.items() if code.startswith("4")) == len(kinds), statuses
    assert set(statuses) <= {"200", "400", "404", "422"}, statuses
    assert report["spec_log"]["http_5xx"]["count"] == 0


def test_server_stays_up_and_memory_is_sampled(report):
    after = report["after_soak"]
    assert after["alive"] and after["health"] == 200 and after["followup_ok"]
    rss = report["rss"]
    # RSS is sampled at workload points (before, every 3 requests, after): the
    # same 9 samples however fast the machine is
    assert rss["enough"], rss.get("why_not")
    assert [d for d, _ in rss["series_mb"]] == list(range(0, REQUESTS + 1, REQUESTS // 8)), rss
    assert rss["processes"] >= 2  # API server + engine core
    assert 100 < rss["start_mb"] and rss["peak_mb"] < 16_000
    assert rss["second_half_growth_mb"] < server_soak.MAX_SECOND_HALF_GROWTH_MB, rss


def test_drafting_happened_without_failures(report):
    m = report["metrics"]
    assert m["vllm:spec_decode_num_drafts"] > 0
    assert 0 < m["vllm:spec_decode_num_accepted_tokens"] <= m["vllm:spec_decode_num_draft_tokens"]
    counters = report["proposer_counters"]
    assert counters["proposer"] == "ConsensusProposer", counters
    assert counters["num_drafted"] > 0 and counters["num_accepted"] > 0
    assert counters["num_failures"] == 0 and not counters["disabled"]
    log = report["spec_log"]
    assert log["proposer_info"]["count"] >= 1, "no 'consensus_spec proposer:' INFO line"
    assert "k=8" in log["proposer_info"]["lines"][0] and "max_depth=8" in log["proposer_info"]["lines"][0]
    assert log["drafting_failed"]["count"] == 0 and log["drafting_off"]["count"] == 0
    assert log["error_lines"]["count"] == 0, log["error_lines"]["lines"]
    assert log["tracebacks"]["count"] == 0


def test_greedy_outputs_equal_those_without_speculation(report):
    g = report["greedy"]
    assert g["prompts"] == GREEDY and g["with_n4"] >= 2
    assert g["equal"], g["mismatches"]
    assert g["siblings_differ"] == []


def test_all_checks_pass(report):
    assert all(report["checks"].values()), report["checks"]


def test_rss_checkpoints_fall_on_workload_points_and_refuse_to_guess():
    import os

    rss = server_soak.RssCheckpoints(os.getpid(), total=24)
    rss.sample(0)
    for done in range(1, 25):
        rss.on_done(done)
    rss.sample(24)
    summary = rss.summary()
    assert summary["enough"] and [d for d, _ in summary["series_mb"]] == list(range(0, 25, 3))
    assert summary["start_mb"] > 0 and "second_half_growth_mb" in summary

    few = server_soak.RssCheckpoints(os.getpid(), total=2)
    few.sample(0)
    few.on_done(1)
    few.sample(2)
    summary = few.summary()
    assert not summary["enough"] and "need 5" in summary["why_not"]
    report = {"config": {"bad_rounds": 1}, "rss": summary}
    assert server_soak.checks(report)["rss_second_half_bounded"] is False  # no silent infinity
