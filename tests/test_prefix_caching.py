"""Automatic prefix caching (engine/kv_cache.py, engine/scheduler.py).

Units: the block hash chain, the allocator's reference counts, lookup, eviction order and
reset, the scheduler's admission (a cached prefix, never the last token, the token budget).
Engine (CPU, float32, a Laguna target with a random-weight Poolside drafter): prompts that share
prefixes with earlier ones (the same prompt again, a longer one, a multi-turn follow-up holding
the first turn's generated tokens, under eviction pressure) give the tokens an engine without
the cache gives, while prefilling fewer tokens; with DFlash the drafts of every step are the
uncached engine's too (the drafter's context K/V is reused from the cache, and a stale one
would change drafts, not the output), and DFlash still equals target-only.
"""

from __future__ import annotations

import random

import pytest
import torch

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.config import SamplingParams as Params
from laguna_dflash.engine.kv_cache import BlockAllocator, block_hashes
from laguna_dflash.engine.scheduler import Scheduler
from laguna_dflash.engine.sequence import Sequence

BLOCK_SIZE = 6  # the drafter's block (K <= 5)
KV_BLOCK = 4
NEW_TOKENS = 20


def test_block_hashes_name_the_whole_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, [])
    assert len(a) == 2  # full blocks only
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, []) == a
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4, a[:1])[:2] == a  # extends
    b = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4, [])
    assert b[0] != a[0] and b[1] != a[1], "a block's hash must depend on every earlier token"
    assert block_hashes([5, 6, 7, 8], 4, [])[0] != a[1], "the same tokens at another offset"


def test_a_cache_salt_seeds_the_whole_chain():
    """vLLM's ``cache_salt``: the same tokens under another salt (or none) name other blocks,
    every block of the chain, and the same salt names the same ones."""
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    plain, a, b = (block_hashes(tokens, 4, [], salt) for salt in (None, "tenant-a", "tenant-b"))
    assert plain == block_hashes(tokens, 4, [])
    assert all(x != y for x, y in zip(plain, a)) and all(x != y for x, y in zip(a, b))
    assert block_hashes(tokens, 4, [], "tenant-a") == a
    assert block_hashes(tokens + [9, 10, 11, 12], 4, a[:1], "tenant-a")[:2] == a  # extends


def test_allocator_shares_evicts_least_recently_freed_and_resets():
    alloc = BlockAllocator(4, 2)
    t1 = alloc.allocate(2)
    h = block_hashes([1, 2, 3, 4], 2, [])
    alloc.register(t1[0], h[0])
    alloc.register(t1[1], h[1])
    assert alloc.lookup(h) == t1 and alloc.lookup(block_hashes([1, 2, 9, 9], 2, [])) == t1[:1]
    alloc.free(t1)
    assert alloc.num_free_blocks == 4 and alloc.lookup(h) == t1  # cached while free
    alloc.share(t1[:1])  # a new request takes the first block from the pool
    assert alloc.num_free_blocks == 3 and alloc.num_unreferenced(t1) == 1
    # the pool hands out never-used blocks, then the least recently freed: t1[1] last
    got = alloc.allocate(2)
    assert t1[1] not in got and alloc.lookup(h) == t1
    got += alloc.allocate(1)
    assert got[-1] == t1[1] and alloc.lookup(h) == t1[:1], "an evicted block keeps no hash"
    with pytest.raises(AssertionError, match="double free"):
        alloc.free([t1[1], t1[1]])
    alloc.reset_prefix_cache()
    assert alloc.lookup(h) == [] and alloc.num_cached_blocks == 0


def _seq(i: int, tokens: list[int], **params) -> Sequence:
    return Sequence(i, tokens, Params(temperature=0, max_tokens=4, **params))


def _with_cached_prompt(num_blocks: int, max_seqs: int, budget: int, prompt_len: int):
    """A prefix-caching scheduler (blocks of 4) whose first request, tokens ``1 ..
    prompt_len``, was prefilled and its full blocks cached -> (allocator, scheduler, request)."""
    alloc = BlockAllocator(num_blocks, 4)
    sched = Scheduler(alloc, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                      enable_prefix_caching=True)
    first = _seq(0, list(range(1, prompt_len + 1)))
    sched.add(first)
    assert sched.schedule().sequences == [first] and first.num_computed == 0
    first.num_computed = prompt_len
    sched.cache_blocks(first)
    assert alloc.num_cached_blocks == prompt_len // 4
    return alloc, sched, first


