"""Temperature > 0: speculative sampling keeps the target's distribution.

On a tiny-vocabulary target we compute the exact marginal distributions of the second and third
generated tokens (the first ones that come out of verify steps rather than the prefill), e.g.
``p(t3) = sum_{t1,t2} p(t1 | x) p(t2 | x, t1) p(t3 | x, t1, t2)`` under the same temperature /
top-k / top-p, then draw many independent samples with and without speculation and run
chi-square goodness-of-fit tests against them. A negative control shows the test has teeth: an engine that
accepts every draft unconditionally fails it.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy.stats import binomtest, chisquare
from test_penalties import reference_penalized

import laguna_dflash.engine.engine as engine_module
from laguna_dflash import LLM, SamplingParams
from laguna_dflash.engine.sampler import filtered_probs

PROMPT = [3, 14, 15, 9, 2, 6]
NUM_SAMPLES = 1200


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import dflash_fixtures as df

    return df.make_small_vocab_pair(tmp_path_factory.mktemp("sampling"))


def exact_token_distributions(llm: LLM, params: SamplingParams) -> tuple[np.ndarray, np.ndarray, float]:
    """Exact marginals ``(p(t2), p(t3))`` and ``P(t3 == t2)`` by enumerating every prefix with
    non-zero probability."""
    eng = llm.engine

    def probs(ids: list[int]) -> torch.Tensor:
        logits = eng.prompt_logits(ids)[-1:]
        if params.has_penalties:  # the outputs so far are ids past the prompt
            logits = reference_penalized(logits[0], PROMPT, ids[len(PROMPT):], params)[None].float()
        return filtered_probs(logits, params.temperature, params.top_k, params.top_p,
                              params.min_p)[0].double()

    p1 = probs(PROMPT)
    p2 = torch.zeros_like(p1)
    p3 = torch.zeros_like(p1)
    repeat = 0.0
    for t1 in torch.nonzero(p1 > 1e-12).flatten().tolist():
        q2 = probs(PROMPT + [t1])
        p2 += p1[t1] * q2
        for t2 in torch.nonzero(p1[t1] * q2 > 1e-12).flatten().tolist():
            q3 = probs(PROMPT + [t1, t2])
            p3 += p1[t1] * q2[t2] * q3
            repeat += float(p1[t1] * q2[t2] * q3[t2])
    return p2.numpy(), p3.numpy(), repeat


def sampled_tokens(llm: LLM, params: SamplingParams) -> np.ndarray:
    """``[NUM_SAMPLES, 3]`` generated tokens, one independent seeded request per row."""
    plist = [replace(params, max_tokens=3, ignore_eos=True, seed=1000 + i) for i in range(NUM_SAMPLES)]
    outs = llm.generate(prompt_token_ids=[PROMPT] * NUM_SAMPLES, sampling_params=plist)
    return np.array([o.token_ids for o in outs])


def gof_pvalue(samples: np.ndarray, expected_p: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=len(expected_p)).astype(float)
    expected = expected_p * len(samples)
    assert counts[expected == 0].sum() == 0, "sampled a token the target cannot produce"
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive-k"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=1.6, top_k=8, top_p=0.95),
    SamplingParams(temperature=1.6, min_p=0.08),
    SamplingParams(temperature=1.0, presence_penalty=0.9, frequency_penalty=0.6, repetition_penalty=1.4,
                   logit_bias={4: 1.0}),
], ids=["t1", "t1.6-topk-topp", "t1.6-minp", "t1-penalties"])
def test_spec_sampling_matches_target_distribution(pair, params, adaptive):
    target, draft = pair
    base = LLM(target, max_num_seqs=128)
    p2, p3, _ = exact_token_distributions(base, params)
    assert (p2 > 0.02).sum() >= 3 and (p3 > 0.02).sum() >= 3  # genuinely spread
    spec = LLM(target, draft=draft, max_num_seqs=128, adaptive_k=adaptive)
    if adaptive:
        spec.engine.k_policy.explore_every = 2  # switch K often
    for llm in (base, spec):
        tokens = sampled_tokens(llm, params)
        for column, expected in ((1, p2), (2, p3)):
            p_value = gof_pvalue(tokens[:, column], expected)
            assert p_value > 1e-3, (llm.engine.proposer is not None, column, p_value)
    assert spec.get_metrics()["num_accepted_tokens"] > 0  # drafts were accepted sometimes


def test_spec_sampling_with_penalties_and_likely_drafts(pair):
    """With penalties, the verify's row j must count drafts d_1..d_j as outputs. Drafts that
    are the target's greedy continuation (accepted often, so rows past the first are sampled
    often) keep the target's penalised distribution; a verify that ignored the drafts fails
    this (checked by planting it)."""
    target, draft = pair
    params = SamplingParams(temperature=1.0, presence_penalty=1.5, frequency_penalty=1.0,
                            repetition_penalty=2.0)
    base = LLM(target, max_num_seqs=128)
    p2, p3, repeat = exact_token_distributions(base, params)
    spec = LLM(target, draft=draft, max_num_seqs=128)
    eng = spec.engine

    def greedy_drafts(seqs, k=None):
        k = k or eng.proposer.num_speculative_tokens
        rows = []
        for s in seqs:
            ids = list(s.token_ids)
            for _ in range(k):
                ids.append(int(base.engine.prompt_logits(ids)[-1].argmax()))
            rows.append(ids[-k:])
        return torch.tensor(rows)

    eng.proposer.propose = greedy_drafts
    tokens = sampled_tokens(spec, params)
    for column, expected in ((1, p2), (2, p3)):
        assert gof_pvalue(tokens[:, column], expected) > 1e-3, column
    # the event the penalties act on: t3 repeating t2 (a draft d_1 = t2 accepted before it)
    repeats = int((tokens[:, 2] == tokens[:, 1]).sum())
    assert binomtest(repeats, len(tokens), repeat).pvalue > 1e-3, (repeats, repeat)
    metrics = spec.get_metrics()
    assert metrics["num_accepted_tokens"] > 0.2 * metrics["num_draft_tokens"]


def test_biased_acceptance_is_detected(pair, monkeypatch):
    """Negative control: accepting every draft (ignoring the target) must fail the test."""
    target, draft = pair
    params = SamplingParams(temperature=1.0)
    _, p3, _ = exact_token_distributions(LLM(target), params)
    from laguna_dflash.kernels.accept_pack import accept_and_pack_reference

    def accept_all(drafts, target_tokens, accepted=None):
        every = torch.full((drafts.shape[0],), drafts.shape[1], device=drafts.device)
        return accept_and_pack_reference(drafts, target_tokens, every)

    monkeypatch.setattr(engine_module, "accept_and_pack", accept_all)
    biased = LLM(target, draft=draft, max_num_seqs=128)
    p_value = gof_pvalue(sampled_tokens(biased, params)[:, 2], p3)
    assert p_value < 1e-6, p_value


def test_spec_sampling_with_a_draft_vocabulary_keeps_the_distribution(pair, tmp_path):
    """Drafts from half the vocabulary only (``speculative_token_map``): a draft is still one
    token the verify accepts with the target's probability, so the samples follow the target's
    marginals; the odd ids come only from the verify's corrections and bonus tokens."""
    from laguna_dflash.models.draft_vocab import save_token_map

    target, draft = pair
    params = SamplingParams(temperature=1.0)
    p2, p3, _ = exact_token_distributions(LLM(target, max_num_seqs=128), params)
    token_map = save_token_map(torch.arange(0, 24, 2), tmp_path / "even.pt")
    spec = LLM(target, draft=draft, max_num_seqs=128, speculative_token_map=str(token_map))
    tokens = sampled_tokens(spec, params)
    for column, expected in ((1, p2), (2, p3)):
        assert gof_pvalue(tokens[:, column], expected) > 1e-3, column
    assert (tokens % 2 == 1).any()  # odd tokens still come out
    assert spec.get_metrics()["num_accepted_tokens"] > 0
