"""CPU unit tests: block allocator, scheduler, sampler filters, acceptance, metadata masks."""

from __future__ import annotations

import gc
from dataclasses import replace

import pytest
import torch

from laguna_dflash.config import EngineConfig, SamplingParams, SpeculativeConfig
from laguna_dflash.engine.attention import AttentionMetadata
from laguna_dflash.engine.kv_cache import BlockAllocator, KVCache
from laguna_dflash.engine.runner import ForwardItem, build_metadata
from laguna_dflash.engine.sampler import (
    filtered_probs,
    filtered_probs_rows,
    filtered_scores,
    sample_rows,
    top_logprobs,
)
from laguna_dflash.engine.scheduler import Scheduler
from laguna_dflash.engine.sequence import Sequence, Status
from laguna_dflash.engine.spec_decode import SpecDecodingStats, num_accepted


def test_allocator_allocates_frees_and_counts():
    a = BlockAllocator(4, 8)
    assert a.blocks_needed(17, 0) == 3 and a.blocks_needed(16, 2) == 0
    got = a.allocate(3)
    assert len(set(got)) == 3 and a.num_free_blocks == 1
    assert not a.can_allocate(2)
    a.free(got)
    assert a.num_free_blocks == 4


def test_scheduler_preempts_newest_when_blocks_run_out():
    alloc = BlockAllocator(4, 4)
    sched = Scheduler(alloc, max_num_seqs=8, max_num_batched_tokens=64)
    p = SamplingParams(max_tokens=100)
    s1, s2 = Sequence(0, [1] * 6, p), Sequence(1, [1] * 6, p)
    sched.add(s1)
    sched.add(s2)
    batch = sched.schedule()
    assert batch.is_prefill and batch.sequences == [s1, s2]  # 2 blocks each (7 positions)
    for s in (s1, s2):
        s.num_computed = 6
        s.output_token_ids += [1, 1, 1]  # 9 tokens: decode needs positions 0..8 -> 3 blocks
    batch = sched.schedule()
    assert not batch.is_prefill and batch.sequences == [s1]
    assert s2.status == Status.WAITING and s2.block_table == [] and s2.num_preemptions == 1
    assert alloc.num_free_blocks == 1


@pytest.mark.parametrize("how", ["finish", "abort", "preempt"])
def test_a_released_request_drops_its_pending_taps(how):
    """Pending taps reference a step's whole taps tensor; a finished or aborted request (kept by
    its caller) must not hold it, and a preempted one recomputes its taps."""
    sched = Scheduler(BlockAllocator(4, 4), max_num_seqs=8, max_num_batched_tokens=64)
    seq = Sequence(0, [1] * 6, SamplingParams(max_tokens=10))
    sched.add(seq)
    sched.schedule()
    seq.add_pending_taps(torch.zeros(3, 8), 0, 2, 6)
    {"finish": sched.finish, "abort": sched.abort, "preempt": sched._preempt}[how](seq)
    assert seq.pending_taps == [] and seq.num_pending == 0 and seq.block_table == []


def test_top_k_top_p_filtering():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = filtered_probs(logits, 1.0, top_k=2, top_p=1.0)
    assert (p[0, 2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    full = torch.softmax(logits, -1)[0]
    p = filtered_probs(logits, 1.0, top_k=0, top_p=float(full[0]) + 1e-3)
    assert (p[0, :2] > 0).all() and (p[0, 2:] == 0).all()  # the token crossing top_p is kept


def test_min_p_keeps_tokens_within_its_ratio_of_the_most_likely():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    full = torch.softmax(logits / 2.0, -1)[0]
    ratio = float(full[2] / full[0])  # the third token's probability over the first's
    p = filtered_probs(logits, 2.0, top_k=0, top_p=1.0, min_p=ratio - 1e-4)
    assert (p[0, :3] > 0).all() and (p[0, 3:] == 0).all()
    torch.testing.assert_close(p[0, :3], full[:3] / full[:3].sum())
    p = filtered_probs(logits, 2.0, top_k=0, top_p=1.0, min_p=ratio + 1e-4)
    assert (p[0, 2:] == 0).all()
    with pytest.raises(ValueError, match="min_p must be in"):
        SamplingParams(min_p=1.5)


def test_seeded_sampling_is_reproducible_and_greedy_is_argmax():
    logits = torch.randn(4, 50)
    sp = SamplingParams(temperature=0.8, seed=1)
    a = sample_rows(logits, [sp] * 4, [0, 1, 2, 3])
    assert torch.equal(a, sample_rows(logits, [sp] * 4, [0, 1, 2, 3]))
    # a row's noise is its (seed, position)'s: one request at position 2 alone, and a verify of
    # four rows from position 0 (rows at positions 0..3), pick what the four decodes picked
    assert torch.equal(sample_rows(logits[2:3], [sp], [2]), a[2:3])
    assert torch.equal(sample_rows(logits, [sp], [0], 4), a)
    with pytest.raises(ValueError, match="positions"):
        sample_rows(logits, [sp] * 4)
    greedy = sample_rows(logits, [SamplingParams(temperature=0)] * 4)
    assert torch.equal(greedy, logits.argmax(-1))


def test_a_zero_noise_draw_never_picks_a_filtered_token(monkeypatch):
    """Every exponential draw 0 (a device RNG may return it): top-k's survivors still win; the
    filtered tokens' 0 / 0 must not become NaNs that the argmax ranks first. Nor may a -inf
    logit (a stop token under min_tokens) in a row without a filter: -inf - log 0."""
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(5))
    logits[3, 0] = float("-inf")
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, *a, **kw: self.zero_())
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=0.5, top_p=0.3),
              SamplingParams(temperature=1.0, min_p=0.5), SamplingParams(temperature=1.0)]
    picks = sample_rows(logits, params)  # unseeded: the engine's generator, zeroed here
    for row, p, pick in zip(logits, params, picks.tolist()):
        kept = filtered_probs(row[None], p.temperature, p.top_k, p.top_p, p.min_p)[0] > 0
        assert kept[pick], (p, pick)


def test_sampling_bf16_logits_equals_sampling_them_widened():
    # the engine hands the lm_head's bf16 logits to sample_rows (no float32 copy): greedy rows,
    # ties included, and seeded sampled rows must pick what the float32 logits would
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3)).bfloat16()
    logits[0, [10, 200]] = 9.0  # a tie: the first index wins either way
    params = [SamplingParams(temperature=0)] * 3 + [
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=11 + i) for i in range(3)]
    picks = [sample_rows(x, params, [0, 0, 0, 5, 6, 7]) for x in (logits, logits.float())]
    assert torch.equal(picks[0], picks[1])
    assert picks[0][0] == 10


def test_num_accepted_is_longest_matching_prefix():
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 2, 3], [4, 4, 4]])
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [0, 2, 3, 4], [4, 4, 4, 4]])
    assert num_accepted(drafts, target).tolist() == [3, 1, 0, 3]


def test_spec_stats_meaning():
    st = SpecDecodingStats(3)
    for a in (3, 1, 0):
        st.observe(a)
    assert st.num_drafts == 3 and st.num_draft_tokens == 9 and st.num_accepted_tokens == 4
    assert st.num_accepted_tokens_per_pos == [2, 1, 1]
    assert st.mean_acceptance_length == pytest.approx(1 + 4 / 3)


def test_metadata_masks_sliding_window_includes_current_token():
    items = [ForwardItem(5, 0, 5, [0, 1]), ForwardItem(1, 7, 8, [2, 3])]
    meta: AttentionMetadata = build_metadata(items, 4, 16, torch.device("cpu"))
    m = meta.mask(3)[:, 0]
    # request 0, query at position 4 sees keys 2, 3, 4 (window 3 incl. itself)
    assert m[0, 4, :5].tolist() == [False, False, True, True, True]
    # request 1, one query at position 7 sees 5, 6, 7 and nothing past its length
    assert m[1, 0, :8].tolist() == [False] * 5 + [True] * 3
    full = meta.mask(None)[:, 0]
    assert full[1, 0, :8].all() and not full[0, 2, 3]
    assert meta.slot_mapping.tolist() == [0, 1, 2, 3, 4, 15]  # pos 7 -> block 3 offset 3
    bidir = build_metadata(items, 4, 16, torch.device("cpu"), is_causal=False).mask(None)[:, 0]
    assert bidir[0, 0, :5].all()