def test_scheduler_admits_with_the_cached_prefix_and_never_the_last_token():
    alloc, sched, first = _with_cached_prompt(16, 8, 64, 12)  # 3 full blocks
    same = _seq(1, list(range(1, 13)))  # the same prompt: its last block is computed again
    longer = _seq(2, list(range(1, 15)))
    other = _seq(3, [7] + list(range(2, 13)))
    wants_logprobs = _seq(4, list(range(1, 13)), prompt_logprobs=1)
    for s in (same, longer, other):
        sched.add(s)
    batch = sched.schedule().sequences
    assert batch == [same, longer, other]
    assert [s.num_computed for s in batch] == [8, 12, 0]
    assert same.block_table[:2] == first.block_table[:2] and longer.block_table[:3] == first.block_table[:3]
    assert sched.num_prefix_hits == 20 and sched.num_prefix_queries == 12 + 12 + 14 + 12
    sched.add(wants_logprobs)
    for s in (same, longer, other):  # done with their prefills
        s.num_computed = s.num_tokens
    assert sched.schedule().sequences == [wants_logprobs] and wants_logprobs.num_computed == 0


def test_scheduler_budget_counts_only_the_tokens_to_compute():
    _, sched, _ = _with_cached_prompt(32, 4, 20, 16)
    a, b = _seq(1, list(range(1, 19))), _seq(2, list(range(1, 19)))  # 16 cached + 2 new each
    sched.add(a)
    sched.add(b)
    assert sched.schedule().sequences == [a, b], "18 + 18 prompt tokens, but only 2 + 2 to compute"


def test_blocks_wait_for_their_drafter_context():
    """A block is cached only once its drafter context K/V is written too: positions whose
    target taps are still pending (not yet in the drafter's cache) hold it back."""
    alloc = BlockAllocator(8, 4)
    sched = Scheduler(alloc, max_num_seqs=2, max_num_batched_tokens=64, enable_prefix_caching=True)
    seq = _seq(0, list(range(1, 14)))
    sched.add(seq)
    sched.schedule()
    seq.num_computed = 13
    seq.add_pending_taps(torch.zeros(7, 1), 0, 7, 6)  # positions 6..12 not in the drafter's cache
    sched.cache_blocks(seq)
    assert alloc.num_cached_blocks == 1 and seq.num_registered_blocks == 1
    seq.clear_pending_taps()  # stored
    sched.cache_blocks(seq)
    assert alloc.num_cached_blocks == 3
    assert alloc.lookup(block_hashes(list(range(1, 14)), 4, [])) == seq.block_table[:3]


def test_requests_wait_for_a_prefix_being_computed():
    """Requests sent together with one prompt (``n`` choices) compute it once: the later ones
    wait while the first one computes the blocks they would share, and are admitted with them
    cached; an unrelated request behind them is admitted meanwhile, and a short shared head
    (less than half of what a request computes) is not waited for."""
    alloc = BlockAllocator(64, 4)
    sched = Scheduler(alloc, max_num_seqs=8, max_num_batched_tokens=256, enable_prefix_caching=True)
    prompt = list(range(1, 41))
    first, second, third = (_seq(i, list(prompt)) for i in range(3))
    other = _seq(3, [50] + prompt[1:])  # differs in block 0: shares nothing
    head = _seq(4, prompt[:4] + [99] * 30)  # shares block 0 only: 4 of 34 tokens
    for s in (first, second, third, other, head):
        sched.add(s)
    batch = sched.schedule()
    assert batch.sequences == [first, other, head] and batch.num_new_tokens == [40, 40, 34]
    assert list(sched.waiting) == [second, third]
    for s in batch.sequences:  # their prefills ran
        s.num_computed = s.num_tokens
        sched.cache_blocks(s)
    batch = sched.schedule()
    assert batch.sequences == [second, third] and batch.num_new_tokens == [4, 4]
    assert second.num_cached_tokens == third.num_cached_tokens == 36
    assert second.block_table[:9] == first.block_table[:9] == third.block_table[:9]


def test_a_request_waits_for_a_chunked_prefill_of_its_prompt():
    alloc = BlockAllocator(64, 4)
    sched = Scheduler(alloc, max_num_seqs=8, max_num_batched_tokens=16, enable_prefix_caching=True,
                      enable_chunked_prefill=True)
    prompt = list(range(1, 41))
    first, second = _seq(0, list(prompt)), _seq(1, list(prompt))
    sched.add(first)
    sched.add(second)
    for chunk in range(3):  # 16 + 16 + 8 tokens; the other waits for the cache
        batch = sched.schedule()
        assert batch.sequences == [first] and list(sched.waiting) == [second], chunk
        first.num_computed += batch.num_new_tokens[0]
        sched.cache_blocks(first)
    assert first.num_computed == 40
    batch = sched.schedule()
    assert batch.sequences == [second] and second.num_cached_tokens == 36


