"""Qwen3 flavour against the PyPI ``dflash`` reference (``DFlashDraftModel`` + ``dflash_generate``).

Same weights, same prompts, greedy: our engine's per-step acceptance lengths (``a + 1`` per verify
step, from ``--trace``) and generated tokens equal the reference's, for a transformers Qwen3
target and a transformers Laguna target.
"""

from __future__ import annotations

import random

import pytest

from laguna_dflash import LLM, SamplingParams

BLOCK_SIZE = 5
MAX_NEW = 40


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    import dflash_fixtures as df

    root = tmp_path_factory.mktemp("ref")
    out = {}
    for name, make in (("qwen3", df.make_tiny_qwen3_target), ("laguna", df.make_tiny_laguna_target)):
        target = make(root / name, seed=2)
        out[name] = (target, df.make_zlab_drafter(root / f"{name}_draft", target, seed=2,
                                                 num_layers=2, block_size=BLOCK_SIZE))
    return out


def ours_per_step(trace: list[dict], max_new: int) -> list[int]:
    """Acceptance length per step, clipped to the remaining budget as the reference reports it."""
    taus, emitted = [], 1  # the first token comes from the prefill
    for step in trace:
        tau = min(step["num_accepted"] + 1, max_new - emitted)
        taus.append(tau)
        emitted += tau
    return taus


@pytest.mark.parametrize("target_kind", ["qwen3", "laguna"])
def test_acceptance_lengths_match_dflash_generate(pairs, target_kind):
    import dflash_fixtures as df

    target, draft = pairs[target_kind]
    rng = random.Random(11)
    prompts = [[rng.randrange(0, 60) for _ in range(n)] for n in (4, 11, 19)]
    llm = LLM(target, draft=draft, trace=True)
    outs = llm.generate(prompt_token_ids=prompts,
                        sampling_params=SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    all_taus = []
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_taus = df.reference_dflash_generate(target, draft, prompt, MAX_NEW)
        assert out.token_ids == ref_tokens
        taus = ours_per_step(out.metrics["trace"], MAX_NEW)
        assert taus == ref_taus
        all_taus += taus
    assert max(all_taus) > 1 and min(all_taus) < BLOCK_SIZE  # both accepts and rejects happen