@pytest.mark.parametrize("lmax", [1, 13, 16, 17, 40])
def test_metadata_key_slots_rows_are_16_aligned(lmax):
    """key_slots is [R, Lmax] whatever its row stride, which is Lmax rounded up to a multiple of
    16 (Triton specialises strides on divisibility by 16: one eager kernel variant, not two by
    Lmax % 16); its values are each key position's slot, the scratch slot past a sequence."""
    bs, scratch = 4, 400
    items = [ForwardItem(1, lmax - 1, lmax, list(range(10, 10 + -(-lmax // bs)))),
             ForwardItem(1, 0, 1, [3])]
    meta = build_metadata(items, bs, scratch, torch.device("cpu"))
    assert meta.key_slots.shape == (2, lmax)
    assert meta.key_slots.stride(0) % 16 == 0 and meta.key_slots.stride(0) < lmax + 16
    want = [(10 + j // bs) * bs + j % bs for j in range(lmax)]
    assert meta.key_slots[0].tolist() == want
    assert meta.key_slots[1].tolist() == [12] + [scratch] * (lmax - 1)


@pytest.mark.parametrize("field,value,needle", [
    ("temperature", -1.0, "temperature"), ("top_p", 0.0, "top_p"), ("top_k", -2, "top_k"),
    ("max_tokens", 0, "max_tokens"), ("logprobs", -1, "logprobs"),
])
def test_sampling_params_errors_name_the_field(field, value, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**{field: value})


def test_config_errors():
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(model="x", dtype="int8")
    with pytest.raises(ValueError, match="device"):
        EngineConfig(model="x", device="tpu")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(draft="d", num_speculative_tokens=0)


def test_kv_cache_budget_from_mem_fraction_static():
    """Default: 80% of the memory free after load. With a fraction f: f x total less what is in
    use (weights and the rest), an error naming the flag once f is used up."""
    from laguna_dflash.engine.memory_profile import kv_cache_budget_bytes

    gib = 2**30
    assert kv_cache_budget_bytes(70 * gib, 140 * gib, None) == 56 * gib
    assert kv_cache_budget_bytes(70 * gib, 140 * gib, 0.9) == 56 * gib  # 126 - 70 in use
    assert kv_cache_budget_bytes(70 * gib, 140 * gib, 1.0) == 70 * gib
    with pytest.raises(ValueError, match=r"--mem-fraction-static.*raise it above 0\.50"):
        kv_cache_budget_bytes(70 * gib, 140 * gib, 0.5)


def test_kv_cache_budget_from_gpu_memory_utilization():
    """vLLM's fraction holds the weights (in use), the profiled activations and the cache:
    the activations come out of the cache's share; the error names the flag and what to lower."""
    from laguna_dflash.engine.memory_profile import kv_cache_budget_bytes

    gib = 2**30
    assert kv_cache_budget_bytes(70 * gib, 140 * gib, 0.9, 6 * gib, "gpu_memory_utilization") == 50 * gib
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization.*activations take 6\.0 GiB.*"
                                         r"raise it above 0\.54.*--max-num-batched-tokens"):
        kv_cache_budget_bytes(70 * gib, 140 * gib, 0.5, 6 * gib, "gpu_memory_utilization")


def test_profile_items_cover_the_prefill_budget_in_requests_the_scheduler_could_form():
    """The profile's prefill: the whole token budget, in requests of at most max_model_len - 1
    prompt tokens (one output token left), each from position 0 over its own blocks."""
    from laguna_dflash.engine.memory_profile import profile_items

    items = profile_items(8192, 3000, 16)
    assert [it.num_tokens for it in items] == [2999, 2999, 2194]
    assert all(it.start_pos == 0 and it.seq_len == it.num_tokens for it in items)
    assert all(len(it.block_table) == -(-it.num_tokens // 16) for it in items)
    blocks = [b for it in items for b in it.block_table]
    assert blocks == list(range(len(blocks)))  # no block shared
    assert [it.num_tokens for it in profile_items(100, 8192, 16)] == [100]


def test_profile_run_out_of_memory_names_the_flags(tmp_path, monkeypatch):
    """A profile run that does not fit is a start-up error naming what to lower, not a bare
    CUDA out-of-memory (the CUDA calls are stood in for on the CPU; the forward raises)."""
    import hf_fixtures as hf

    from laguna_dflash import LLM
    from laguna_dflash.engine import memory_profile

    engine = LLM(model=str(hf.make_laguna_checkpoint(tmp_path / "t", "xs_mini", seed=0)),
                 max_model_len=64).engine
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 0)

    import weakref
    caches = []

    def out_of_memory(target, drafter, runner, draft_cache, *a):
        caches.append(weakref.ref(runner.kv_cache))
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(memory_profile, "run_profile_forward", out_of_memory)
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization.*8192 tokens "
                                         r"\(--max-num-batched-tokens\).*--max-num-seqs") as err:
        memory_profile.activation_peak_bytes(engine.target, None, engine.backend, engine.device,
                                             engine.dtype, 8192, 64, 16, 64, 1)
    # the throwaway KV cache is freed while the caller still holds the error (and its frames)
    assert len(caches) == 1 and caches[0]() is None
    assert "CUDA out of memory" in str(err.value)


@pytest.mark.parametrize("with_drafter", [False, True], ids=["target-only", "dflash"])
def test_profile_forward_runs_the_budget_and_the_largest_sampling_step(tmp_path, monkeypatch,
                                                                       with_drafter):
    """The profile's work, on the CPU (its measurement is CUDA's): one forward of the whole
    token budget over the throwaway caches, with the drafter's context stored into its cache,
    then the sampler over max_num_seqs x (K + 1) rows with a top-k and top-p."""
    import hf_fixtures as hf

    from laguna_dflash import LLM
    from laguna_dflash.engine import memory_profile
    from laguna_dflash.models.random_init import write_random_pair

    if with_drafter:
        target, draft = write_random_pair(tmp_path, seed=0)
        llm = LLM(str(target), draft=str(draft), max_model_len=64, max_num_seqs=3,
                  max_num_batched_tokens=150)
    else:
        ckpt = hf.make_laguna_checkpoint(tmp_path / "t", "xs_mini", seed=0)
        llm = LLM(model=str(ckpt), max_model_len=64, max_num_seqs=3, max_num_batched_tokens=150)
    engine = llm.engine
    k = engine.num_speculative_tokens
    seen = {}
    real_sample_rows = memory_profile.sample_rows

    def spy(logits, params, positions=None, rows_per_request=1, **kw):
        seen["rows"], seen["params"] = logits.shape[0], params[0]
        return real_sample_rows(logits, params, positions, rows_per_request, **kw)

    monkeypatch.setattr(memory_profile, "sample_rows", spy)
    items = memory_profile.profile_items(engine.prefill_token_budget, engine.max_model_len, 16)
    assert sum(it.num_tokens for it in items) == 150
    num_blocks = sum(len(it.block_table) for it in items)
    spec = engine.target.spec
    cache = memory_profile.KVCache(spec.num_layers, num_blocks, 16, engine.target.num_local_kv_heads,
                                   spec.head_dim, engine.dtype, engine.device)
    d = engine.drafter
    draft_cache = (memory_profile.KVCache(d.num_cache_layers, num_blocks, 16, d.num_kv_heads,
                                          d.head_dim, engine.dtype, engine.device) if d else None)
    runner = memory_profile.ModelRunner(engine.target, cache, engine.backend, engine.device)
    assert runner.context_store is None  # the taps come back and are stored as a prefill does
    memory_profile.run_profile_forward(engine.target, d, runner, draft_cache, items, 3, k + 1)
    assert seen["rows"] == 3 * (k + 1)
    assert seen["params"].top_k > 0 and seen["params"].top_p < 1 and seen["params"].temperature > 0
    written = cache.layers[0][0][: num_blocks * 16].abs().sum(dim=(1, 2)) > 0
    assert written.sum() == 150  # every prompt token's K, nothing else
    if with_drafter:
        assert (draft_cache.layers[0][0][: num_blocks * 16].abs().sum(dim=(1, 2)) > 0).sum() == 150
    else:
        assert k == 0


def test_mem_fraction_static_that_cannot_hold_one_sequence_names_the_flag(tmp_path, monkeypatch):
    """A fraction whose KV budget is short of one max_model_len sequence fails at start-up with
    the flag named (here on the CPU, its fixed budget shrunk below one sequence); without the
    flag the engine keeps its one-sequence floor."""
    import hf_fixtures as hf

    from laguna_dflash import LLM
    from laguna_dflash.engine import engine as engine_module

    ckpt = hf.make_laguna_checkpoint(tmp_path / "t", "xs_mini", seed=0)
    monkeypatch.setattr(engine_module, "_CPU_KV_BUDGET_BYTES", 1)
    floor = -(-(64 + 1) // 16)  # blocks of one max_model_len sequence (positions 0..64)
    unified = dict(disable_hybrid_kv_cache_manager=True)  # (a hybrid layout's floor has SWA blocks too)
    assert LLM(model=str(ckpt), max_model_len=64, **unified).engine.allocator.num_blocks == floor
    with pytest.raises(ValueError, match="--mem-fraction-static.*--max-model-len"):
        LLM(model=str(ckpt), max_model_len=64, mem_fraction_static=0.9)
    with pytest.raises(ValueError, match="--mem-fraction-static"):
        EngineConfig(model="x", mem_fraction_static=0.0)


@pytest.mark.exclusive_gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mem_fraction_static_sizes_the_kv_cache_on_cuda(tmp_path):
    """On a GPU the KV cache of ``mem_fraction_static=f`` takes f x total less what is in use
    once the weights are loaded: with f set 2 GiB above what is in use before the engine (its
    weights are a few MiB), the cache holds 1.5-2 GiB (more: the fraction was not applied; less:
    in use counted twice). Other processes on the GPU move this by what they allocate meanwhile."""
    import hf_fixtures as hf

    from laguna_dflash import LLM

    gib = 2**30
    ckpt = hf.make_laguna_checkpoint(tmp_path / "t", "xs_mini", seed=0)
    torch.cuda.init()
    gc.collect()  # earlier tests' cached blocks: released by the engine before it sizes the cache
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    fraction = (total - free + 2 * gib) / total
    llm = LLM(model=str(ckpt), device="cuda", max_model_len=64, max_num_seqs=10**6,
              mem_fraction_static=fraction, enforce_eager=True)
    num_bytes = KVCache.num_bytes(llm.engine.runner.kv_cache)  # a hybrid layout's pool counted once
    assert 1.5 * gib < num_bytes <= 2 * gib, num_bytes / gib


@pytest.mark.exclusive_gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_memory_utilization_profiles_activations_and_sizes_the_kv_cache_on_cuda(tmp_path):
    """On a GPU, ``gpu_memory_utilization=u``: the profile measures the activations of a
    prefill of the whole token budget and of sampling the largest verify batch, and the cache
    takes u x total less what is in use and that peak (here u is set 2 GiB above what is in use
    before the engine: a cache of 2 GiB less the peak, give or take what other processes
    allocate meanwhile). Serving that largest prefill afterwards allocates not much more than the
    profile measured (a profile that missed work would under-count), nor far less (one that
    measured something else)."""
    from laguna_dflash import LLM
    from laguna_dflash.models.random_init import write_random_pair

    gib = 2**30
    target, draft = write_random_pair(tmp_path / "pair", seed=0)
    options = dict(model=str(target), draft=str(draft), device="cuda", dtype="bfloat16",
                   max_model_len=2048, max_num_batched_tokens=2048, enforce_eager=True)
    torch.cuda.init()
    gc.collect()  # what earlier tests of this process left in torch's cache is not in use: the
    torch.cuda.empty_cache()  # engine empties the cache before it sizes the KV cache
    free, total = torch.cuda.mem_get_info()
    util = (total - free + 2 * gib) / total
    # 4096 sequences of 2048 tokens want ~6 GiB of this pair's cache: the budget decides
    engine = LLM(**options, max_num_seqs=4096, gpu_memory_utilization=util).engine
    peak = engine.profiled_activation_bytes
    assert peak > 0
    num_bytes = KVCache.num_bytes(engine.runner.kv_cache, engine.proposer.kv_cache)  # the pool once
    assert 2 * gib - peak - 0.5 * gib < num_bytes <= 2 * gib - peak, (num_bytes / gib, peak / gib)
    del engine
    torch.cuda.empty_cache()
    # few sequences: the prefill forward dominates the profile, and the real one is measured
    llm = LLM(**options, max_num_seqs=4, gpu_memory_utilization=util)
    peak = llm.engine.profiled_activation_bytes
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate(prompt_token_ids=[[1] * 1000, [2] * 1000, [3] * 48], sampling_params=params)
    used = torch.cuda.max_memory_allocated() - before
    assert 0.5 * peak <= used <= 1.1 * peak, (used / 2**20, peak / 2**20)


def test_moe_gather_path_equals_grouped_loop():
    from laguna_dflash.models.layers import MoE

    torch.manual_seed(0)
    moe = MoE(16, 6, 2, 8, 8, routed_scaling_factor=2.5)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(5, 16)
    weights, ids = moe.route(x)
    torch.testing.assert_close(moe.experts_forward_gather(x, weights, ids),
                               moe.experts_forward(x, weights, ids), rtol=1e-5, atol=1e-6)


def test_dummy_load_format_needs_only_config(tmp_path):
    """load_format='dummy': real shapes from config.json, random weights, no safetensors."""
    from laguna_dflash import LLM
    from laguna_dflash.models.random_init import write_random_pair

    target, draft = write_random_pair(tmp_path, seed=0)
    (target / "model.safetensors").unlink()
    (draft / "model.safetensors").unlink()
    llm = LLM(str(target), draft=str(draft), load_format="dummy")
    out = llm.generate(prompt_token_ids=[[1, 2, 3]],
                       sampling_params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out[0].token_ids) == 6
    moe = llm.engine.target.layers[1].mlp
    assert moe.experts_gate_up.std() > 0  # really initialised, not left empty
    with pytest.raises(ValueError, match="load_format"):
        EngineConfig(model="x", load_format="pt")


def test_adaptive_k_policy_picks_what_pays():
    from laguna_dflash.engine.adaptive_k import AdaptiveK

    pol = AdaptiveK(max_k=4, explore_every=1000)
    assert pol.choose(1) == 4  # measure the full draft first
    pol.observe(4, 1, [0], seconds=3.0)
    assert pol.choose(1) == 0  # then plain decode once
    pol.observe(0, 1, [], seconds=1.0)
    for _ in range(50):  # drafts never accepted: speculation costs 3x for nothing
        pol.observe(4, 1, [0], seconds=3.0)
    assert pol.choose(1) == 0
    good = AdaptiveK(max_k=4, explore_every=1000)
    good.observe(4, 1, [4], seconds=2.0)
    good.observe(0, 1, [], seconds=1.0)
    for _ in range(50):  # everything accepted: 5 tokens for 2x the cost
        good.observe(4, 1, [4, 4], seconds=2.0)
    assert good.choose(1) == 4
    assert good.choose(64) == 4  # a new batch-size bucket is measured first


def _run_policy(pol, steps: int, accepted_of_k, seconds_of_k, intervals: list | None = None) -> list[int]:
    chosen = []
    for _ in range(steps):
        k = pol.choose(1)
        chosen.append(k)
        pol.observe(k, 1, [accepted_of_k(k)] if k else [], seconds=seconds_of_k(k))
        if intervals is not None:
            intervals.append(pol.explore_interval)
    return chosen


def _xs_cost(k: int) -> float:
    """Step time in decode steps, the shape measured at XS-2.1 size on an H200 (batch 1): a
    full-K step (K = 15) ~3.5x a decode step."""
    return 1.0 + 0.17 * k


def test_adaptive_k_exploration_backs_off_while_drafting_does_not_pay():
    from laguna_dflash.engine.adaptive_k import AdaptiveK

    useless = AdaptiveK(max_k=15, explore_every=16, max_explore_every=256)
    chosen = _run_policy(useless, 2000, lambda k: 0, _xs_cost)
    fixed = AdaptiveK(max_k=15, explore_every=16, max_explore_every=16)  # no backoff
    _run_policy(fixed, 2000, lambda k: 0, _xs_cost)
    # without backoff every 16th step explores; with it the interval grows 32, 64, 128, 256
    assert fixed.num_explorations == 2000 // 16
    assert useless.num_explorations <= 12, useless.num_explorations
    assert useless.explore_interval == 256
    assert 15 not in chosen[1:] and chosen[-1000:].count(1) <= 4
    assert chosen[-100:].count(0) >= 99
    # the drafter starts to pay: the next exploration sees it, the interval resets, drafting
    # resumes and climbs level by level to the full block
    intervals = []
    chosen = _run_policy(useless, 600, lambda k: k, _xs_cost, intervals)
    assert intervals[0] == 256 and 16 in intervals
    assert chosen[-50:] == [15] * 50


def test_adaptive_k_exploration_backs_off_while_the_best_k_stays():
    from laguna_dflash.engine.adaptive_k import AdaptiveK

    def cost(k):
        return 1.0 + 0.1 * k

    pol = AdaptiveK(max_k=7, explore_every=16, max_explore_every=256)
    chosen = _run_policy(pol, 2000, lambda k: min(k, 3), cost)  # drafts pay up to 3 tokens
    assert chosen[-100:].count(3) >= 99
    assert pol.explore_interval == 256 and pol.num_explorations <= 12, pol.num_explorations
    # longer drafts start to be accepted: the next exploration sees it, the best K changes, the
    # interval resets and the policy moves to the full block
    intervals = []
    chosen = _run_policy(pol, 600, lambda k: k, cost, intervals)
    assert intervals[0] == 256 and 16 in intervals
    assert chosen[-50:].count(7) == 50
    assert pol.explore_interval > 16  # and backs off again once the new choice holds
    # without backoff the same traffic explores every 16th step
    fixed = AdaptiveK(max_k=7, explore_every=16, max_explore_every=16)
    _run_policy(fixed, 2000, lambda k: min(k, 3), cost)
    assert fixed.num_explorations == 2000 // 16


def test_adaptive_k_never_accepted_stops_drafting_at_once_and_explores_at_k1():
    """Bias correction: the first full-K step's observation replaces the optimistic prior, so
    after it and the K = 0 measurement the policy decodes plainly, and it explores K = 1 (about
    1.2x a decode step), never the full block (3.5x) again."""
    from laguna_dflash.engine.adaptive_k import AdaptiveK

    pol = AdaptiveK(max_k=15, explore_every=16, max_explore_every=256)
    chosen = _run_policy(pol, 1000, lambda k: 0, _xs_cost)
    assert chosen[:2] == [15, 0]
    assert chosen[2:15] == [0] * 13  # before the first exploration (step 16)
    explored = [k for k in chosen[2:] if k]
    assert explored == [1] * pol.num_explorations and 5 <= len(explored) <= 8, explored


@pytest.mark.parametrize("accepted", [0, 3])
def test_adaptive_k_expects_target_only_predicts_the_next_choice(accepted):
    """``expects_target_only`` (asked during a K = 0 step, before its ``observe``, as the
    engine does to queue the next forward ahead) is never True before a drafting step, and is
    True for most K = 0 steps that follow one; it changes no state. With drafts accepted (best
    K = 3) it stays False."""
    from laguna_dflash.engine.adaptive_k import AdaptiveK

    pol = AdaptiveK(max_k=15, explore_every=16, max_explore_every=256)
    predicted, chosen = [], []
    for _ in range(1000):
        k = pol.choose(1)
        chosen.append(k)
        if k == 0:
            state = (pol.num_steps, pol.steps_since_explore, pol.explore_interval, dict(pol._best))
            predicted.append(pol.expects_target_only(1))
            assert state == (pol.num_steps, pol.steps_since_explore, pol.explore_interval, dict(pol._best))
        else:
            predicted.append(False)
        pol.observe(k, 1, [min(k, accepted)] if k else [], seconds=_xs_cost(k))
    followed = [(p, chosen[i + 1]) for i, p in enumerate(predicted[:-1]) if chosen[i] == 0]
    assert all(nxt == 0 for p, nxt in followed if p)  # a True is never followed by drafting
    if accepted == 0:
        zero_zero = [p for p, nxt in followed if nxt == 0]
        assert sum(zero_zero) >= 0.95 * len(zero_zero), (sum(zero_zero), len(zero_zero))
    else:
        assert not any(predicted[20:])


def test_adaptive_k_explores_one_level_up_and_settles_on_the_best_k():
    """Acceptance up to 3 tokens: K = 3 from the third step on, explorations at 2 * 3 + 1 = 7."""
    from laguna_dflash.engine.adaptive_k import AdaptiveK

    pol = AdaptiveK(max_k=15, explore_every=16, max_explore_every=256)
    chosen = _run_policy(pol, 2000, lambda k: min(k, 3), _xs_cost)
    assert chosen[:2] == [15, 0]
    assert set(chosen[2:]) == {3, 7}
    assert chosen.count(7) == pol.num_explorations <= 12, pol.num_explorations
    assert chosen[-100:].count(3) >= 99


def test_adaptive_k_climbs_level_by_level_when_long_drafts_start_to_pay():
    """Settled at K = 3 with the interval backed off to 256, the traffic changes to every draft
    accepted: the next exploration (K = 7, within 256 steps) moves the choice to 7 and resets
    the interval, so the one after (K = 15, 16 steps later) reaches the full block."""
    import itertools

    from laguna_dflash.engine.adaptive_k import AdaptiveK

    pol = AdaptiveK(max_k=15, explore_every=16, max_explore_every=256)
    _run_policy(pol, 2000, lambda k: min(k, 3), _xs_cost)
    assert pol.explore_interval == 256
    chosen = _run_policy(pol, 400, lambda k: k, _xs_cost)
    assert [k for k, _ in itertools.groupby(chosen)] == [3, 7, 15], chosen
    assert chosen.index(15) <= 256 + 16 + 1, chosen.index(15)


def _simulated_time(policy, k_fixed: int, num_tokens: int, accepted_of_k) -> float:
    """Batch-1 decode time (in decode steps, ``_xs_cost``) to emit ``num_tokens`` tokens with
    the adaptive ``policy``, or with ``k_fixed`` drafts per step when ``policy`` is None."""
    total, tokens = 0.0, 0
    while tokens < num_tokens:
        k = policy.choose(1) if policy is not None else k_fixed
        accepted = accepted_of_k(k)
        total += _xs_cost(k)
        tokens += 1 + accepted
        if policy is not None:
            policy.observe(k, 1, [accepted] if k else [], _xs_cost(k))
    return total


@pytest.mark.parametrize("length, best_fixed", [(1, 0), (4, 3)], ids=["L1", "L4"])
def test_adaptive_k_simulated_time_is_close_to_the_best_fixed_k(length, best_fixed):
    """1024 tokens at simulated acceptance length L (min(K, L - 1) drafts accepted): the
    adaptive policy's time is within 3% of the best fixed K's. This computes 1027.7 vs 1024.0
    decode steps (1.004x) at L=1 and 392.3 vs 386.6 (1.015x, K = 3) at L=4; the policy before
    bias correction and one-level-up exploration took 1082.7 (1.057x) and 412.0 (1.066x)."""
    from laguna_dflash.engine.adaptive_k import AdaptiveK

    def accepted_of_k(k):
        return min(k, length - 1)

    fixed = {k: _simulated_time(None, k, 1024, accepted_of_k) for k in range(16)}
    assert min(fixed, key=fixed.get) == best_fixed
    adaptive = _simulated_time(AdaptiveK(15), 0, 1024, accepted_of_k)
    assert adaptive <= 1.03 * fixed[best_fixed], adaptive / fixed[best_fixed]


def test_adaptive_k_draft_levels():
    from laguna_dflash.engine.adaptive_k import draft_levels

    assert draft_levels(15) == (0, 1, 3, 7, 15)
    assert draft_levels(5) == (0, 1, 3, 5)
    assert draft_levels(1) == (0, 1)
    assert draft_levels(8) == (0, 1, 3, 7, 8)


@pytest.mark.parametrize("length", [3, 6, 7, 12])
def test_adaptive_k_chooses_only_its_levels(length):
    """Acceptance up to L - 1 drafts with a cheap verify, so the best fixed K is L - 1 (2, 5, 6,
    11: none a level): the policy settles on a level next to it and never chooses another K,
    because each K is a CUDA-graph shape the start-up capture must hold."""
    from laguna_dflash.engine.adaptive_k import AdaptiveK

    pol = AdaptiveK(max_k=15, explore_every=16, max_explore_every=256)
    chosen = _run_policy(pol, 1500, lambda k: min(k, length - 1), lambda k: 1.0 + 0.05 * k)
    assert set(chosen) <= set(pol.levels), sorted(set(chosen))
    settled = max(set(chosen[-100:]), key=chosen[-100:].count)
    below = max(x for x in pol.levels if x <= length - 1)
    above = min(x for x in pol.levels if x >= length - 1)
    assert settled in (below, above), (settled, below, above)


def test_adaptive_k_a_slow_first_step_at_a_new_k_does_not_lock_it_out():
    """The first step at a new K captures a CUDA graph (several times a replayed step); taken at
    face value it made K = 3 look 14x slower and the policy never ran it again."""
    from laguna_dflash.engine.adaptive_k import AdaptiveK

    captured = set()

    def cost(k):
        first = k not in captured
        captured.add(k)
        return _xs_cost(k) + (20.0 if first else 0.0)

    pol = AdaptiveK(max_k=15)
    chosen = _run_policy(pol, 500, lambda k: min(k, 3), cost)
    assert 0 in chosen[2:6]  # the K = 0 time a K = 3 step undercut is measured again
    assert chosen[-100:].count(3) >= 99
    assert pol.step_time[(0, 1)] == 1.0 and pol.step_time[(3, 1)] == pytest.approx(1.51)
    # the acceptance drops: with K = 0 measured at 20x it would keep drafting on a tie
    chosen = _run_policy(pol, 300, lambda k: 0, cost)
    assert chosen[-100:].count(0) >= 98


def test_adaptive_k_one_slow_step_does_not_move_a_settled_choice():
    from laguna_dflash.engine.adaptive_k import AdaptiveK

    pol = AdaptiveK(max_k=15)
    _run_policy(pol, 500, lambda k: min(k, 3), _xs_cost)
    assert pol.choose(1) == 3
    pol.observe(3, 1, [3], seconds=30 * _xs_cost(3))  # e.g. a capture at a new key length
    assert pol.step_time[(3, 1)] == pytest.approx(1.1 * _xs_cost(3))
    assert _run_policy(pol, 20, lambda k: min(k, 3), _xs_cost) == [3] * 20


def test_adaptive_k_rates_past_recent_drafts_are_capped_by_earlier_positions():
    """A rate last observed long ago (here: the first full-K step, every draft accepted) cannot
    exceed the fresher rates before it: accepting draft 6 needs drafts 1..5 accepted."""
    from laguna_dflash.engine.adaptive_k import AdaptiveK

    pol = AdaptiveK(max_k=15, explore_every=1000)
    pol.observe(15, 1, [15], seconds=_xs_cost(15))
    pol.observe(0, 1, [], seconds=_xs_cost(0))
    for _ in range(60):  # since then only the first draft is accepted
        pol.observe(3, 1, [1], seconds=_xs_cost(3))
    assert pol.rates[5] == 1.0  # stale: not drafted since
    assert pol.expected_tokens(15) == pytest.approx(2.0, abs=0.01)  # not 1 + 1 + 12 stale 1.0s
    assert pol.choose(1) == 1


def test_failed_step_names_its_requests(tmp_path, monkeypatch):
    from laguna_dflash import LLM
    from laguna_dflash.engine.engine import StepError
    from laguna_dflash.models.random_init import write_random_pair

    target, _ = write_random_pair(tmp_path, seed=0)
    engine = LLM(str(target)).engine
    seqs = [engine.add_request([1, 2, 3], SamplingParams(max_tokens=4)) for _ in range(2)]

    def boom(*args, **kwargs):
        raise FloatingPointError("injected")

    monkeypatch.setattr(engine.runner, "forward", boom)
    with pytest.raises(StepError, match="injected") as info:
        engine.step()
    assert info.value.sequences == seqs


def test_moe_takes_the_triton_kernels_at_every_size_on_a_gpu(monkeypatch):
    """The MoE path choice on a GPU (faked here): the Triton kernels at every pair count (the
    sorted ones past ``fused_moe_max_pairs``), whether or not the grouped GEMM runs; with the
    A/B switch ``grouped_mm_min_pairs`` set, the grouped GEMM from that many pairs where it runs,
    else still the Triton kernels (the loop syncs with the host, which a CUDA-graph capture
    refuses)."""
    from laguna_dflash.kernels import fused_moe
    from laguna_dflash.models import layers
    from laguna_dflash.models.laguna import LagunaForCausalLM
    from laguna_dflash.models.random_init import tiny_laguna_config

    model = LagunaForCausalLM.from_config(tiny_laguna_config())
    moe = next(m for m in model.modules() if isinstance(m, layers.MoE))
    moe.eval()

    class OnCuda(torch.Tensor):
        is_cuda = True

    monkeypatch.setattr(fused_moe, "is_available", lambda device: True)
    pairs_per_token = moe.top_k + (moe.gate_up_with_shared is not None)
    few = torch.zeros(moe.fused_moe_max_pairs // pairs_per_token, 4).as_subclass(OnCuda)
    many = torch.zeros(moe.fused_moe_max_pairs // pairs_per_token + 1, 4).as_subclass(OnCuda)
    with torch.no_grad():
        for grouped in (True, False):
            monkeypatch.setattr(layers, "grouped_mm_available", lambda x, g=grouped: g)
            assert moe._fused_kernels_run(few) and moe._fused_kernels_run(many)
            monkeypatch.setattr(moe, "grouped_mm_min_pairs", many.shape[0] * pairs_per_token)
            assert moe._fused_kernels_run(few)
            assert moe._fused_kernels_run(many) is (not grouped)
            monkeypatch.setattr(moe, "grouped_mm_min_pairs", None)
        assert not moe._fused_kernels_run(torch.zeros(2, 4))  # a CPU tensor
    with torch.enable_grad():
        assert not moe._fused_kernels_run(few)  # training-style calls keep the reference paths


def test_moe_sorted_path_takes_its_tile_rows_from_the_token_count(monkeypatch):
    """Past ``fused_moe_max_pairs`` the fused forward runs the sorted kernels at the tile rows
    :func:`grouped_moe.block_m_for` gives its token count (16 to 128 by size), and at or
    below it the fused kernels; the routing's ids and weights reach them unchanged."""
    from laguna_dflash.kernels import fused_moe, grouped_moe, moe_routing
    from laguna_dflash.models import layers
    from laguna_dflash.models.laguna import LagunaForCausalLM
    from laguna_dflash.models.random_init import tiny_laguna_config

    sizes = (1, 384, 385, 768, 769, 1792, 1793, 16384)
    assert [grouped_moe.block_m_for(t) for t in sizes] == [16, 16, 32, 32, 64, 64, 128, 128]
    model = LagunaForCausalLM.from_config(tiny_laguna_config())
    moe = next(m for m in model.modules() if isinstance(m, layers.MoE)).eval()
    moe.fold_shared_expert()
    monkeypatch.setattr(moe, "use_moe_gemv", False)
    calls = []

    def route(logits, *args, **kwargs):
        t = logits.shape[0]
        ids = torch.arange(t * moe.top_k).remainder(moe.num_local_experts).view(t, moe.top_k)
        ids = torch.cat([ids, torch.full((t, 1), moe.num_local_experts)], 1)
        return torch.ones(t, moe.top_k + 1, dtype=logits.dtype), ids

    def experts(name):
        def run(x, ids, weights, gate_up, down, block_m=None, **kwargs):
            calls.append((name, x.shape[0], block_m, ids))
            return torch.zeros(x.shape[0], ids.shape[1], x.shape[1], dtype=x.dtype)
        return run

    monkeypatch.setattr(moe_routing, "fused_moe_route", route)
    monkeypatch.setattr(grouped_moe, "sorted_moe_experts", experts("sorted"))
    monkeypatch.setattr(fused_moe, "fused_moe_experts", experts("fused"))
    hidden = moe.experts_gate_up.shape[-1]
    most_fused = moe.fused_moe_max_pairs // (moe.top_k + 1)
    with torch.no_grad():
        for t in (most_fused, most_fused + 1, 400, 800):
            moe.fused_forward(torch.randn(t, hidden))
    expected = [("fused", most_fused, None), ("sorted", most_fused + 1, 16), ("sorted", 400, 32),
                ("sorted", 800, 64)]
    assert [c[:3] for c in calls] == expected
    for _, t, _, ids in calls:
        assert torch.equal(ids, route(torch.zeros(t, 1))[1])


def test_moe_launches_the_sorted_kernels_at_every_tile_height(monkeypatch):
    """The build ahead of the sorted MoE kernels launches them once at each tile height the
    engine can take (``engine_block_ms`` is exactly ``block_m_for``'s range), with the layer's
    folded experts, its dtype, one token routed to ``k`` distinct experts in range, and the
    skipped-pairs build under expert parallelism; a model with no CUDA experts builds nothing."""
    from types import SimpleNamespace

    from laguna_dflash.kernels import grouped_moe
    from laguna_dflash.models import layers
    from laguna_dflash.models.laguna import LagunaForCausalLM
    from laguna_dflash.models.random_init import tiny_laguna_config

    assert grouped_moe.engine_block_ms() == (16, 32, 64, 128)
    assert {grouped_moe.block_m_for(t) for t in range(1, 5000)} == set(grouped_moe.engine_block_ms())
    model = LagunaForCausalLM.from_config(tiny_laguna_config()).to(torch.bfloat16)
    moe = next(m for m in model.modules() if isinstance(m, layers.MoE)).eval()
    moe.fold_shared_expert()
    calls = []

    def record(x, ids, weights, gate_up, down, block_m=16, has_skipped_pairs=False):
        calls.append((block_m, has_skipped_pairs))
        assert gate_up is moe.gate_up_with_shared and down is moe.down_with_shared
        assert x.dtype == weights.dtype == gate_up.dtype and x.shape == (1, gate_up.shape[-1])
        assert ids.shape == weights.shape == (1, moe.top_k + 1)
        assert ids.unique().numel() == ids.numel() and 0 <= int(ids.min()) and int(ids.max()) < gate_up.shape[0]
        return torch.zeros(1, ids.shape[1], x.shape[1], dtype=x.dtype)

    monkeypatch.setattr(grouped_moe, "sorted_moe_experts", record)
    moe.launch_sorted_kernels_at_every_tile_height()
    assert calls == [(b, False) for b in grouped_moe.engine_block_ms()]
    calls.clear()
    monkeypatch.setattr(moe, "tp", SimpleNamespace(shards_experts=True))
    moe.launch_sorted_kernels_at_every_tile_height()
    assert calls == [(b, True) for b in grouped_moe.engine_block_ms()]
    calls.clear()
    assert layers.build_sorted_moe_kernels_ahead(model) == 0 and not calls  # CPU experts


def _mixed_batch() -> tuple[list[SamplingParams], list[int | None]]:
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5),
              SamplingParams(temperature=1.3, top_p=0.6), SamplingParams(temperature=0.9, min_p=0.2),
              SamplingParams(temperature=0.5), SamplingParams(temperature=1.0, top_k=3, top_p=0.8, min_p=0.05)]
    seeds = [None, 11, None, 12, 13, 14]
    return params, seeds


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_filtered_probs_rows_equal_each_row_filtered_alone(device):
    # batched filtering is row-wise: every row's probabilities are bitwise those of the row
    # filtered alone (scalar parameters there, columns here), and a filter one row uses leaves
    # the other rows untouched
    logits = (torch.randn(6, 64, generator=torch.Generator().manual_seed(2)) * 3).to(device)
    params, _ = _mixed_batch()
    params[0] = SamplingParams(temperature=0.8)
    rows = filtered_probs_rows(logits, [p.temperature for p in params], [p.top_k for p in params],
                               [p.top_p for p in params], [p.min_p for p in params])
    for row, p, got in zip(logits, params, rows):
        alone = filtered_probs(row[None], p.temperature, p.top_k, p.top_p, p.min_p)[0]
        assert torch.equal(got, alone), p
    plain = torch.softmax(logits[4:5].float() * 2.0, -1)[0]
    assert torch.equal(rows[4], plain)  # no filter of its own: the softmax, not renormalised


def _nucleus_of_top_k(logits: torch.Tensor, temperature: float, k: int, top_p: float) -> torch.Tensor:
    """The kept set of top-k then top-p by its definition, in float64: the top-k's tokens (ties
    of the k-th included) by probability, kept while the mass before a token is below top_p,
    every tie of the boundary token kept."""
    s = logits.double() / temperature
    kth = s.sort(descending=True).values[k - 1]
    p = torch.softmax(s.masked_fill(s < kth, float("-inf")), -1)
    ranked = p.sort(descending=True).values
    before = torch.cat([p.new_zeros(1), ranked.cumsum(0)[:-1]])
    tau = ranked[min(int((before < top_p).sum().clamp(min=1)), k) - 1]
    return (p >= tau) & (p > 0)


@pytest.mark.parametrize("k, top_p", [(1, 0.9), (3, 0.5), (5, 0.99), (20, 0.3), (20, 0.95), (50, 0.9)])
def test_top_p_over_a_top_k_keeps_the_ranked_nucleus_without_a_sort(monkeypatch, k, top_p):
    # a row with a top-k of at most TOPK_MAX_COLUMNS takes its nucleus from the top-k's ranked
    # tokens: no sort of the row, the same set as the definition (float64), renormalised
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(k)) * 2
    logits[1, 7:12] = logits[1].max() + 0.5  # five tied most likely tokens: the boundary's ties
    sorts = []
    real = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda *a, **kw: sorts.append(1) or real(*a, **kw))
    probs = filtered_probs(logits, 0.8, top_k=k, top_p=top_p)
    assert not sorts
    for row in range(3):
        want = _nucleus_of_top_k(logits[row], 0.8, k, top_p)
        assert torch.equal(probs[row] > 0, want), (row, int((probs[row] > 0).sum()), int(want.sum()))
        torch.testing.assert_close(probs[row].sum(), torch.tensor(1.0))
    assert int((probs[1] > 0).sum()) >= min(5, k)  # the tied tokens stay together


@pytest.mark.parametrize("row_chunk", [1024, 8])
@pytest.mark.parametrize("top_p", [0.5, 0.6, 0.9])
def test_ranked_top_p_counts_the_kth_ties_outside_its_columns(monkeypatch, top_p, row_chunk):
    # k = 2 with six tokens tied at the k-th score, four ranked columns: the nucleus's mass
    # includes the ties the columns do not hold (top_p 0.6 crosses into them: p(top) = 0.55),
    # as the float64 definition says; counted over the row in one sum or by chunks of 8
    import laguna_dflash.engine.sampler as sampler
    monkeypatch.setattr(sampler, "TOPK_MAX_COLUMNS", 4)
    monkeypatch.setattr(sampler, "ROW_CHUNK", row_chunk)
    logits = torch.full((2, 40), -4.0)
    logits[:, 0], logits[:, 5:11] = 5.0, 3.0
    logits[1] = logits[1].roll(17)
    probs = filtered_probs(logits, 1.0, top_k=2, top_p=top_p)
    for row in range(2):
        want = _nucleus_of_top_k(logits[row], 1.0, 2, top_p)
        assert torch.equal(probs[row] > 0, want), (row, int((probs[row] > 0).sum()), int(want.sum()))
    assert int((probs[0] > 0).sum()) == (1 if top_p == 0.5 else 7)


def test_sampled_picks_follow_the_filtered_distribution():
    # the race on scores (argmax s - log E over the kept tokens) draws from filtered_probs_rows'
    # distribution: 40000 draws of one row with min-p, top-k and top-p, chi-square against it
    from scipy.stats import chisquare
    logits = torch.tensor([2.0, 1.5, 1.4, 1.4, 0.3, -0.5, 0.9, -3.0, 1.1, 0.0])
    params = SamplingParams(temperature=0.9, top_k=7, top_p=0.9, min_p=0.05)
    want = filtered_probs(logits[None], 0.9, 7, 0.9, 0.05)[0].double()
    picks = sample_rows(logits.expand(40000, -1).contiguous(), [params] * 40000,
                        global_generator=torch.Generator().manual_seed(3))
    counts = torch.bincount(picks, minlength=10).double()
    kept = want > 0
    assert int(kept.sum()) >= 4 and counts[~kept].sum() == 0
    expected = want[kept] / want[kept].sum() * counts.sum()  # the same total, in float64
    assert chisquare(counts[kept].numpy(), expected.numpy()).pvalue > 1e-3


def test_sorted_top_p_keeps_every_tie_of_the_boundary_token():
    # top-p without a top-k (the sort of the row): p(top) = 0.39 < 0.5, so the boundary is a
    # token of the four tied at 2.0, and all four stay, as on the ranked path
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 2.0, 0.0, -1.0]])
    kept = filtered_probs(logits, 1.0, top_k=0, top_p=0.5)[0] > 0
    assert kept.tolist() == [True] * 5 + [False] * 2


def test_chunk_long_rows(monkeypatch):
    # top-p's prefix sums over a sorted row in chunks (8 columns here; 1024 by default): the
    # float64 sums within float32 rounding, monotone on non-negative rows with zero runs, each
    # row bitwise alone; rows up to two chunks take one cumsum
    import laguna_dflash.engine.sampler as sampler
    monkeypatch.setattr(sampler, "ROW_CHUNK", 8)
    weights = torch.rand(5, 61, generator=torch.Generator().manual_seed(8)) ** 4
    weights[1, 20:45] = 0.0
    weights[2] = torch.linspace(1.0, 1e-9, 61)
    scans = []
    real = torch.Tensor.cumsum
    monkeypatch.setattr(torch.Tensor, "cumsum", lambda t, *a, **kw: scans.append(t.shape) or real(t, *a, **kw))
    sums = sampler._prefix_sums(weights)
    assert scans == [(5, 8, 8), (5, 8)]  # the chunks' scans, then their totals'
    monkeypatch.setattr(torch.Tensor, "cumsum", real)
    torch.testing.assert_close(sums.double(), weights.double().cumsum(-1), rtol=1e-6, atol=1e-7)
    assert bool((sums.diff(dim=-1) >= 0).all())
    for r in range(5):
        assert torch.equal(sampler._prefix_sums(weights[r : r + 1])[0], sums[r])
    assert torch.equal(sampler._prefix_sums(weights[:, :16]), weights[:, :16].cumsum(-1))
    monkeypatch.setattr(sampler, "chunk_long_rows", False)
    assert torch.equal(sampler._prefix_sums(weights), weights.cumsum(-1))


def test_chunked_row_counts(monkeypatch):
    # the true entries of each row, counted by chunks of 8 past two chunks: exact, row-wise
    import laguna_dflash.engine.sampler as sampler
    monkeypatch.setattr(sampler, "ROW_CHUNK", 8)
    mask = torch.rand(5, 61, generator=torch.Generator().manual_seed(10)) < 0.3
    mask[1], mask[2] = False, True
    sums = []
    real = torch.Tensor.sum
    monkeypatch.setattr(torch.Tensor, "sum", lambda t, *a, **kw: sums.append(t.shape) or real(t, *a, **kw))
    counts = sampler._row_counts(mask)
    monkeypatch.setattr(torch.Tensor, "sum", real)
    assert sums == [(5, 8, 8), (5, 8)]  # by chunk, then the chunks' counts
    assert torch.equal(counts, mask.sum(-1, keepdim=True)) and counts.dtype == torch.int64
    assert counts[1, 0] == 0 and counts[2, 0] == 61
    monkeypatch.setattr(sampler, "chunk_long_rows", False)
    assert torch.equal(sampler._row_counts(mask), mask.sum(-1, keepdim=True))


@pytest.mark.parametrize("top_p", [0.3, 0.8, 0.95])
def test_sorted_top_p_with_chunked_sums_keeps_the_nucleus(monkeypatch, top_p):
    # top-p without a top-k (the sort) with its prefix sums in chunks of 16 over 300 columns:
    # the kept set is the float64 definition's, with the boundary's ties, as in one cumsum
    import laguna_dflash.engine.sampler as sampler
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(9)) * 2
    logits[1, 40:52] = logits[1].max() - 0.1  # twelve tied tokens near the top
    one_scan = filtered_probs(logits, 0.8, top_k=0, top_p=top_p)
    monkeypatch.setattr(sampler, "ROW_CHUNK", 16)
    probs = filtered_probs(logits, 0.8, top_k=0, top_p=top_p)
    assert torch.equal(probs > 0, one_scan > 0)
    for row in range(3):
        want = _nucleus_of_top_k(logits[row], 0.8, 300, top_p)
        assert torch.equal(probs[row] > 0, want), (row, int((probs[row] > 0).sum()), int(want.sum()))