def test_prefix_waits_off_without_prefix_caching():
    sched = Scheduler(BlockAllocator(64, 4), max_num_seqs=8, max_num_batched_tokens=256)
    a, b = _seq(0, list(range(1, 41))), _seq(1, list(range(1, 41)))
    sched.add(a)
    sched.add(b)
    assert sched.schedule().sequences == [a, b]


# ---- the engine -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import dflash_fixtures as df

    return df.make_laguna_poolside_pair(tmp_path_factory.mktemp("prefix"), BLOCK_SIZE)


def _rounds(seed: int) -> list[list[list[int]]]:
    """Prompt batches run one after another: later ones share prefixes with earlier ones."""
    rng = random.Random(seed)
    system = [rng.randrange(0, 60) for _ in range(23)]
    a = system + [rng.randrange(0, 60) for _ in range(5)]
    b = system + [rng.randrange(0, 60) for _ in range(11)]
    c = [rng.randrange(0, 60) for _ in range(9)]
    return [[a], [a, b, c], [b + [3, 4, 5, 6, 7, 8, 9]], [system[:8]]]


def _run(llm: LLM, rounds: list[list[list[int]]], follow_up: bool = True):
    """Every round's outputs; with ``follow_up`` a last round whose prompt is the first round's
    prompt and output plus new tokens (a second chat turn)."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = [llm.generate(prompt_token_ids=r, sampling_params=params) for r in rounds]
    if follow_up:
        first = outs[0][0]
        turn = first.prompt_token_ids + first.token_ids + [11, 12, 13]
        outs.append(llm.generate(prompt_token_ids=[turn], sampling_params=params))
    return outs


def _tokens(outs) -> list[list[list[int]]]:
    return [[o.token_ids for o in r] for r in outs]


def _drafts(outs) -> list[list[list]]:
    return [[[(t["anchor_position"], t["draft_tokens"], t["num_accepted"]) for t in o.metrics["trace"]]
             for o in r] for r in outs]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("num_speculative_tokens,store_in_verify,device",
                         [(0, True, "cpu"), (BLOCK_SIZE - 1, True, "cpu"), (2, True, "cpu"),
                          (2, False, "cpu"), pytest.param(0, True, "cuda", marks=CUDA),
                          pytest.param(BLOCK_SIZE - 1, True, "cuda", marks=CUDA)])
def test_cached_prefixes_give_the_uncached_tokens_and_drafts(pair, num_speculative_tokens,
                                                             store_in_verify, device, monkeypatch):
    """``store_in_verify=False``: the accepted rows' drafter context waits in the pending taps
    until the next step, so a request ends with positions whose drafter K/V was never written:
    their blocks must not be cached (the follow-up's drafts would see a stale context). On
    CUDA (float32): the Triton attention over a cached prefix, CUDA graphs, drafts queued ahead."""
    from laguna_dflash.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "store_context_in_verify", store_in_verify)
    target, draft = pair
    spec = {"draft": draft, "num_speculative_tokens": num_speculative_tokens, "trace": True} \
        if num_speculative_tokens else {}
    spec["device"] = device
    rounds = _rounds(seed=num_speculative_tokens)
    cached = LLM(target, block_size=KV_BLOCK, **spec)
    plain = LLM(target, block_size=KV_BLOCK, enable_prefix_caching=False, **spec)
    got, want = _run(cached, rounds), _run(plain, rounds)
    assert _tokens(got) == _tokens(want)
    hits = [o.num_cached_tokens for r in got for o in r]
    assert hits[0] == 0 and all(h % KV_BLOCK == 0 for h in hits)
    assert hits[1] >= 24 and hits[2] >= 20, hits  # the same prompt again; the shared system prompt
    assert hits[-1] >= 28 + NEW_TOKENS - KV_BLOCK, "the follow-up reuses the first turn's output"
    assert all(o.num_cached_tokens == 0 for r in want for o in r)
    m, m0 = cached.get_metrics(), plain.get_metrics()
    assert m["prefix_cache_hits"] == sum(hits) and m["prefix_cache_queries"] > m["prefix_cache_hits"]
    assert m["num_prefill_tokens"] == m0["num_prefill_tokens"] - sum(hits)
    if num_speculative_tokens:
        assert _drafts(got) == _drafts(want), "the drafter saw another context: its cached K/V"
        base = LLM(target, block_size=KV_BLOCK, device=device)
        assert _tokens(got) == _tokens(_run(base, rounds)), "DFlash differs from target-only"
        assert m["num_accepted_tokens"] > 0


@pytest.mark.parametrize("num_speculative_tokens", [0, BLOCK_SIZE - 1])
def test_choices_of_one_prompt_prefill_it_once(pair, num_speculative_tokens):
    """Four requests with one 41-token prompt, sent together (``n = 4``): the prompt is computed
    once (the others wait a step and find its blocks cached), and the tokens (greedy) and seeded
    samples are an uncached engine's."""
    target, draft = pair
    spec = {"draft": draft, "num_speculative_tokens": num_speculative_tokens} if num_speculative_tokens else {}
    prompt = [random.Random(5).randrange(0, 60) for _ in range(41)]
    params = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)] * 2 + [
        SamplingParams(temperature=0.9, max_tokens=NEW_TOKENS, ignore_eos=True, seed=7 + i) for i in range(2)]
    cached = LLM(target, block_size=KV_BLOCK, **spec)
    plain = LLM(target, block_size=KV_BLOCK, enable_prefix_caching=False, **spec)
    got = cached.generate(prompt_token_ids=[prompt] * 4, sampling_params=params)
    want = plain.generate(prompt_token_ids=[prompt] * 4, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.num_cached_tokens for o in got] == [0, 40, 40, 40]
    assert cached.get_metrics()["num_prefill_tokens"] == 41 + 3 * 1


