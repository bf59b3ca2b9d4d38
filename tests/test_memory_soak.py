"""A long run of varied requests through every route leaves each of the
proposer's and the endpoint's structures within its bound (issue 42).

CI's short version of ``python -m tests.memory_soak``: a few hundred
requests of :mod:`tests.week_traffic`'s mix (``/v1/completions`` n=16, the
three self-consistency routes streamed or not, lists, chat, hot and new
prompts, malformed bodies, hang-ups, bursts and gaps) against a consensus
server whose bounds are small enough to be reached in that many: a trie
arena of 200,000 nodes (it rotates), 3,000 prompt tokens of remembered
groups (the LRU forgets), a batch of 16 rows (the parked paths fill to
their cap).  Every sample must keep every counter within the bound the
proposer reports, the arena must not grow, the endpoint's memos stay
within theirs, and at the end nothing may be held.  Resident memory is
not judged here (CI machines are noisy); the full soak does that against
a plain server.
"""

import asyncio
import importlib.util

import pytest

assert importlib.util.find_spec("vllm") is not None, "vLLM (a declared dependency) is not installed"

from tests import memory_soak, soak_report, week_traffic  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

REQUESTS = 400
OPTIONS = {"max_depth": 8, "max_trie_nodes": 200_000, "max_group_tokens": 3_000,
           "cross_group_tokens": 20_000}
MAX_NUM_SEQS = 16