def _kept_by_definition(logits: torch.Tensor, temperature: float, k: int, top_p: float,
                        min_p: float) -> tuple[torch.Tensor, float]:
    """The kept set of min-p, top-k, then top-p by their definitions, in float64, and the
    margin of top-p's decision (how far the boundary's exclusive mass, and the mass before the
    next distinct score, are from ``top_p``: under ~1e-5, float32 may decide either way)."""
    s = logits.double() / temperature
    keep = torch.ones_like(s, dtype=torch.bool)
    if min_p > 0:
        keep &= s >= s.max() + torch.log(torch.tensor(min_p, dtype=torch.float64))
    if 0 < k < s.numel():
        keep &= s >= s.sort(descending=True).values[k - 1]
    if top_p >= 1.0:
        return keep, 1.0
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), -1)
    ranked = p.sort(descending=True).values
    before = torch.cat([p.new_zeros(1), ranked.cumsum(0)[:-1]])
    num_below = int((before < top_p).sum().clamp(min=1))
    tau = ranked[num_below - 1]
    margin = float((before - top_p).abs()[: int(keep.sum())].min())
    return keep & (p >= tau), margin


@pytest.mark.parametrize("row_chunk", [1024, 8])
def test_filters_keep_the_float64_definitions_randomised(monkeypatch, row_chunk):
    # 300 random rows and parameters (min-p, top-k, top-p, alone and together; ties from
    # coarse logits), filtered as one batch, each row's kept set against the float64
    # definitions; with chunks of 8 the sorted and ranked paths' sums and counts run chunked
    import random

    import laguna_dflash.engine.sampler as sampler
    monkeypatch.setattr(sampler, "ROW_CHUNK", row_chunk)
    monkeypatch.setattr(sampler, "TOPK_MAX_COLUMNS", 16)  # k above it takes the sort
    rng = random.Random(row_chunk)
    checked = 0
    for case in range(30):
        vocab = rng.choice([40, 97, 200])
        gen = torch.Generator().manual_seed(case)
        logits = torch.randn(10, vocab, generator=gen) * rng.choice([0.5, 2.0, 4.0])
        if case % 3 == 0:
            logits = (logits * 4).round() / 4  # many ties
        temperature = [rng.choice([0.5, 0.8, 1.0, 1.3]) for _ in range(10)]
        top_k = [rng.choice([0, 1, 3, 10, 16, 30, vocab]) for _ in range(10)]
        top_p = [rng.choice([1.0, 0.3, 0.7, 0.9, 0.99]) for _ in range(10)]
        min_p = [rng.choice([0.0, 0.0, 0.05, 0.2]) for _ in range(10)]
        probs = filtered_probs_rows(logits, temperature, top_k, top_p, min_p)
        for r in range(10):
            want, margin = _kept_by_definition(logits[r], temperature[r], top_k[r], top_p[r], min_p[r])
            if margin < 1e-5:
                continue  # float32 and float64 may round the boundary differently
            checked += 1
            assert torch.equal(probs[r] > 0, want), (case, r, temperature[r], top_k[r], top_p[r], min_p[r])
    assert checked >= 270


