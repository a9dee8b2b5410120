"""Temperature > 0: speculative sampling keeps the target's distribution.

On a tiny-vocabulary target we compute the exact marginal distributions of the second and third
generated tokens (the first ones that come out of verify steps rather than the prefill), e.g.
``p(t3) = sum_{t1,t2} p(t1 | x) p(t2 | x, t1) p(t3 | x, t1, t2)`` under the same temperature /
top-k / top-p, then draw many independent samples with and without speculation and run
chi-square goodness-of-fit tests against them. A negative control shows the test has teeth: an engine that
accepts every draft unconditionally fails it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import laguna_dflash.engine.engine as engine_module
from laguna_dflash import LLM, SamplingParams
from laguna_dflash.engine.sampler import filtered_probs

PROMPT = [3, 14, 15, 9, 2, 6]
NUM_SAMPLES = 1200


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import dflash_fixtures as df

    root = tmp_path_factory.mktemp("sampling")
    target = df.make_tiny_qwen3_target(root / "target", seed=0, vocab_size=24)
    draft = df.make_zlab_drafter(root / "draft", target, seed=0, num_layers=1, block_size=4,
                                 mask_token_id=23)
    return target, draft


def exact_token_distributions(llm: LLM, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Exact marginals ``(p(t2), p(t3))`` by enumerating every prefix with non-zero probability."""
    eng = llm.engine

    def probs(ids: list[int]) -> torch.Tensor:
        logits = eng.prompt_logits(ids)[-1:]
        return filtered_probs(logits, params.temperature, params.top_k, params.top_p,
                              params.min_p)[0].double()

    p1 = probs(PROMPT)
    p2 = torch.zeros_like(p1)
    p3 = torch.zeros_like(p1)
    for t1 in torch.nonzero(p1 > 1e-12).flatten().tolist():
        q2 = probs(PROMPT + [t1])
        p2 += p1[t1] * q2
        for t2 in torch.nonzero(p1[t1] * q2 > 1e-12).flatten().tolist():
            p3 += p1[t1] * q2[t2] * probs(PROMPT + [t1, t2])
    return p2.numpy(), p3.numpy()


def sampled_tokens(llm: LLM, params: SamplingParams) -> np.ndarray:
    """``[NUM_SAMPLES, 3]`` generated tokens, one independent seeded request per row."""
    plist = [SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                            min_p=params.min_p, max_tokens=3, ignore_eos=True, seed=1000 + i)
             for i in range(NUM_SAMPLES)]
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
], ids=["t1", "t1.6-topk-topp", "t1.6-minp"])
def test_spec_sampling_matches_target_distribution(pair, params, adaptive):
    target, draft = pair
    base = LLM(target, max_num_seqs=128)
    p2, p3 = exact_token_distributions(base, params)
    assert (p2 > 0.02).sum() >= 3 and (p3 > 0.02).sum() >= 3  # genuinely spread
    spec = LLM(target, draft=draft, max_num_seqs=128, adaptive_k=adaptive)
    if adaptive:
        spec.engine.adaptive_k.explore_every = 2  # switch K often
    for llm in (base, spec):
        tokens = sampled_tokens(llm, params)
        for column, expected in ((1, p2), (2, p3)):
            p_value = gof_pvalue(tokens[:, column], expected)
            assert p_value > 1e-3, (llm.engine.proposer is not None, column, p_value)
    assert spec.get_metrics()["num_accepted_tokens"] > 0  # drafts were accepted sometimes


def test_biased_acceptance_is_detected(pair, monkeypatch):
    """Negative control: accepting every draft (ignoring the target) must fail the test."""
    target, draft = pair
    params = SamplingParams(temperature=1.0)
    _, p3 = exact_token_distributions(LLM(target), params)
    monkeypatch.setattr(engine_module, "num_accepted",
                        lambda drafts, target_tokens: torch.full((drafts.shape[0],), drafts.shape[1]))
    biased = LLM(target, draft=draft, max_num_seqs=128)
    p_value = gof_pvalue(sampled_tokens(biased, params)[:, 2], p3)
    assert p_value < 1e-6, p_value
