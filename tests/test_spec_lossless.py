"""Lossless speculative decoding: greedy spec output == greedy target-only output, token for token.

Both drafter flavours (Poolside Laguna drafter on a Laguna target; z-lab Qwen3-flavour drafter on
a Qwen3 and on a Laguna target), batches of 1 to 8 prompts of mixed lengths (several longer than
the target's sliding window), K = block_size - 1 and a smaller K. The z-lab drafters are partly trained
(distilled for a few steps) so drafts are often but not always accepted: both the accept and the
reject paths run. The Poolside drafter has random weights (it shares the target's embeddings
and lm_head, so a few drafts are still accepted; tests/test_engine_stress.py forces every
acceptance count with oracle drafts).
"""

from __future__ import annotations

import random

import pytest

from laguna_dflash import LLM, SamplingParams

BLOCK_SIZE = 6


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    import dflash_fixtures as df

    root = tmp_path_factory.mktemp("spec")
    laguna = df.make_tiny_laguna_target(root / "laguna", seed=0)
    qwen3 = df.make_tiny_qwen3_target(root / "qwen3", seed=0)
    return {
        "laguna+poolside": (laguna, df.make_poolside_laguna_drafter(
            root / "poolside", laguna, seed=0, block_size=BLOCK_SIZE)),
        "laguna+zlab": (laguna, df.make_zlab_drafter(
            root / "zlab_on_laguna", laguna, seed=0, num_layers=2, block_size=BLOCK_SIZE)),
        "qwen3+zlab": (qwen3, df.make_zlab_drafter(
            root / "zlab", qwen3, seed=0, num_layers=2, block_size=BLOCK_SIZE)),
    }


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 3, 9, 17, 26, 5, 33, 12][:n]
    return [[rng.randrange(0, 60) for _ in range(length)] for length in lengths]


@pytest.mark.parametrize("pair_name", ["laguna+poolside", "laguna+zlab", "qwen3+zlab"])
@pytest.mark.parametrize("num_speculative_tokens", [BLOCK_SIZE - 1, 2])
def test_greedy_spec_equals_target_only(pairs, pair_name, num_speculative_tokens):
    target, draft = pairs[pair_name]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = LLM(target, block_size=4)
    spec = LLM(target, draft=draft, num_speculative_tokens=num_speculative_tokens, block_size=4)
    total_accepted = 0
    for batch_size in (1, 3, 8):
        prompts = _prompts(batch_size, seed=batch_size)
        want = [o.token_ids for o in base.generate(prompt_token_ids=prompts, sampling_params=params)]
        got = spec.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in got] == want, f"{pair_name} K={num_speculative_tokens} batch={batch_size}"
        for o in got:
            m = o.metrics
            assert m["num_draft_tokens"] == num_speculative_tokens * m["num_drafts"]
            assert 0 <= m["num_accepted_tokens"] <= m["num_draft_tokens"]
            per_pos = m["num_accepted_tokens_per_pos"]
            assert sum(per_pos) == m["num_accepted_tokens"]
            assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # prefix acceptance
            total_accepted += m["num_accepted_tokens"]
    # the engine-wide counters add up and drafts were really accepted sometimes
    stats = spec.get_metrics()
    assert stats["num_accepted_tokens"] == total_accepted > 0
    assert stats["mean_acceptance_length"] == pytest.approx(
        1 + stats["num_accepted_tokens"] / stats["num_drafts"])
    assert stats["num_accepted_tokens"] < stats["num_draft_tokens"]  # rejections happened too


def test_spec_respects_stop_tokens_and_max_tokens(pairs):
    target, draft = pairs["laguna+poolside"]
    prompts = _prompts(4, seed=7)
    base = LLM(target).generate(prompt_token_ids=prompts,
                                sampling_params=SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    stop = base[0].token_ids[5]
    params = SamplingParams(temperature=0, max_tokens=23, stop_token_ids=[stop], ignore_eos=True)
    want = LLM(target).generate(prompt_token_ids=prompts, sampling_params=params)
    got = LLM(target, draft=draft).generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert got[0].finish_reason == "stop" and got[0].token_ids[-1] == stop
    assert all(len(o.token_ids) <= 23 for o in got)


def test_spec_under_kv_pressure_preempts_and_stays_lossless(pairs, caplog):
    target, draft = pairs["laguna+poolside"]
    prompts = _prompts(8, seed=3)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = LLM(target).generate(prompt_token_ids=prompts, sampling_params=params)
    llm = LLM(target, draft=draft, block_size=4, num_kv_blocks=36, max_model_len=96)
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert any("preempting" in r.message for r in caplog.records)  # pressure was real
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks


@pytest.mark.parametrize("pair_name", ["laguna+poolside", "qwen3+zlab"])
def test_adaptive_k_is_lossless_and_counts_drafted_tokens(pairs, pair_name):
    """Adaptive K switches between K values and plain decoding; output never changes and the
    drafter's context stays complete across target-only steps."""
    target, draft = pairs[pair_name]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = _prompts(8, seed=5)
    want = [o.token_ids for o in LLM(target).generate(prompt_token_ids=prompts, sampling_params=params)]
    llm = LLM(target, draft=draft, adaptive_k=True)
    llm.engine.k_policy.explore_every = 3  # force frequent switching in a short run
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == want
    seen_k = {k for k, _ in llm.engine.k_policy.step_time}
    assert 0 in seen_k and BLOCK_SIZE - 1 in seen_k
    stats = llm.get_metrics()
    assert stats["num_accepted_tokens"] <= stats["num_draft_tokens"] <= (BLOCK_SIZE - 1) * stats["num_drafts"]
    for o in got:
        per_pos = o.metrics["num_accepted_tokens_per_pos"]
        assert sum(per_pos) == o.metrics["num_accepted_tokens"]
        assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))