def _narrow_logits(dtype: torch.dtype) -> torch.Tensor:
    """``[8, 300]`` 16-bit logits with ties, signed zeros and -inf entries."""
    logits = (torch.randn(8, 300, generator=torch.Generator().manual_seed(12)) * 3).to(dtype)
    logits[1] = (logits[1].float() * 2).round().to(dtype) / 2  # a few distinct values
    logits[2, :40], logits[2, 40:80] = 0.0, -0.0
    logits[3, ::7] = float("-inf")
    logits[4, 10:30] = logits[4].max()  # twenty tied most likely tokens
    return logits


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shared_temperature", [True, False])
def test_sorting_narrow_logits_gives_the_same_scores_and_thresholds(monkeypatch, device, dtype,
                                                                    shared_temperature):
    # sort_narrow_keys: a row sort over 16-bit logits sorts them and then widens and scales;
    # the scores and every row's threshold are those of the float32 sort (top-p alone, with a
    # top-k that takes the sort, with min-p; one temperature, or a column of them), and so
    # are seeded picks; float32 logits, or a 1 / T that overflows float32, keep the float32 sort
    import laguna_dflash.engine.sampler as sampler
    monkeypatch.setattr(sampler, "TOPK_MAX_COLUMNS", 16)  # k = 30 takes the sort
    logits = _narrow_logits(dtype).to(device)
    temperature = [0.8] * 8 if shared_temperature else [0.5, 0.8, 1.0, 1.3, 0.7, 2.0, 0.9, 1.1]
    top_k = [0, 0, 30, 0, 30, 0, 0, 30]
    top_p = [0.9, 0.5, 0.95, 0.7, 0.8, 1.0, 0.99, 1.0]
    min_p = [0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.05, 0.0]
    args = (temperature, top_k, top_p, min_p)
    assert sampler.sort_narrow_keys  # on by default
    monkeypatch.setattr(sampler, "sort_narrow_keys", False)
    want_scores, want_threshold = filtered_scores(logits, *args)
    sorted_dtypes = []
    real_sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda t, *a, **kw: sorted_dtypes.append(t.dtype) or real_sort(t, *a, **kw))
    filtered_scores(logits, *args)
    assert sorted_dtypes == [torch.float32]  # the switch off: the float32 sort
    sorted_dtypes.clear()
    monkeypatch.setattr(sampler, "sort_narrow_keys", True)
    scores, threshold = filtered_scores(logits, *args)
    assert sorted_dtypes == [dtype]  # one sort, of the logits themselves
    assert torch.equal(scores, want_scores) and torch.equal(threshold, want_threshold)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p_, min_p=m, seed=40 + i)
              for i, (t, k, p_, m) in enumerate(zip(*args))]
    picks = sample_rows(logits, params, positions=list(range(8)))
    monkeypatch.setattr(sampler, "sort_narrow_keys", False)
    assert torch.equal(picks, sample_rows(logits, params, positions=list(range(8))))
    monkeypatch.setattr(sampler, "sort_narrow_keys", True)
    sorted_dtypes.clear()
    filtered_scores(logits.float(), *args)
    filtered_scores(logits, [1e-39] + temperature[1:], *args[1:])  # 1 / T: inf in float32
    assert sorted_dtypes == [torch.float32, torch.float32]