@pytest.fixture(scope="module")
def soaked(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("memory_soak")
    server = memory_soak.start("consensus", log_dir, options=OPTIONS,
                               extra=["--max-num-seqs", str(MAX_NUM_SEQS)])
    entry: dict = {}
    memory_soak.run_server(server, "consensus", week_traffic.plan(REQUESTS, seed=3), entry,
                           warmup=REQUESTS, deadline=1e18, progress_every=REQUESTS,
                           sample_every=week_traffic.SEGMENT)
    report = {"config": {"requests": REQUESTS, "warmup": REQUESTS, "window": REQUESTS},
              "servers": {"consensus": entry}}
    report["summary"] = soak_report.summarize(report)
    report["checks"] = soak_report.checks(report)
    return report


# The soak's "every hang-up's run ended within 1 s" is timed by a client
# polling a server that shares two cores with a burst of 12 requests; on a
# shared CI machine one hang-up in a few hundred has taken longer.  Here every
# hang-up's run must end, all but one in 20 within the 1 s, and none past 3 s;
# `python -m tests.memory_soak` keeps the strict check.
HANGUP_CHECK = "consensus: every hang-up's run ended within 1 s"
SLOW_HANGUP_S = 3.0


def test_every_request_answered_refused_or_ended_and_nothing_held(soaked):
    entry, c = soaked["servers"]["consensus"], soaked["summary"]["consensus"]["counts"]
    failed = [k for k, ok in soaked["checks"].items() if not ok and k != HANGUP_CHECK]
    assert not failed, (failed, [r for r in entry["requests"] if not r["ok"]][:5],
                        entry.get("end"), entry.get("serial_hangups"), entry.get("log_errors"))
    checked = [r for r in entry["requests"] if r["k"] == "hangup" and "end_s" in r]
    slow = [r for r in checked if not r["ok"] or r["end_s"] > soak_report.HANGUP_END_S]
    assert checked and all(r["ok"] for r in checked), slow[:5]
    assert len(slow) <= max(1, len(checked) // 20), slow
    assert all(r["end_s"] <= SLOW_HANGUP_S for r in slow), slow
    assert c["good"] + c["bad"] + c["hangup"] == REQUESTS and c["bad"] >= 40 and c["hangup"] >= 30
    # the hang-ups left runs in flight (not runs that had already finished)
    assert c["hangups_checked"] - c["hangups_finished_before_close"] >= c["hangups_checked"] // 2
    routes = {r["r"] for r in entry["requests"] if r["k"] == "good"}
    assert routes == {"v1", "sc", "sc_completions", "sc_chat"}
    assert {s["route"] for s in entry["serial_hangups"]} == set(soak_report.ROUTES) - {"/v1/chat/completions"}


def test_every_structure_within_its_bound_and_the_bounds_were_reached(soaked):
    samples = [s for s in soaked["servers"]["consensus"]["samples"] if s.get("proposer")]
    assert len(samples) >= 3  # before, one inside, at the end
    bounds = samples[-1]["proposer_bounds"]
    assert bounds["trie_nodes"] == OPTIONS["max_trie_nodes"]
    assert bounds["parked_paths"] == 64 + 4 * MAX_NUM_SEQS and bounds["path_slots"] == 256
    for s in samples:
        over = {k: (s["proposer"][k], b) for k, b in s["proposer_bounds"].items()
                if s["proposer"][k] > b}
        assert not over, (s["done"], over)
        assert s["proposer"]["arena_bytes"] == samples[0]["proposer"]["arena_bytes"]
        # the arena is backed from the start (commit_arena), page by page in the worker
        resident = s["worker"]["regions_resident_mb"]["trie_arena"]
        assert resident * 2**20 >= 0.99 * s["proposer"]["arena_bytes"] - 2**20 / 10, (s["done"], resident)
        assert not s["proposer"]["num_failures"] and not s["proposer"]["disabled"]
    end = samples[-1]["proposer"]
    # the bounds were reached, not merely respected: the arena rotated, the
    # group LRU forgot, the parked paths filled to their cap
    assert end["evictions"] >= 2, end
    assert end["group_tokens"] > OPTIONS["max_group_tokens"] // 2, end
    assert max(s["proposer"]["parked_paths"] for s in samples) == bounds["parked_paths"]
    assert end["num_accepted"] > 0  # drafting ran throughout
    peak = soaked["summary"]["consensus"]["endpoint_caches_end"]
    assert all(held <= bound for held, bound in peak.values()), peak


def test_a_stream_whose_client_leaves_holds_no_task():
    """A streamed request whose client goes while the stream waits for the
    next event: the run and the pending event reader are both cancelled
    (before, the reader waited forever: one task per streamed hang-up)."""
    from consensus_spec.server import runs

    async def main():
        events: asyncio.Queue = asyncio.Queue()

        async def run():
            events.put_nowait({"vote": 1})
            await asyncio.sleep(3600)

        response = runs.sse(run, events, lambda out: [], "/test")
        got: list = []

        async def client():
            async for chunk in response.body_iterator:
                got.append(chunk)

        reader = asyncio.create_task(client())
        while not got:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the stream now waits for its next event
        held_while_running = runs.tasks_held()
        reader.cancel()  # the client went away (Starlette cancels the stream)
        await asyncio.gather(reader, return_exceptions=True)
        await asyncio.sleep(0)
        return got, held_while_running, runs.tasks_held()

    got, during, after = asyncio.run(main())
    assert got and during == 2 and after == 0, (got, during, after)


def test_the_math_verify_helper_and_its_caches_stay_bounded():
    """Distinct answers that need math-verify, many more than its caches
    hold: the parent's caches stop at their bound and the helper process
    (its own parse cache bounded too) does not grow once they are full.
    (The soak's model answers with integers, which never reach the helper.)"""
    import random

    from consensus_spec.voting.answers import canonicalize
    from consensus_spec.voting.equivalence import MathEngine
    from tests.server_soak import rss_kb

    rng = random.Random(0)

    def expr() -> str:
        a, b, c = rng.randrange(1, 500), rng.randrange(2, 97), rng.randrange(1, 9)
        return rng.choice([f"\\frac{{{a}}}{{{b}}}", f"{a}/{b}", f"x^{c}+{a}", f"\\sqrt{{{a}}}",
                           f"{c}\\pi", f"({a}+{c})/{b}"])

    engine = MathEngine()
    engine.CACHE_SIZE = 200
    rss = []
    try:
        for i in range(1, 1501):
            engine.equal(canonicalize(expr()).math, canonicalize(expr()).math, 5.0)
            if i in (750, 1500):
                assert engine._proc is not None and engine._proc.poll() is None
                rss.append(rss_kb(engine._proc.pid) / 1024)
        sizes = engine.cache_sizes()
    finally:
        engine.close()
    assert sizes["math_parsed"] == [200, 200] and sizes["math_verified"][0] <= 200, sizes
    assert rss[1] - rss[0] < 4.0, rss  # MB


def test_latency_windows_read_seconds_a_request_and_per_token():
    # the last window's requests ask for twice the tokens at the same speed: seconds a
    # request double, seconds a token stay (what tells a slower server from a heavier mix)
    reqs = [{"i": i, "k": "good", "ok": True, "s": 0.5 if i < 10 else 1.0, "tok": 100 if i < 10 else 200}
            for i in range(20)]
    reqs.append({"i": 20, "k": "bad", "ok": True, "s": 9.0})
    report = {"config": {"requests": 21, "warmup": 0, "window": 10},
              "servers": {"consensus": {"requests": reqs}}}
    lat = soak_report.summarize(report)["consensus"]["latency"]
    assert lat["after_warmup"]["p50_ms_per_token"] == lat["last"]["p50_ms_per_token"] == 5.0
    assert lat["p50_ratio"] == lat["p99_ratio"] == 2.0
    assert lat["p50_per_token_ratio"] == lat["p99_per_token_ratio"] == 1.0