def test_cache_salt_shares_prefixes_only_within_a_salt(pair):
    """A prompt sent again under another ``cache_salt`` (vLLM's prompt-dict field, or on the
    parameters) finds nothing cached; under the same salt it finds its blocks; the tokens are
    those of an unsalted run. A bad salt is an error naming it."""
    target, draft = pair
    llm = LLM(target, draft=draft, num_speculative_tokens=2, block_size=KV_BLOCK)
    prompt = list(range(3, 30))
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "a"}], greedy)[0]
    other = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "b"}], greedy)[0]
    unsalted = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy)[0]
    same = llm.generate(prompt_token_ids=[prompt],
                        sampling_params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                       cache_salt="a"))[0]
    assert [o.num_cached_tokens for o in (first, other, unsalted, same)] == [0, 0, 0, 24]
    assert first.token_ids == other.token_ids == unsalted.token_ids == same.token_ids
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate([{"prompt_token_ids": prompt, "cache_salt": ""}], greedy)
    with pytest.raises(ValueError, match="SamplingParams.cache_salt"):
        SamplingParams(cache_salt=5)


def test_eviction_under_a_small_cache_keeps_the_tokens(pair):
    """Few KV blocks: cached prefixes are evicted and blocks reused while requests run."""
    target, draft = pair
    rounds = _rounds(seed=7) * 2
    opts = {"block_size": KV_BLOCK, "num_kv_blocks": 40, "max_model_len": 96}
    got = _run(LLM(target, draft=draft, **opts), rounds, follow_up=False)
    want = _run(LLM(target, draft=draft, enable_prefix_caching=False, **opts), rounds, follow_up=False)
    assert _tokens(got) == _tokens(want)


def test_prompt_logprobs_compute_the_whole_prompt(pair):
    target, _ = pair
    llm = LLM(target, block_size=KV_BLOCK)
    prompt = list(range(3, 30))
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(prompt_token_ids=[prompt], sampling_params=greedy)
    with_logprobs = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=with_logprobs)[0]
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(prompt)
    again = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy)[0]
    assert again.num_cached_tokens == 24
    llm.reset_prefix_cache()
    assert llm.generate(prompt_token_ids=[prompt], sampling_params=greedy)[0].num_cached_tokens == 0


def test_seeded_sampling_draws_the_uncached_tokens(pair):
    """Temperature 0.8 with per-request seeds: a cached prefix changes neither the target's
    distribution nor the draws (DFlash's rejection sampling included)."""
    target, draft = pair
    rounds = _rounds(seed=3)
    params = [SamplingParams(temperature=0.8, max_tokens=NEW_TOKENS, ignore_eos=True, seed=100 + i)
              for i in range(3)]

    def run(llm: LLM) -> list[list[list[int]]]:
        return [[o.token_ids for o in llm.generate(prompt_token_ids=r, sampling_params=params[:len(r)])]
                for r in rounds]

    for spec in ({}, {"draft": draft, "num_speculative_tokens": BLOCK_SIZE - 1}):
        cached = LLM(target, block_size=KV_BLOCK, **spec)
        got = run(cached)
        assert got == run(LLM(target, block_size=KV_BLOCK, enable_prefix_caching=False, **spec))
        assert cached.get_metrics()["prefix_cache_hits"] > 0
        greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        assert got[0][0] != cached.generate(prompt_token_ids=rounds[0], sampling_params=greedy)[0].token_ids