def test_ranked_top_p_equals_the_full_sort_without_ties(monkeypatch):
    # float32 logits: no ties, so the ranked nucleus and the sorted one are the same set and
    # values within rounding; at TOPK_MAX_COLUMNS 0 every row takes the full sort
    import laguna_dflash.engine.sampler as sampler
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(5)) * 3
    args = ([0.7, 1.0, 1.3, 0.9], [10, 40, 3, 100], [0.9, 0.5, 0.99, 0.8], [0.0] * 4)
    ranked = filtered_probs_rows(logits, *args)
    monkeypatch.setattr(sampler, "TOPK_MAX_COLUMNS", 0)
    sorted_ = filtered_probs_rows(logits, *args)
    assert torch.equal(ranked > 0, sorted_ > 0)
    torch.testing.assert_close(ranked, sorted_, rtol=1e-6, atol=1e-7)


def test_ranked_and_sorted_top_p_rows_mixed_are_each_row_alone(monkeypatch):
    # ranked rows (k <= TOPK_MAX_COLUMNS), a row whose k takes the sort, top-p only, top-k only and
    # no filter in one batch: each row is bitwise its filtering alone, where the batch's largest
    # k differs (the ranked prefix sums have one width whatever it is)
    import laguna_dflash.engine.sampler as sampler
    monkeypatch.setattr(sampler, "TOPK_MAX_COLUMNS", 16)
    logits = torch.randn(6, 80, generator=torch.Generator().manual_seed(6)) * 2
    logits[0, :6] = logits[0].max() + 1.0  # six tied most likely tokens in a ranked row
    temperature, top_k = [0.9, 1.1, 0.7, 1.0, 0.8, 1.2], [4, 12, 40, 0, 7, 0]
    top_p, min_p = [0.8, 0.6, 0.9, 0.7, 1.0, 1.0], [0.0, 0.1, 0.0, 0.0, 0.0, 0.0]
    rows = filtered_probs_rows(logits, temperature, top_k, top_p, min_p)
    for r in range(6):
        alone = filtered_probs(logits[r : r + 1], temperature[r], top_k[r], top_p[r], min_p[r])[0]
        assert torch.equal(rows[r], alone), r
    assert int((rows[0] > 0).sum()) == 6  # k 4 inside the six tied tokens: all six kept