def test_simulated_acceptance_length_for_benchmarks(pairs):
    """Benchmark switch: drafts accepted so that the mean acceptance length is the given value
    (K=5, L=3.5 -> 2 or 3 accepted per step, 2.5 on average); committed tokens stay consistent."""
    target, draft = pairs["laguna+poolside"]
    llm = LLM(target, draft=draft, simulate_acceptance_length=3.5)
    out = llm.generate(prompt_token_ids=_prompts(2, seed=1),
                       sampling_params=SamplingParams(temperature=0, max_tokens=41, ignore_eos=True))
    stats = llm.get_metrics()
    assert stats["mean_acceptance_length"] == pytest.approx(3.5, abs=0.1)
    assert all(len(o.token_ids) == 41 for o in out)
    with pytest.raises(ValueError, match="simulate_acceptance_length"):
        LLM(target, draft=draft, simulate_acceptance_length=0.5)


def test_simulated_counts_upload_once_per_distinct_tuple(pairs, monkeypatch):
    """A simulated step takes its accepted counts from a device tensor uploaded once per
    distinct tuple: at an integer L over a fixed batch every step reuses one (no upload a step,
    as with real acceptance), while a fractional L still averages to L."""
    import laguna_dflash.engine.engine as engine_module

    uploads = []
    real = engine_module.to_device_async

    def spy(t, device):
        uploads.append(tuple(t.tolist()))
        return real(t, device)

    monkeypatch.setattr(engine_module, "to_device_async", spy)
    target, draft = pairs["laguna+poolside"]
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    llm = LLM(target, draft=draft, num_speculative_tokens=3, simulate_acceptance_length=4)
    uploads.clear()
    llm.generate(prompt_token_ids=_prompts(2, seed=3), sampling_params=params)
    stats = llm.get_metrics()
    assert stats["num_drafts"] >= 2 * 5 and stats["mean_acceptance_length"] == 4.0
    assert uploads.count((3, 3)) == 1
    frac = LLM(target, draft=draft, num_speculative_tokens=3, simulate_acceptance_length=2.5)
    frac.generate(prompt_token_ids=_prompts(1, seed=3), sampling_params=params)
    assert frac.get_metrics()["mean_acceptance_length"] == pytest.approx(2.5, abs=0.1)
    assert set(frac.engine._sim_counts_on_device) == {(1,), (2,)}


def test_decode_token_count_is_the_tokens_delivered(pairs):
    """``num_decode_tokens`` (the benchmarks' tokens/s numerator) counts the tokens a request
    kept: a verify that accepts past max_tokens delivers only up to it. 6 accepted a step at
    max_tokens 1 + 8 overshoots by 4 in the second step."""
    target, draft = pairs["laguna+poolside"]
    llm = LLM(target, draft=draft, simulate_acceptance_length=6)
    out = llm.generate(prompt_token_ids=_prompts(3, seed=2),
                       sampling_params=SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [9] * 3
    assert llm.get_metrics()["num_decode_tokens"] == 3 * 8  # the prefill's first token excluded


def test_vllm_speculative_config_spelling(pairs):
    """``LLM(target, speculative_config={"method": "dflash", "model": DIR,
    "num_speculative_tokens": K})``, vLLM's offline spelling, builds the same engine as
    ``draft=DIR, num_speculative_tokens=K`` (same tokens, same acceptance); a bad dict or both
    spellings at once are errors naming ``speculative_config=``."""
    target, draft = pairs["laguna+poolside"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = _prompts(3, seed=2)
    ours = LLM(target, draft=draft, num_speculative_tokens=3)
    vllm = LLM(target, speculative_config={"method": "dflash", "model": str(draft), "num_speculative_tokens": 3})
    assert vllm.config.speculative == ours.config.speculative
    want = ours.generate(prompt_token_ids=prompts, sampling_params=params)
    got = vllm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.metrics["num_accepted_tokens"] for o in got] == [o.metrics["num_accepted_tokens"] for o in want]
    for bad, needle in (({"method": "eagle", "model": str(draft)}, "method 'eagle'"),
                        ({"num_speculative_tokens": 3}, 'needs "model"'),
                        ({"model": str(draft), "num_speculative_tokens": "3"}, "JSON integer"),
                        ([str(draft)], "must be a JSON object")):
        with pytest.raises(ValueError, match=f"speculative_config=.*{needle}"):
            LLM(target, speculative_config=bad)
    with pytest.raises(ValueError, match="give the drafter once"):
        LLM(target, draft=draft, speculative_config={"model": str(draft)})
