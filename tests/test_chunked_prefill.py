"""Chunked prefill (engine/scheduler.py): a prompt longer than the step's token budget is computed
in chunks over several prefill steps, which alternate with the running requests' decode steps.

Units: the chunk sizes, the alternation, a waiting prompt taking what a finishing chunk leaves
of the budget. Engine (CPU, float32, a Laguna target and a random-weight Poolside drafter):
chunked prompts give the unchunked tokens, drafts at every step and prompt logprobs, with and
without the prefix cache; DFlash equals target-only; a running request keeps decoding while a
long prompt is prefilled.
"""

from __future__ import annotations

import random

import pytest
import torch

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.config import SamplingParams as Params
from laguna_dflash.engine.kv_cache import BlockAllocator
from laguna_dflash.engine.scheduler import Scheduler
from laguna_dflash.engine.sequence import Sequence

BLOCK_SIZE = 6


def _seq(i: int, n: int) -> Sequence:
    return Sequence(i, list(range(1, n + 1)), Params(temperature=0, max_tokens=8))


def _step(sched: Scheduler) -> tuple[str, list[tuple[int, int]]]:
    """Schedule one step and play the engine's part: ("prefill", [(request, tokens)]) after
    advancing each request by its chunk (a finished prompt gets its first token), or ("decode",
    [(request, 1)]) after one token each."""
    batch = sched.schedule()
    if batch.is_prefill:
        for s, n in zip(batch.sequences, batch.num_new_tokens):
            s.num_computed += n
            if s.num_computed == s.num_tokens:
                s.output_token_ids.append(0)
        return "prefill", [(s.request_id, n) for s, n in zip(batch.sequences, batch.num_new_tokens)]
    for s in batch.sequences:
        s.num_computed = s.num_tokens
        s.output_token_ids.append(0)
    return "decode", [(s.request_id, 1) for s in batch.sequences]


def test_long_prompts_are_chunked_and_alternate_with_decode_steps():
    sched = Scheduler(BlockAllocator(64, 4), max_num_seqs=4, max_num_batched_tokens=10,
                      enable_chunked_prefill=True)
    sched.add(_seq(0, 6))
    assert _step(sched) == ("prefill", [(0, 6)])
    sched.add(_seq(1, 25))
    sched.add(_seq(2, 7))
    steps = [_step(sched) for _ in range(7)]
    assert steps == [
        ("prefill", [(1, 10)]),  # the long prompt's first chunk: the whole budget
        ("decode", [(0, 1)]),  # the running request's turn
        ("prefill", [(1, 10)]),
        ("decode", [(0, 1)]),
        ("prefill", [(1, 5), (2, 5)]),  # its last chunk; the next prompt takes what is left
        ("decode", [(0, 1), (1, 1)]),
        ("prefill", [(2, 2)]),
    ]
    assert sched.prefilling == [] and [s.request_id for s in sched.running] == [0, 1, 2]


def test_without_chunking_a_long_prompt_is_one_step():
    sched = Scheduler(BlockAllocator(64, 4), max_num_seqs=4, max_num_batched_tokens=30)
    sched.add(_seq(0, 25))
    sched.add(_seq(1, 7))
    assert _step(sched) == ("prefill", [(0, 25)])  # 7 more would pass the budget: next step
    assert _step(sched) == ("prefill", [(1, 7)])


# ---- the engine -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import dflash_fixtures as df

    return df.make_laguna_poolside_pair(tmp_path_factory.mktemp("chunked"), BLOCK_SIZE)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 60) for _ in range(n)] for n in (45, 7, 70, 23)]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("num_speculative_tokens,prefix_caching,device",
                         [(0, True, "cpu"), (0, False, "cpu"), (BLOCK_SIZE - 1, True, "cpu"),
                          (BLOCK_SIZE - 1, False, "cpu"),
                          pytest.param(BLOCK_SIZE - 1, True, "cuda", marks=CUDA)])
def test_chunked_prompts_give_the_unchunked_tokens_drafts_and_logprobs(pair, num_speculative_tokens,
                                                                       prefix_caching, device):
    target, draft = pair
    opts = {"block_size": 4, "enable_prefix_caching": prefix_caching, "device": device}
    if num_speculative_tokens:
        opts.update(draft=draft, num_speculative_tokens=num_speculative_tokens, trace=True)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=2)
    prompts = _prompts(seed=num_speculative_tokens)
    chunked = LLM(target, max_num_batched_tokens=16, **opts)
    whole = LLM(target, enable_chunked_prefill=False, **opts)
    got, want = [[llm.generate(prompt_token_ids=p, sampling_params=params) for p in (prompts, prompts[:2])]
                 for llm in (chunked, whole)]
    for g, w in zip(got, want):
        assert [o.token_ids for o in g] == [o.token_ids for o in w]
        if num_speculative_tokens:
            assert [o.metrics["trace"] for o in g] == [o.metrics["trace"] for o in w]
        for og, ow in zip(g, w):
            assert len(og.prompt_logprobs) == len(ow.prompt_logprobs) == len(og.prompt_token_ids)
            for lg, lw in zip(og.prompt_logprobs[1:], ow.prompt_logprobs[1:]):
                assert lg.keys() == lw.keys()
                # float(): assert_close takes plain numbers, not Logprob (a float subclass)
                torch.testing.assert_close([float(v) for v in lg.values()], [float(v) for v in lw.values()],
                                           atol=1e-4, rtol=1e-4)
            # against the prompt's logits from one whole forward: entry j scores token j
            scores = chunked.engine.prompt_logits(og.prompt_token_ids).log_softmax(-1)
            ids = og.prompt_token_ids
            torch.testing.assert_close([og.prompt_logprobs[j][ids[j]].logprob for j in range(1, len(ids))],
                                       [scores[j - 1, ids[j]].item() for j in range(1, len(ids))],
                                       atol=1e-4, rtol=1e-4)
    assert chunked.get_metrics()["num_steps"] > whole.get_metrics()["num_steps"]
    if num_speculative_tokens:
        base = LLM(target, block_size=4, max_num_batched_tokens=16, device=device)
        assert [o.token_ids for o in got[0]] == [o.token_ids for o in base.generate(
            prompt_token_ids=prompts, sampling_params=params)], "DFlash differs from target-only"


def test_a_running_request_decodes_while_a_long_prompt_is_prefilled(pair):
    target, draft = pair
    engine = LLM(target, draft=draft, block_size=4, max_num_batched_tokens=8).engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    short = engine.add_request([5, 6, 7], params)
    engine.step()  # its prefill
    long = engine.add_request(list(range(3, 43)), params)  # 40 tokens: five chunks of 8
    tokens_during = []
    while long.num_computed < long.num_tokens - 1 or not long.output_token_ids:
        before = len(short.output_token_ids)
        engine.step()
        tokens_during.append(len(short.output_token_ids) - before)
    # prefill and decode steps alternate: the short request got tokens between the chunks
    assert tokens_during[0::2] == [0] * 5 and all(n >= 1 for n in tokens_during[1::2])
    while engine.has_unfinished:
        engine.step()
    alone = LLM(target, block_size=4, enable_chunked_prefill=False)
    want = alone.generate(prompt_token_ids=[long.prompt_token_ids], sampling_params=params)[0]
    assert long.output_token_ids == want.token_ids