def test_top_k_from_a_full_sort_equals_top_k_from_topk(monkeypatch):
    import laguna_dflash.engine.sampler as sampler
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(4))
    logits[1, :10] = 2.5  # ties at the k-th value are all kept either way
    args = ([0.9] * 3, [4, 0, 30], [1.0] * 3, [0.0] * 3)
    by_topk = filtered_probs_rows(logits, *args)
    monkeypatch.setattr(sampler, "TOPK_MAX_COLUMNS", 8)  # k = 30 now takes the sort
    assert torch.equal(filtered_probs_rows(logits, *args), by_topk)
    assert int((by_topk[0] > 0).sum()) == 4 and int((by_topk[2] > 0).sum()) == 30


@pytest.mark.parametrize("rows", [1, 4])
def test_sampling_a_mixed_batch_equals_sampling_each_request_alone(rows):
    # greedy, global-RNG and seeded requests with different filters in one batch: each seeded
    # request picks what it picks alone, greedy rows are the argmax, and a verify's row j picks
    # what a one-row step at position + j picks (one noise per output position)
    logits = torch.randn(6 * rows, 80, generator=torch.Generator().manual_seed(9)) * 2
    params, seeds = _mixed_batch()
    params = [replace(p, seed=s) for p, s in zip(params, seeds)]
    positions = [3, 0, 9, 2**33 + 1, 1, 40]
    batch = sample_rows(logits, params, positions, rows)
    for i, (p, pos) in enumerate(zip(params, positions)):
        block = logits[i * rows : (i + 1) * rows]
        if p.seed is None:
            if p.is_greedy:
                assert torch.equal(batch[i * rows : (i + 1) * rows], block.argmax(-1))
            continue
        alone = sample_rows(block, [p], [pos], rows)
        assert torch.equal(batch[i * rows : (i + 1) * rows], alone), p
        for j in range(rows):
            assert torch.equal(sample_rows(block[j : j + 1], [p], [pos + j]), alone[j : j + 1]), (p, j)


