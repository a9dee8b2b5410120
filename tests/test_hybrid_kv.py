"""The hybrid KV layout (vLLM's hybrid KV cache manager): sliding-window layers keep their K/V
only within the window, so a long context costs the full layers' K/V per token.

The layout's groups (XS-2.1 / S-2.1 layer mixes); the pooled tensors (layer ``i`` of every
group is one tensor); the engine's capacity at the same memory; every output equal to the
unified layout's (target-only, DFlash, the CPU padded graph path, prefix-cache hits, chunked
prefill) while the SWA tables stay within the window; the padded metadata of each group's table
equal to the per-forward metadata. The randomised load with preemption, aborts and the prefix
cache runs in ``tests/test_engine_stress.py`` under both layouts. CPU, float32.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.engine.cuda_graph import CUDAGraphRunner
from laguna_dflash.engine.kv_cache import MAX_KV_GROUPS, HybridLayout, KVCache
from laguna_dflash.engine.runner import ForwardItem, build_group_metadata

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dflash_fixtures as df  # noqa: E402

UNIFIED = dict(disable_hybrid_kv_cache_manager=True)


def _windows(full_every: int, num_layers: int, window: int = 512) -> list[int | None]:
    return [None if i % full_every == 0 else window for i in range(num_layers)]


def test_layout_groups_laguna_layer_mixes():
    """XS-2.1 (10 full + 30 sliding) and S-2.1 (12 + 36): one full group and three sliding ones
    of the full count; every group holds one kind and each index once; nothing where no group
    split applies."""
    for num_layers, size in ((40, 10), (48, 12)):
        windows = _windows(4, num_layers)
        layout = HybridLayout.for_layers(windows)
        assert (layout.group_size, layout.num_swa_groups, layout.sliding_window) == (size, 3, 512)
        members: dict[int, list[int]] = {}
        for layer, (g, i) in enumerate(zip(layout.group_of_layer, layout.index_in_group)):
            members.setdefault(g, []).append(i)
            assert (g == 0) == (windows[layer] is None)
        assert all(sorted(idx) == list(range(size)) for idx in members.values())
    assert HybridLayout.for_layers([None] * 4) is None  # no sliding layer
    assert HybridLayout.for_layers([8] * 4) is None  # no full layer
    assert HybridLayout.for_layers([None, None, 8, 8, 8]) is None  # 3 sliding, 2 full: unequal groups
    assert HybridLayout.for_layers([None] + [8] * MAX_KV_GROUPS) is None  # too many groups
    assert HybridLayout.for_layers([None, 8, 16]).sliding_window == 16  # the largest window


def test_pooled_tensors_are_shared_by_one_index_of_every_group():
    layout = HybridLayout.for_layers(_windows(4, 8, window=4))  # 2 full + 6 sliding: 4 groups of 2
    kv = KVCache(8, 5, 4, 2, 8, torch.float32, "cpu", layout)
    ptrs = {(layout.index_in_group[i], k.data_ptr()) for i, (k, _) in enumerate(kv.layers)}
    assert len({p for _, p in ptrs}) == layout.group_size == 2 and len(ptrs) == 2
    assert all(k.shape == (6 * 4, 2, 8) for k, _ in kv.layers)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return df.make_laguna_poolside_pair(tmp_path_factory.mktemp("hybrid"), 4)


@pytest.fixture(scope="module")
def three_groups(tmp_path_factory):
    """A target of 1 full + 3 sliding layers (window 4): 3 sliding groups of one layer."""
    types = ["full_attention"] + ["sliding_attention"] * 3
    return df.make_tiny_laguna_target(tmp_path_factory.mktemp("groups"), layer_types=types,
                                      num_attention_heads_per_layer=[4, 8, 8, 8])


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 60) for _ in range(n)] for n in lengths]


def test_same_memory_holds_more_blocks(pair, monkeypatch):
    """A KV budget of 100 unified blocks: the hybrid pool's blocks hold one group's layers (2 of
    the fixture's 4), so it has twice the blocks; an explicit num_kv_blocks is the same memory."""
    from laguna_dflash.engine import engine as engine_module

    target, _ = pair
    per_block = KVCache.bytes_per_block(4, 16, 2, 8, torch.float32)  # the fixture's 4 layers
    monkeypatch.setattr(engine_module, "_CPU_KV_BUDGET_BYTES", 100 * per_block)
    hybrid, unified = LLM(target, max_model_len=64).engine, LLM(target, max_model_len=64, **UNIFIED).engine
    assert unified.allocator.num_blocks == 100
    assert hybrid.kv_layout is not None and unified.kv_layout is None
    assert hybrid.allocator.num_blocks == 2 * unified.allocator.num_blocks
    assert LLM(target, max_model_len=64, num_kv_blocks=20).engine.allocator.num_blocks == 40


def test_a_drafter_in_the_pool_makes_the_same_memory_hold_more_blocks(pair, monkeypatch):
    """With the drafter's 2 layers in a sliding group of their own, a block holds 2 layers
    (one group's) instead of the unified layout's 4 + 2: three times the blocks of the same
    budget, and of the same explicit num_kv_blocks' memory."""
    from laguna_dflash.engine import engine as engine_module

    target, draft = pair
    per_block = KVCache.bytes_per_block(4 + 2, 16, 2, 8, torch.float32)
    monkeypatch.setattr(engine_module, "_CPU_KV_BUDGET_BYTES", 100 * per_block)
    options = dict(draft=draft, num_speculative_tokens=3, max_model_len=64)
    hybrid, unified = LLM(target, **options).engine, LLM(target, **options, **UNIFIED).engine
    assert unified.allocator.num_blocks == 100 and hybrid.kv_layout.draft_group == 2
    assert hybrid.allocator.num_blocks == 3 * unified.allocator.num_blocks
    assert LLM(target, **options, num_kv_blocks=20).engine.allocator.num_blocks == 60
    tensors = {t.data_ptr() for cache in (hybrid.runner.kv_cache, hybrid.proposer.kv_cache)
               for layer in cache.layers for t in layer}
    assert len(tensors) == 2 * 2  # the pool's K and V of 2 layers, nothing of the drafter's own
    num_slots = hybrid.runner.kv_cache.num_slots
    assert KVCache.num_bytes(hybrid.runner.kv_cache, hybrid.proposer.kv_cache) == 4 * num_slots * 2 * 8 * 4
    unified_slots = unified.runner.kv_cache.num_slots  # 4 target layers and the drafter's 2, K and V
    assert KVCache.num_bytes(unified.runner.kv_cache, unified.proposer.kv_cache) == 12 * unified_slots * 2 * 8 * 4


def test_layout_with_drafter_groups_only_a_sliding_drafter_that_fits(tmp_path):
    """Laguna XS-2.1's drafter (5 sliding layers) and S-2.1's (6) take group 4 of blocks of 10
    / 12 layers; a drafter with a full-attention layer, more layers than a group, or past the
    group limit keeps its own cache (the layout unchanged), as does one whose K/V rows have
    another shape (the engine's check): its generation is still the target's."""
    xs = HybridLayout.for_layers(_windows(4, 40))
    s21 = HybridLayout.for_layers(_windows(4, 48))
    for layout, num in ((xs, 5), (s21, 6)):
        with_draft = layout.with_drafter([512] * num)
        assert (with_draft.draft_group, with_draft.num_draft_layers, with_draft.num_swa_groups) == (4, num, 4)
        assert with_draft.group_of_layer == layout.group_of_layer
    assert xs.with_drafter([512, None]) is xs
    assert xs.with_drafter([512] * 11) is xs
    assert xs.with_drafter([1024]).sliding_window == 1024
    most = HybridLayout.for_layers([None] + [8] * (MAX_KV_GROUPS - 1))
    assert most.with_drafter([8]) is most
    target = df.make_tiny_laguna_target(tmp_path / "t")
    wide = df.make_poolside_laguna_drafter(tmp_path / "d", target, head_dim=16)
    llm = LLM(target, draft=wide, num_speculative_tokens=3, block_size=4, max_model_len=64)
    assert llm.engine.kv_layout.draft_group == 0 and llm.engine.kv_layout.num_swa_groups == 1
    assert llm.engine.proposer.kv_cache.layers[0][0].shape[-1] == 16
    prompt, params = _prompts([9], seed=6), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = LLM(target, block_size=4, max_model_len=64).generate(prompt_token_ids=prompt, sampling_params=params)
    got = llm.generate(prompt_token_ids=prompt, sampling_params=params)
    assert got[0].token_ids == want[0].token_ids


# (the three-group target has no drafter: the fixture's drafter taps the pair's target)
@pytest.mark.parametrize(("fixture", "with_draft"), [("pair", False), ("pair", True), ("three_groups", False)])
def test_outputs_equal_the_unified_layout_and_the_window_is_kept(request, fixture, with_draft):
    """Greedy and seeded outputs of long generations (the window is 4 positions) equal the
    unified layout's, target-only and DFlash, on the CPU's padded graph path too; after every
    step a request's SWA tables hold no block before its window (and at most the window plus
    a step's positions), while its full table covers every position."""
    if fixture == "pair":
        target, draft = request.getfixturevalue("pair")
    else:
        target, draft = request.getfixturevalue("three_groups"), None
    options = dict(block_size=4, max_model_len=96, max_num_batched_tokens=16)
    if with_draft:
        options.update(draft=draft, num_speculative_tokens=3)
    prompts = _prompts([5, 30, 12], seed=1)
    params = [SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=45, ignore_eos=True)]
    unified = LLM(target, **options, **UNIFIED)
    want = [o.token_ids for o in unified.generate(prompt_token_ids=prompts, sampling_params=params)]
    for graphs in (False, True):
        llm = LLM(target, **options)
        engine = llm.engine
        layout = engine.kv_layout
        # the pair's drafter (2 layers, window 8) keeps its context in a sliding group of its own
        assert layout is not None and layout.num_swa_groups == (2 if with_draft else 1 if fixture == "pair" else 3)
        assert layout.draft_group == (2 if with_draft else 0)
        if graphs:
            engine.attach_graph_runners()
        seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        most_held = 0
        while engine.has_unfinished:
            engine.step()
            for s in seqs:
                if s.is_finished or not s.block_table:  # done, or not admitted yet
                    continue
                first = max(0, s.num_computed - layout.sliding_window) // 4
                for table in s.swa_block_tables:
                    held = [b for b in table if b != engine.scheduler.null_block]
                    assert held == table[s.swa_start:] and s.swa_start == min(first, len(table))
                    most_held = max(most_held, len(held))
                assert len(s.block_table) * 4 >= s.num_computed
        assert [s.output_token_ids for s in seqs] == want
        if with_draft:  # the same drafts: the drafter saw the same context within its window
            assert engine.spec_stats.as_dict() == unified.engine.spec_stats.as_dict()
            assert engine.spec_stats.num_accepted_tokens > 0
        # the window (4, the drafter's 8) plus a step's positions (chunks of 16, or K + 1 + the
        # drafts ahead)
        assert most_held <= -(-(layout.sliding_window + 16 + 8) // 4) + 1
        assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


def test_prefix_cache_hits_need_the_window_and_give_the_same_tokens(pair):
    """A prompt sent again hits the prefix cache under the hybrid layout (its full blocks and
    each SWA group's last window before the hit) and decodes what it did the first time; with
    the SWA blocks' names forgotten, the hit is gone (the window cannot be restored)."""
    target, draft = pair
    llm = LLM(target, draft=draft, num_speculative_tokens=3, block_size=4, max_model_len=96)
    prompt = _prompts([41], seed=5)[0]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    again = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    assert again.token_ids == first.token_ids and again.num_cached_tokens == 40
    engine = llm.engine
    alloc = engine.allocator
    for h, b in list(alloc._block_of.items()):  # forget the SWA blocks' names only
        if len(h) > 32:
            del alloc._block_of[h], alloc._hash_of[b]
    third = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    assert third.token_ids == first.token_ids and third.num_cached_tokens == 0


def test_prompt_logits_equal_the_unified_layout(pair):
    target, _ = pair
    prompt = _prompts([23], seed=2)[0]
    hybrid = LLM(target, block_size=4, max_model_len=64).engine.prompt_logits(prompt)
    unified = LLM(target, block_size=4, max_model_len=64, **UNIFIED).engine.prompt_logits(prompt)
    assert torch.allclose(hybrid, unified, atol=1e-5)


def test_padded_metadata_of_every_table_matches_build_group_metadata():
    """The graph runner's state rows hold one table per group; the on-device metadata of each
    (real rows) equals the per-forward metadata of the items' tables."""
    layout = HybridLayout.for_layers([None, 4, 4, 4])  # 3 SWA groups of one layer
    kv = KVCache(4, 40, 4, 1, 8, torch.float32, "cpu", layout)
    runner = CUDAGraphRunner(torch.nn.Identity(), kv, None, torch.device("cpu"), max_num_seqs=8,
                             max_model_len=100, max_tokens_per_request=3)
    null = kv.scratch_slot // 4
    items = [ForwardItem(3, 10, 13, [5, 2, 9, 7], ([null, 11, 12, 13], [null, 14, 15, 16], [null, 17, 18, 19])),
             ForwardItem(3, 0, 3, [1], ([20], [21], [22])),
             ForwardItem(3, 4, 7, [3, 4], ([23, 24], [25, 26], [27, 28]))]
    ref, swa_refs = build_group_metadata(items, 4, kv.scratch_slot, torch.device("cpu"))
    rows = runner.host_rows
    rows[:4, : runner.ids_offset] = null
    for i, it in enumerate(items):
        rows[i, 0], rows[i, 1] = it.start_pos, it.seq_len
        for t, blocks in enumerate((it.block_table, *it.swa_block_tables)):
            col = 2 + t * runner.max_blocks
            rows[i, col : col + len(blocks)] = blocks
    rows[3, 0], rows[3, 1] = 0, 3
    runner.state.copy_(runner.host_state)
    metas = runner._metadata(4, 3, runner.key_bucket(13), is_causal=True)
    assert len(metas) == 4 and len(swa_refs) == 3
    for meta, want in zip(metas, (ref, *swa_refs)):
        assert torch.equal(meta.positions[:9], want.positions)
        assert torch.equal(meta.slot_mapping[:9], want.slot_mapping)
        assert torch.equal(meta.key_slots[:3, : want.key_slots.shape[1]], want.key_slots)
    assert not torch.equal(swa_refs[0].slot_mapping, swa_refs[1].slot_mapping)


def test_a_chunked_prefill_short_of_sliding_blocks_shrinks_its_chunk_then_preempts():
    """Chunked prompts hold their full blocks from admission but take their sliding groups'
    blocks chunk by chunk: with fewer free than a chunk needs, the chunk shrinks to what fits;
    with none free and no decode to free any, the newest chunked request goes back to waiting
    (its blocks freed) instead of the engine stalling."""
    from laguna_dflash.engine.kv_cache import BlockAllocator
    from laguna_dflash.engine.scheduler import Scheduler
    from laguna_dflash.engine.sequence import Sequence, Status

    layout = HybridLayout.for_layers([None, 4])  # one sliding group, window 4
    alloc = BlockAllocator(40, 4)
    sched = Scheduler(alloc, max_num_seqs=4, max_num_batched_tokens=8, enable_chunked_prefill=True,
                      layout=layout)
    a, b = (Sequence(i, list(range(40)), SamplingParams(temperature=0, max_tokens=4)) for i in range(2))
    for seq in (a, b):  # both admitted, a first chunk of 8 computed
        assert sched._admit(seq, [], [[]], 8)  # 11 full blocks, sliding blocks for positions < 9
        seq.num_computed, seq.status = 8, Status.RUNNING
        sched.trim_window(seq)
        sched.prefilling.append(seq)

    def step() -> list[tuple[int, int]]:
        batch = sched.schedule()
        for seq, n in zip(batch.sequences, batch.num_new_tokens):
            seq.num_computed += n
            sched.trim_window(seq)
        return [(s.request_id, n) for s, n in zip(batch.sequences, batch.num_new_tokens)]

    held = alloc.allocate(alloc.num_free_blocks)  # no block free: 4-token chunks need none
    assert step() == [(0, 4), (1, 4)]
    held += alloc.allocate(alloc.num_free_blocks)  # what the trims freed: now every chunk needs one
    assert step() == [(0, 8)]  # b preempted: back to waiting, its blocks free for a
    assert b in sched.waiting and not b.block_table and b.num_preemptions == 1
    assert sched.prefilling == [a] and a.num_computed == 20
    alloc.free(held)


def test_a_last_prompt_token_whose_lookahead_needs_more_sliding_blocks_than_free_preempts():
    """A chunk holding a prompt's last token reserves the decode lookahead too, which can take
    more sliding blocks than a one-token chunk elsewhere: with one block free (as many as the
    sliding groups) and two needed, and nothing decoding, the newest chunked request goes back
    to waiting so the other finishes its prompt; before, schedule() returned None with work
    left, and the engine's loop spun forever. One alone that cannot fit is an error."""
    from laguna_dflash.engine.kv_cache import BlockAllocator
    from laguna_dflash.engine.scheduler import Scheduler
    from laguna_dflash.engine.sequence import Sequence, Status

    layout = HybridLayout.for_layers([None, 4])  # one sliding group, window 4
    alloc = BlockAllocator(40, 4)
    sched = Scheduler(alloc, max_num_seqs=4, max_num_batched_tokens=8, enable_chunked_prefill=True,
                      layout=layout, num_lookahead=7)
    a, b = (Sequence(i, list(range(9)), SamplingParams(temperature=0, max_tokens=4)) for i in range(2))
    for seq in (a, b):  # sliding blocks reserved for positions < 12, 8 of 9 prompt tokens computed
        assert sched._admit(seq, [], [[]], 4)
        seq.num_computed, seq.status = 8, Status.RUNNING
        sched.trim_window(seq)
        sched.prefilling.append(seq)
    held = alloc.allocate(alloc.num_free_blocks - 1)
    assert sched._swa_needed(a, 9 + 1 + 7) == 2  # the last token and the lookahead: 17 positions
    batch = sched.schedule()
    assert batch is not None and batch.sequences == [a] and batch.num_new_tokens == [1]
    assert b in sched.waiting and b.num_preemptions == 1 and not b.block_table
    sched.running.clear()  # a alone, short of one block: an error, not a stall
    sched.prefilling.clear()
    sched.waiting.clear()
    sched.release(a)
    assert sched._admit(a, [], [[]], 4)
    a.num_computed = 8
    sched.trim_window(a)
    sched.prefilling.append(a)
    held += alloc.allocate(alloc.num_free_blocks - 1)
    with pytest.raises(RuntimeError, match="raise num_kv_blocks"):  # recomputed, it would be back
        sched.schedule()
    assert a.num_preemptions == 0 and sched.prefilling == [a]  # left for the caller to abort
    alloc.free(held)


def test_drafter_context_within_its_window_equals_the_unified_layouts(pair):
    """The drafter's layers (all sliding, window 8, longer than the target's 4) keep their
    context K/V in a sliding group of their own: run step by step beside the unified layout
    (the drafter's own full-context cache), after every step each request's drafter K/V at the
    positions its next block reads (its window before the pending bonus, context final there)
    equal the unified layout's, and the drafter's table holds no block before the window."""
    target, draft = pair
    options = dict(draft=draft, num_speculative_tokens=3, block_size=4, max_model_len=96,
                   max_num_batched_tokens=16)
    hybrid, unified = LLM(target, **options).engine, LLM(target, **options, **UNIFIED).engine
    layout = hybrid.kv_layout
    assert (layout.draft_group, layout.sliding_window) == (2, 8)
    assert hybrid.proposer.kv_cache.layers[0][0] is hybrid.runner.kv_cache.pool[0][0]  # pooled
    prompts = _prompts([5, 30, 12], seed=4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    pairs = [(hybrid.add_request(p, params), unified.add_request(p, params)) for p in prompts]
    num_checked = 0
    while hybrid.has_unfinished:
        hybrid.step()
        unified.step()
        for h, u in pairs:
            if h.is_finished or not h.block_table or h.num_computed < h.num_tokens - 1:
                continue  # done, waiting, or its prompt not computed yet
            assert (h.num_computed, h.output_token_ids) == (u.num_computed, u.output_token_ids)
            end = h.num_final_positions
            positions = range(max(0, h.num_computed - layout.sliding_window + 1), end)
            if not positions:
                continue
            slots_h = torch.from_numpy(hybrid.proposer.slots(h, positions[0], len(positions)))
            slots_u = torch.from_numpy(unified.proposer.slots(u, positions[0], len(positions)))
            assert not (slots_h == hybrid.proposer.kv_cache.scratch_slot).any()
            for (kh, vh), (ku, vu) in zip(hybrid.proposer.kv_cache.layers, unified.proposer.kv_cache.layers):
                assert torch.equal(kh[slots_h], ku[slots_u]) and torch.equal(vh[slots_h], vu[slots_u])
            num_checked += 1
    assert num_checked > 20


def test_startup_logs_the_kv_cache_size_and_concurrency_as_vllm(pair, caplog):
    """vLLM's start-up lines, "KV cache size: N tokens" and "maximum concurrency for L tokens per
    request: Cx": the hybrid layout holds more tokens of context in the same memory than the
    unified one, less one request's sliding-window blocks; C is the blocks over what one
    max_model_len request may hold."""
    target, draft = pair
    options = dict(draft=draft, num_speculative_tokens=3, block_size=4, max_model_len=64, num_kv_blocks=40,
                   max_num_batched_tokens=16)
    with caplog.at_level("INFO", logger="laguna_dflash.engine.engine"):
        hybrid, unified = LLM(target, **options).engine, LLM(target, **options, **UNIFIED).engine
    assert unified.kv_cache_size_tokens == 40 * 4 and unified.max_concurrency == 40 / 17  # 64 + 3 + 1 positions
    # 120 blocks (the drafter in the pool: 3x); 2 sliding groups keep window 8 + 16 + 4 positions
    assert hybrid.allocator.num_blocks == 120 and hybrid.max_blocks_per_seq == 17 + 2 * (7 + 1)
    assert hybrid.kv_cache_size_tokens == (120 - 16) * 4 and hybrid.max_concurrency == 120 / 33
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache size")]
    assert lines == ["KV cache size: 416 tokens; maximum concurrency for 64 tokens per request: 3.64x",
                     "KV cache size: 160 tokens; maximum concurrency for 64 tokens per request: 2.35x"]