def test_seeded_rows_take_one_noise_launch_and_unseeded_rows_one_draw(monkeypatch):
    # whatever the number of seeded requests: one counter_exponential call for all their rows
    # (no per-request work on the device), one exponential_ for the unseeded rows, none of it
    # when no row needs it
    import laguna_dflash.engine.sampler as sampler
    calls = {"counter": [], "exponential_": 0}
    real_counter, real_exp = sampler.counter_exponential, torch.Tensor.exponential_

    def counter(seeds, positions, *a, **kw):
        calls["counter"].append((seeds.tolist(), positions.tolist()))
        return real_counter(seeds, positions, *a, **kw)

    def exponential_(self, *a, **kw):
        calls["exponential_"] += 1
        return real_exp(self, *a, **kw)

    monkeypatch.setattr(sampler, "counter_exponential", counter)
    monkeypatch.setattr(torch.Tensor, "exponential_", exponential_)
    logits = torch.randn(8 * 4, 60)
    params = [SamplingParams(temperature=0.8, seed=s) for s in (5, 6, 7)] + [
        SamplingParams(temperature=0.8), SamplingParams(temperature=0)] * 2 + [
        SamplingParams(temperature=0.8, seed=-3)]
    sample_rows(logits, params, [10, 0, 2, 0, 0, 0, 0, 7], 4)
    assert calls["exponential_"] == 1
    assert calls["counter"] == [([5] * 4 + [6] * 4 + [7] * 4 + [-3] * 4,
                                 [10, 11, 12, 13, 0, 1, 2, 3, 2, 3, 4, 5, 7, 8, 9, 10])]
    calls["counter"].clear()
    calls["exponential_"] = 0
    sample_rows(logits[:12], params[:3], [0, 0, 0], 4)
    assert calls["exponential_"] == 0 and len(calls["counter"]) == 1
    sample_rows(logits[:4], [SamplingParams(temperature=0.8)] * 4)
    assert calls["exponential_"] == 1 and len(calls["counter"]) == 1


def test_sampling_launches_do_not_grow_with_the_batch(monkeypatch):
    # one filter pass for every sampled row: top-p's sort of the rows runs once whatever the
    # number of requests, and the race never normalises (no softmax)
    calls = {"sort": 0, "softmax": 0}
    real_sort, real_softmax = torch.Tensor.sort, torch.softmax

    def sort(*a, **kw):
        calls["sort"] += 1
        return real_sort(*a, **kw)

    def softmax(*a, **kw):
        calls["softmax"] += 1
        return real_softmax(*a, **kw)

    monkeypatch.setattr(torch.Tensor, "sort", sort)
    monkeypatch.setattr(torch, "softmax", softmax)
    logits = torch.randn(16, 50)
    sample_rows(logits, [SamplingParams(temperature=0.8, top_p=0.9)] * 16)
    assert calls == {"sort": 1, "softmax": 0}


def test_shared_parameters_need_no_upload_and_varying_ones_one(monkeypatch):
    import laguna_dflash.engine.sampler as sampler
    uploads = []
    real = sampler.to_device_async
    monkeypatch.setattr(sampler, "to_device_async", lambda t, d: uploads.append(t.shape) or real(t, d))
    logits = torch.randn(4, 50)
    same = SamplingParams(temperature=0.7, top_k=10, top_p=0.9, min_p=0.1)
    sample_rows(logits, [same] * 4)
    assert uploads == []  # batch 1, or every request alike: scalars only
    mixed = [same, SamplingParams(temperature=0.9, top_p=0.8), same, SamplingParams(temperature=0.5)]
    sample_rows(logits, mixed)
    assert len(uploads) == 1 and uploads[0][1] == 4  # one [num_varying, N] table


def test_top_logprobs_of_a_row_do_not_depend_on_its_batch_mates_counts():
    # tied logprobs (bf16): which tied ids top-3 reports must not change because another row
    # of the step asked for 20
    logits = (torch.randn(40, 300, generator=torch.Generator().manual_seed(6)) * 2).bfloat16()
    logits[:, 10:20] = logits[:, 10:11]  # ten tied tokens a row
    tokens = torch.zeros(40, dtype=torch.long)
    alone = [top_logprobs(logits[r : r + 1], tokens[r : r + 1], 3)[0] for r in range(40)]
    mixed = top_logprobs(logits, tokens, [3 if r % 2 else 20 for r in range(40)])
    assert all(mixed[r] == alone[r] for r in range(1, 40, 2))
    assert all(len(mixed[r]) in (20, 21) for r in range(0, 40, 2))


def test_tiny_temperatures_are_greedy_and_no_rows_is_no_probs():
    logits = torch.tensor([[-1.0, 0.0, -3.0]])
    p = SamplingParams(temperature=1e-39)
    assert p.is_greedy and sample_rows(logits, [p]).tolist() == [1]
    assert filtered_probs(torch.zeros(0, 7), 0.7, 3, 0.9).shape == (0, 7)


def test_sampling_build_ahead_is_cuda_only(monkeypatch):
    # the sampled step's kernels are built ahead on CUDA only: elsewhere nothing is launched
    import laguna_dflash.engine.sampler as sampler
    monkeypatch.setattr(sampler, "launches_build_only", lambda *a, **kw: pytest.fail("built on the CPU"))
    assert sampler.build_ahead(1000, torch.device("cpu")) == 0


@pytest.mark.parametrize("num_cols", [64, 70, 100352, 100353])
def test_noise_build_arguments_reach_every_variant_the_sampler_launches(num_cols):
    # every counter-noise launch sample_rows can make (S seeded rows after U unseeded ones: the
    # table's rows and the noise's row offset) has Triton's own specialisation (the oracle:
    # triton's native_specialize_impl, pointers by 16-byte alignment) of a build-ahead launch;
    # the CUDA run that found this built the kernel on a first seeded request (one row: its
    # positions 8 bytes into the table)
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    import laguna_dflash.engine.sampler as sampler

    def variant(seeds, positions, out) -> tuple:
        return tuple(native_specialize_impl(BaseBackend, a, False, True, True)
                     for a in (seeds, positions, out, num_cols, out.stride(0)))

    built = {variant(*args) for args in sampler.noise_build_arguments(num_cols, "cpu")}
    for num_seeded in range(1, 6):
        for num_unseeded in range(4):
            table = torch.tensor([[7] * num_seeded, [3] * num_seeded], dtype=torch.int64)
            noise = torch.empty(num_unseeded + num_seeded, num_cols)
            assert variant(table[0], table[1], noise[num_unseeded:]) in built, (num_seeded, num_unseeded)
    assert len(built) == (4 if num_cols % 4 else 2)  # each launch a variant of its own


def test_sampling_build_ahead_failing_is_logged_not_raised(monkeypatch, caplog):
    # a failed build pass only costs the first sampled request its builds: start-up goes on
    import contextlib

    import laguna_dflash.engine.sampler as sampler

    @contextlib.contextmanager
    def failing(*a, **kw):
        raise RuntimeError("no build pool")
        yield

    monkeypatch.setattr(sampler, "launches_build_only", failing)
    monkeypatch.setattr(torch, "zeros", lambda *a, **kw: None)  # no CUDA here: nothing is allocated
    with caplog.at_level("WARNING", logger="laguna_dflash.engine.sampler"):
        assert sampler.build_ahead(1000, torch.device("cuda")) == 0
    assert "building the sampling kernels ahead failed" in caplog.text and "no build pool" in caplog.text
