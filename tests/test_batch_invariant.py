"""Batch-invariant mode (``kernels/batch_invariant.py``, ``--batch-invariant``).

What must hold: inside ``batch_invariant.scope`` a row's result is BITWISE the same whatever else
the forward holds (``torch.equal``, not a tolerance):

* the linear layers: a row alone, in a chunk of 5 and among 37 rows (three 16-row blocks of one
  launch); one launch of blocks against a launch per block, with split-K;
* the MoE experts: a token alone, among 21 tokens (other experts hit, other run lengths) and
  in launches of 8 tokens; with skipped pairs (expert parallelism's ``-1`` ids), a token alone
  and in the batch, its skipped pairs zeros;
* paged attention: a query position as a 1-token decode, inside a 4-token verify, inside the
  whole prompt's prefill (in one launch and in token chunks) and next to other requests
  (causal; sliding window with sinks; several key splits, some empty);
* the engine: greedy tokens AND their logprobs of each prompt alone, in a batch of three and
  with DFlash (verify batches of K + 1 rows), in bf16.

Each is also checked against its reference within a tolerance (the mode changes no math).
On CUDA at Laguna-XS-2.1 widths, where the default kernels do part (the engine test prints how
often): there the compiled kernels' rounding is what is tested. Under Triton's CPU interpreter
(ONE child process, small widths) the same checks run the mode's paths end to end (chunking,
dispatch, engine wiring), but the interpreter computes tiles with numpy, which rounds the same
for every shape: its default kernels pass these checks too. Without the kernels (a plain CPU)
the flag is refused with an error naming it.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from interpreter_child import HAS_TRITON, INTERPRETED, interpreted, run_interpreted_child

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.engine.runner import ForwardItem, build_metadata
from laguna_dflash.kernels import batch_invariant, fused_moe
from laguna_dflash.kernels import paged_attention as pa

HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON) or INTERPRETED, reason="needs CUDA and triton")
BLOCK_SIZE = 16


# ---- bodies shared by the interpreted and the CUDA tests ------------------------------------------


def check_linear(device: str, n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype).to(device)
    bias = torch.randn(n, generator=g).to(dtype).to(device)
    full = batch_invariant.linear(x, w)
    singles = torch.cat([batch_invariant.linear(x[i : i + 1], w) for i in range(x.shape[0])])
    uneven = torch.cat([batch_invariant.linear(x[:5], w), batch_invariant.linear(x[5:], w)])
    assert torch.equal(full, singles) and torch.equal(full, uneven)
    assert torch.equal(batch_invariant.linear(x[3:4], w, bias), full[3:4] + bias)
    assert torch.equal(batch_invariant.linear(x.view(1, 37, k), w)[0], full)  # leading dims
    torch.testing.assert_close(full.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2)


def check_moe(device: str, hidden: int, e: int, top_k: int, inter: int, kernel: str,
              dtype: torch.dtype = torch.bfloat16) -> None:
    """``kernel`` "auto" with the switch at 4 tokens: the 21-token forwards take the sorted
    kernels and the 1-token ones the fused kernels, so the bitwise checks compare the two pairs
    (and the check the engine relies on, ``sorted_agrees_with_fused``, must have passed)."""
    saved = batch_invariant.moe_kernel, batch_invariant.MOE_FUSED_MAX_TOKENS, batch_invariant._agreement
    batch_invariant.moe_kernel = kernel
    batch_invariant.MOE_FUSED_MAX_TOKENS, batch_invariant._agreement = 4, {}
    try:
        _check_moe(device, hidden, e, top_k, inter, dtype)
        if kernel == "auto":
            assert list(batch_invariant._agreement.values()) == [True]
    finally:
        batch_invariant.moe_kernel, batch_invariant.MOE_FUSED_MAX_TOKENS, batch_invariant._agreement = saved


def _check_moe(device: str, hidden: int, e: int, top_k: int, inter: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    t = 21
    x = torch.randn(t, hidden, generator=g).to(dtype).to(device)
    gate_up = (torch.randn(e, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype).to(device)
    down = (torch.randn(e, hidden, inter, generator=g) * inter**-0.5).to(dtype).to(device)
    # few experts: long runs at T = 21, runs of one at T = 1
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(t)]).to(device)
    weights = torch.rand(t, top_k, generator=g).to(device)
    pairs = batch_invariant.moe_experts(x, ids, weights, gate_up, down)
    assert pairs.shape == (t, top_k, hidden)
    for i in range(t):
        alone = batch_invariant.moe_experts(x[i : i + 1], ids[i : i + 1], weights[i : i + 1], gate_up, down)
        assert torch.equal(alone[0], pairs[i]), f"token {i}"
    shuffled = torch.randperm(t, generator=g).to(device)  # other neighbours, other tile rows
    again = batch_invariant.moe_experts(x[shuffled], ids[shuffled], weights[shuffled], gate_up, down)
    assert torch.equal(again, pairs[shuffled])
    chunk_rows = batch_invariant.MOE_MAX_ROWS
    batch_invariant.MOE_MAX_ROWS = 8  # "fused": launches of 8, 8 and 5 tokens
    try:
        assert torch.equal(batch_invariant.moe_experts(x, ids, weights, gate_up, down), pairs)
    finally:
        batch_invariant.MOE_MAX_ROWS = chunk_rows
    want = fused_moe.moe_experts_reference(x.float(), ids, weights, gate_up.float(), down.float())
    torch.testing.assert_close(pairs.float().sum(1), want, rtol=3e-2, atol=3e-2)


def check_moe_skipped_pairs(device: str, hidden: int, inter: int, kernel: str) -> None:
    """``has_skipped_pairs`` through ``moe_experts``: one rank's ids (``-1`` where the expert is
    on another rank, whose weights are NaN) give each token alone the bits it gets in the batch,
    the skipped pairs exact zeros, and the other pairs the global call's bits."""
    from test_kernel_fused_moe import ep_problem

    saved = batch_invariant.moe_kernel
    batch_invariant.moe_kernel = kernel
    try:
        full, rank, skipped = ep_problem(21, 3, 12, 3, 8, hidden, inter, torch.bfloat16, seed=2, device=device)
        x, local, w, gate_up, down = rank
        pairs = batch_invariant.moe_experts(*rank, has_skipped_pairs=True)
        assert torch.all(pairs[skipped] == 0) and not torch.isnan(pairs).any()
        assert torch.equal(pairs[~skipped], batch_invariant.moe_experts(*full)[~skipped])
        for i in range(x.shape[0]):
            alone = batch_invariant.moe_experts(x[i : i + 1], local[i : i + 1], w[i : i + 1], gate_up, down,
                                                has_skipped_pairs=True)
            assert torch.equal(alone[0], pairs[i]), f"token {i}"
    finally:
        batch_invariant.moe_kernel = saved


def _attend(q, k_cache, v_cache, items, scratch_slot, *, window, sinks):
    meta = build_metadata(items, BLOCK_SIZE, scratch_slot, q.device, is_causal=True)
    return pa.paged_attention(q, k_cache, v_cache, meta.query_index, meta.query_positions,
                              meta.key_slots, meta.seq_lens, scale=q.shape[-1] ** -0.5, causal=True,
                              sliding_window=window, sinks=sinks, batch_invariant=True)


def check_attention(device: str, length: int, num_heads: int, kv_heads: int, head_dim: int,
                    window: int | None, with_sinks: bool, dtype: torch.dtype = torch.bfloat16) -> None:
    """One request's prompt of ``length`` tokens: its prefill's row p equals a 1-token decode at
    p, the first row of a 4-token verify at p, and that decode next to another request."""
    g = torch.Generator().manual_seed(2)
    blocks = -(-length // BLOCK_SIZE)
    num_blocks = 2 * blocks + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table, other_table = perm[:blocks], perm[blocks : 2 * blocks]
    scratch = num_blocks * BLOCK_SIZE
    shape = ((num_blocks + 1) * BLOCK_SIZE, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=g).to(dtype).to(device)
    q = torch.randn(length, num_heads, head_dim, generator=g).to(dtype).to(device)
    q_other = torch.randn(length, num_heads, head_dim, generator=g).to(dtype).to(device)
    sinks = torch.randn(num_heads, generator=g).to(device) if with_sinks else None
    kw = dict(window=window, sinks=sinks)
    prefill = _attend(q, k_cache, v_cache, [ForwardItem(length, 0, length, table)], scratch, **kw)
    for p in sorted({0, 17, length // 2, length - 1}):
        decode = _attend(q[p : p + 1], k_cache, v_cache, [ForwardItem(1, p, p + 1, table)], scratch, **kw)
        assert torch.equal(decode[0], prefill[p]), f"decode at {p}"
        n = min(4, length - p)
        verify = _attend(q[p : p + n], k_cache, v_cache, [ForwardItem(n, p, p + n, table)], scratch, **kw)
        assert torch.equal(verify, prefill[p : p + n]), f"verify at {p}"
        other = min(20, length)  # another request's prefill
        pair = torch.cat([q_other[:other], q[p : p + 1]])
        both = _attend(pair, k_cache, v_cache, [ForwardItem(other, 0, other, other_table),
                                                ForwardItem(1, p, p + 1, table)], scratch, **kw)
        assert torch.equal(both[-1], prefill[p]), f"decode at {p} next to a prefill"
    # a prefill whose partials exceed the scratch budget runs in token chunks: same rows
    budget = pa.INVARIANT_MAX_PARTIAL_BYTES
    splits = pa._next_pow2(-(-blocks * BLOCK_SIZE // pa.INVARIANT_SPLIT_KEYS))
    pa.INVARIANT_MAX_PARTIAL_BYTES = splits * num_heads * head_dim * 4 * (length // 3 + 1)
    try:
        chunked = _attend(q, k_cache, v_cache, [ForwardItem(length, 0, length, table)], scratch, **kw)
    finally:
        pa.INVARIANT_MAX_PARTIAL_BYTES = budget
    assert torch.equal(chunked, prefill), "prefill in three token chunks"
    # two requests' prefills in chunks of n query tiles, bounded by the grid limit (chunks that
    # cross from one request into the next): the rows of one launch
    other = min(9, length)
    items = [ForwardItem(other, 0, other, other_table), ForwardItem(length, 0, length, table)]
    pair = torch.cat([q_other[:other], q])
    whole = _attend(pair, k_cache, v_cache, items, scratch, **kw)
    assert torch.equal(whole[other:], prefill)
    grid_z = pa.MAX_GRID_Z
    pa.MAX_GRID_Z = pa._next_pow2(-(-length // pa.INVARIANT_SPLIT_KEYS)) * (length // 4 + 1)
    try:
        chunked = _attend(pair, k_cache, v_cache, items, scratch, **kw)
    finally:
        pa.MAX_GRID_Z = grid_z
    assert torch.equal(chunked, whole), "two prefills in chunks of a quarter of the longest"
    # and the mode is still attention: the default kernel on the same prefill, within bf16 rounding
    meta = build_metadata([ForwardItem(length, 0, length, table)], BLOCK_SIZE, scratch, q.device)
    default = pa.paged_attention(q, k_cache, v_cache, meta.query_index, meta.query_positions,
                                 meta.key_slots, meta.seq_lens, scale=head_dim**-0.5, causal=True,
                                 sliding_window=window, sinks=sinks)
    torch.testing.assert_close(prefill.float(), default.float(), rtol=3e-2, atol=3e-2)


def greedy_runs(target: str, draft: str, prompts: list[list[int]], max_tokens: int,
                **engine_options) -> dict[str, list]:
    """(token ids, logprobs) of each prompt: alone, in one batch, and with DFlash (batched).
    The batch runs after the prompts alone on the same engine, so with prefix caching (on by
    default) it prefills only their uncached tails: ``runs["cached_tokens"]`` counts the prompt
    tokens it took from the cache."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    cached = []

    def run(llm: LLM, batches: list[list[list[int]]]) -> list:
        outs = [o for b in batches for o in llm.generate(prompt_token_ids=b, sampling_params=params)]
        cached.append(sum(o.num_cached_tokens for o in outs))
        return [(o.token_ids, o.logprobs) for o in outs]

    base = LLM(target, **engine_options)
    runs = {"alone": run(base, [[p] for p in prompts]), "batched": run(base, [prompts])}
    runs["cached_tokens"] = cached[1]
    runs["dflash"] = run(LLM(target, draft=draft, num_speculative_tokens=3, **engine_options), [prompts])
    return runs


# ---- no kernels here: the flag is refused -----------------------------------------------------------


def test_scope_nests_and_restores():
    assert not batch_invariant.is_active()
    with batch_invariant.scope():
        assert batch_invariant.is_active()
        with batch_invariant.scope(False):
            assert not batch_invariant.is_active()
        assert batch_invariant.is_active()
    assert not batch_invariant.is_active()


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    import dflash_fixtures as df

    root = tmp_path_factory.mktemp("bi")
    target = df.make_tiny_laguna_target(root / "target", seed=0, num_hidden_layers=2)
    draft = df.make_poolside_laguna_drafter(root / "draft", target, seed=0)
    return str(target), str(draft)


@pytest.mark.skipif(INTERPRETED or HAS_CUDA, reason="checks the refusal where the kernels cannot run")
def test_the_flag_is_refused_where_the_kernels_cannot_run(tiny_pair):
    with pytest.raises(ValueError, match="--batch-invariant") as err:
        LLM(tiny_pair[0], batch_invariant=True)
    assert "cuda" in str(err.value)


@pytest.mark.skipif(INTERPRETED or HAS_CUDA, reason="checks the refusal where the kernels cannot run")
def test_cli_refuses_the_flag_on_the_cpu_with_one_error_line(tiny_pair, capsys):
    from laguna_dflash.cli import main

    code = main(["generate", "--model", tiny_pair[0], "--prompt-ids", "1,2,3", "--batch-invariant"])
    err = capsys.readouterr().err
    assert code != 0 and "--batch-invariant" in err and "Traceback" not in err


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="the parent process starts the interpreter child")
def test_the_interpreter_child_passes():
    run_interpreted_child(__file__, timeout=900)


# ---- Triton's CPU interpreter (the child) ---------------------------------------------------------


@interpreted
@pytest.mark.parametrize("n,k", [(72, 96), (40, 300)])
def test_linear_rows_do_not_depend_on_the_batch_interpreted(n, k):
    check_linear("cpu", n, k)


@interpreted
def test_row_blocks_compute_as_single_block_launches_interpreted(monkeypatch):
    """``skinny_gemm_rows`` (one launch, 16-row blocks on a grid axis, split-K slabs and counters
    per block) equals ``skinny_gemm`` on each block alone with the same config, bitwise; the
    linear layer splits rows past ``MAX_ROW_BLOCKS`` blocks into more launches."""
    from laguna_dflash.kernels import skinny_gemm

    g = torch.Generator().manual_seed(3)
    x = torch.randn(45, 200, generator=g).to(torch.bfloat16)
    w = (torch.randn(40, 200, generator=g) * 0.1).to(torch.bfloat16)
    cfg = skinny_gemm.SkinnyConfig(block_n=16, block_k=32, split_k=3, use_dot=True)
    rows = skinny_gemm.skinny_gemm_rows(x, w, cfg)
    blocks = torch.cat([skinny_gemm.skinny_gemm(x[i : i + 16], w, cfg) for i in range(0, 45, 16)])
    assert torch.equal(rows, blocks)
    assert torch.equal(skinny_gemm.skinny_gemm_rows(x, w, cfg), rows)  # the workspace re-armed
    with pytest.raises(ValueError, match="use_dot=True"):
        skinny_gemm.skinny_gemm_rows(x, w, skinny_gemm.SkinnyConfig(block_n=16, block_k=32, use_dot=False))
    with pytest.raises(ValueError, match="split the rows"):
        skinny_gemm.skinny_gemm_rows(x.repeat(30, 1), w, cfg)
    full = batch_invariant.linear(x, w)
    monkeypatch.setattr(skinny_gemm, "MAX_ROW_BLOCKS", 1)  # 16 rows a launch: three launches
    assert torch.equal(batch_invariant.linear(x, w), full)


@interpreted
@pytest.mark.parametrize("kernel", ["fused", "sorted", "auto"])
def test_moe_tokens_do_not_depend_on_the_batch_interpreted(kernel):
    check_moe("cpu", hidden=32, e=5, top_k=2, inter=24, kernel=kernel)


@interpreted
@pytest.mark.parametrize("kernel", ["fused", "sorted"])
def test_moe_skipped_pairs_do_not_depend_on_the_batch_interpreted(kernel):
    check_moe_skipped_pairs("cpu", hidden=32, inter=24, kernel=kernel)


def test_moe_experts_forwards_has_skipped_pairs(monkeypatch):
    """``moe_experts(..., has_skipped_pairs=)`` reaches the kernels of either kind, ``False`` by
    default (stand-in kernels record it)."""
    seen = []

    def fake(name):
        def run(x, ids, w, gate_up, down, **kw):
            seen.append((name, kw["has_skipped_pairs"]))
            return torch.zeros(x.shape[0], ids.shape[1], x.shape[1])
        return run

    monkeypatch.setattr(batch_invariant.fused_moe, "fused_moe_experts", fake("fused"))
    monkeypatch.setattr(batch_invariant.grouped_moe, "sorted_moe_experts", fake("sorted"))
    x, ids, w = torch.zeros(3, 4), torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2)
    gate_up, down = torch.zeros(6, 8, 4), torch.zeros(6, 4, 4)
    for kernel in ("fused", "sorted"):
        monkeypatch.setattr(batch_invariant, "moe_kernel", kernel)
        for flag in (True, False):
            seen.clear()
            batch_invariant.moe_experts(x, ids, w, gate_up, down, has_skipped_pairs=flag)
            assert seen == [(kernel, flag)]
        seen.clear()
        batch_invariant.moe_experts(x, ids, w, gate_up, down)
        assert seen == [(kernel, False)]


def test_auto_moe_kernel_dispatch(monkeypatch, caplog):
    """"auto": the fused kernels up to MOE_FUSED_MAX_TOKENS tokens; above, the sorted ones only
    once the check on these weights found the same bits (run once, cached), never an unchecked
    shape during a CUDA graph capture (the check syncs); the fused ones where the bits differ,
    with a warning. The kernels are stand-ins here: this is the choice, not the math."""
    calls, outputs = [], {"fused": 1.0, "sorted": 1.0}

    def fake(name):
        def run(x, ids, w, gate_up, down, **kw):
            calls.append((name, x.shape[0]))
            return torch.full((x.shape[0], ids.shape[1], x.shape[1]), outputs[name])
        return run

    monkeypatch.setattr(batch_invariant, "_fused_experts", fake("fused"))
    monkeypatch.setattr(batch_invariant.grouped_moe, "sorted_moe_experts", fake("sorted"))
    monkeypatch.setattr(batch_invariant, "_agreement", {})
    monkeypatch.setattr(batch_invariant, "moe_kernel", "auto")
    gate_up, down = torch.zeros(6, 8, 4), torch.zeros(6, 4, 4)

    def run(t):
        calls.clear()
        x, ids, w = torch.zeros(t, 4), torch.zeros(t, 2, dtype=torch.long), torch.zeros(t, 2)
        batch_invariant.moe_experts(x, ids, w, gate_up, down)
        return list(calls)

    limit = batch_invariant.MOE_FUSED_MAX_TOKENS
    assert run(limit) == [("fused", limit)]  # no check below the switch
    monkeypatch.setattr(batch_invariant, "_capturing", lambda t: True)
    assert run(limit + 1) == [("fused", limit + 1)] and not batch_invariant._agreement
    monkeypatch.setattr(batch_invariant, "_capturing", lambda t: False)
    assert run(limit + 1) == [("fused", 37), ("sorted", 37), ("sorted", limit + 1)]  # check, then run
    assert run(500) == [("sorted", 500)]  # cached
    other = torch.zeros(6, 8, 2), torch.zeros(6, 2, 4)  # another shape: checked on its own
    outputs["sorted"] = 2.0
    gate_up, down = other
    with caplog.at_level("WARNING", logger=batch_invariant.__name__):
        assert run(500) == [("fused", 37), ("sorted", 37), ("fused", 500)]
    assert "do not give the fused kernels' bits" in caplog.text
    monkeypatch.setattr(batch_invariant, "moe_kernel", "sorted")
    assert run(1) == [("sorted", 1)]
    monkeypatch.setattr(batch_invariant, "moe_kernel", "grouped")
    with pytest.raises(ValueError, match="batch_invariant.moe_kernel='grouped': use one of"):
        run(1)


@interpreted
@pytest.mark.parametrize("window,sinks", [(None, False), (7, True)], ids=["full", "window_sinks"])
def test_attention_rows_do_not_depend_on_the_forward_interpreted(window, sinks, monkeypatch):
    # 76 keys cut every 64 (one 64-key tile a split; the engine's 128 on CUDA below): two
    # splits, and the decode at 17 sees one (the other adds exact zeros). The interpreter runs
    # each query's programs in numpy: this is 3.7x less of that work than 140 keys at 128.
    monkeypatch.setattr(pa, "INVARIANT_SPLIT_KEYS", 64)
    check_attention("cpu", length=76, num_heads=2, kv_heads=1, head_dim=16, window=window,
                    with_sinks=sinks)


@interpreted
def test_moe_layer_takes_only_the_per_token_paths_interpreted(monkeypatch):
    """Inside the scope a 1-token MoE forward takes neither the fused router GEMV nor the GEMV
    experts (their results depend on T); outside it, it does (the default fast path)."""
    from laguna_dflash.kernels import moe_gemv, moe_routing
    from laguna_dflash.models.layers import MoE

    calls = []
    for module, name in ((moe_gemv, "moe_gemv_experts"), (moe_routing, "fused_router_route"),
                         (batch_invariant, "moe_experts")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **kw: (calls.append(_name),
                                                                                  _real(*a, **kw))[1])
    torch.manual_seed(0)
    moe = MoE(32, 4, 2, 16, 16).to(torch.bfloat16).eval()
    for p in moe.parameters():
        p.data.normal_(0, 0.2)
    moe.fold_shared_expert()
    moe._fused_kernels_run = lambda x: True  # CPU: the interpreter runs the fused kernels
    x = torch.randn(1, 32).to(torch.bfloat16)
    with torch.no_grad():
        with batch_invariant.scope():
            moe(x)
        assert calls == ["moe_experts"]
        calls.clear()
        moe(x)
    assert calls == ["fused_router_route", "moe_gemv_experts"]


@interpreted
def test_torch_sdpa_backend_is_refused_interpreted(tiny_pair):
    with pytest.raises(ValueError, match="torch_sdpa"):
        LLM(tiny_pair[0], dtype="bfloat16", batch_invariant=True, attention_backend="torch_sdpa")


@interpreted
@pytest.mark.parametrize("fused_max_tokens", [64, 8], ids=["fused_moe", "auto_switch_at_8"])
def test_engine_greedy_tokens_and_logprobs_do_not_depend_on_the_batch_interpreted(
        tiny_pair, monkeypatch, fused_max_tokens):
    """At 8 the "auto" MoE mixes its kernels inside one generation: prompts of 11 and 19 tokens
    and the DFlash verifies (12 rows) take the sorted kernels, decodes and the 5-token prompt
    the fused ones; the agreement check then runs inside an engine forward."""
    from laguna_dflash.models.layers import Attention

    # the fused Q/K norm + RoPE kernel is per token either way; its interpreted run is slow
    monkeypatch.setattr(Attention, "use_fused_qk_cache", False)
    monkeypatch.setattr(batch_invariant, "MOE_FUSED_MAX_TOKENS", fused_max_tokens)
    monkeypatch.setattr(batch_invariant, "_agreement", {})
    rng = random.Random(0)
    prompts = [[rng.randrange(64) for _ in range(n)] for n in (11, 19, 5)]
    runs = greedy_runs(*tiny_pair, prompts, 5, dtype="bfloat16", batch_invariant=True)
    assert runs["alone"] == runs["batched"] == runs["dflash"]
    assert runs["cached_tokens"] == 16  # the batch's 19-token prompt: a cache hit, bitwise equal
    assert all(len(ids) == 5 for ids, _ in runs["alone"])
    # the sorted kernels ran (after the check) only where forwards passed the switch
    assert list(batch_invariant._agreement.values()) == ([True] if fused_max_tokens < 35 else [])


# ---- CUDA, Laguna-XS-2.1 widths -------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("n,k", [(10304, 2048), (2048, 8192), (256, 2048), (100352, 2048)],
                         ids=["qkvg", "o_proj", "router", "lm_head"])
def test_linear_rows_do_not_depend_on_the_batch_cuda(n, k):
    check_linear("cuda", n, k)


@cuda
@pytest.mark.parametrize("kernel", ["fused", "sorted", "auto"])
def test_moe_tokens_do_not_depend_on_the_batch_cuda(kernel):
    check_moe("cuda", hidden=2048, e=8, top_k=3, inter=512, kernel=kernel)


@cuda
@pytest.mark.parametrize("kernel", ["fused", "sorted"])
def test_moe_skipped_pairs_do_not_depend_on_the_batch_cuda(kernel):
    check_moe_skipped_pairs("cuda", hidden=2048, inter=512, kernel=kernel)


@cuda
@pytest.mark.parametrize("heads,window,sinks", [(64, None, False), (48, 512, True)],
                         ids=["full64", "window48_sinks"])
def test_attention_rows_do_not_depend_on_the_forward_cuda(heads, window, sinks):
    check_attention("cuda", length=700, num_heads=heads, kv_heads=8, head_dim=128, window=window,
                    with_sinks=sinks)


@cuda
def test_xs_widths_bf16_tokens_do_not_depend_on_the_batch_cuda(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_cuda_xs_lossless import _write_pair

    target, draft = _write_pair(tmp_path, "xs21")
    rng = random.Random(0)
    long = [rng.randrange(100, 4000) for _ in range(700)]
    prompts = [long, long[:300], [rng.randrange(100, 4000) for _ in range(40)], long[:9]]
    common = dict(dtype="bfloat16", device="cuda", load_format="dummy", max_model_len=1024,
                  max_num_seqs=4, num_kv_blocks=(1024 // 16 + 1) * 5)
    runs = greedy_runs(target, draft, prompts, 16, batch_invariant=True, **common)
    assert runs["alone"] == runs["batched"] == runs["dflash"]
    # the batch's prompts of 700, 300 and 40 tokens hit the prefix cache (the tails computed
    # after cached blocks give the whole prompts' bits: 688 + 288 + 32 tokens cached)
    assert runs["cached_tokens"] == 688 + 288 + 32, runs["cached_tokens"]
    default = greedy_runs(target, draft, prompts, 16, **common)
    parted = sum(a != b for name in ("batched", "dflash")
                 for a, b in zip(default["alone"], default[name]))
    print(f"default kernels: {parted} of {2 * len(prompts)} (prompt, run) pairs differ from the "
          "prompt alone in tokens or logprobs")


@cuda
def test_xs_widths_eager_graphs_and_seeded_sampling_agree_cuda(tmp_path):
    """The mode holds off the graph path and at temperature > 0 too: with ``enforce_eager`` the
    tokens and logprobs are the graphed engine's bitwise, and seeded sampled requests (each its
    own generator) draw the same tokens alone and batched."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_cuda_xs_lossless import _write_pair

    target, _ = _write_pair(tmp_path, "xs21")
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 4000) for _ in range(n)] for n in (500, 37, 9)]
    common = dict(dtype="bfloat16", device="cuda", load_format="dummy", max_model_len=1024,
                  max_num_seqs=4, batch_invariant=True)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)

    def run(llm: LLM, batch: list[list[int]], params) -> list:
        return [(o.token_ids, o.logprobs) for o in llm.generate(prompt_token_ids=batch, sampling_params=params)]

    graphed, eager = LLM(target, **common), LLM(target, enforce_eager=True, **common)
    assert graphed.engine.runner.graphs is not None and eager.engine.runner.graphs is None
    assert run(eager, prompts, greedy) == run(graphed, prompts, greedy)
    sampled = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12, ignore_eos=True, seed=7 + i)
               for i in range(len(prompts))]
    alone = [run(graphed, [p], [s])[0] for p, s in zip(prompts, sampled)]
    assert alone == run(graphed, prompts, sampled)
    assert [ids for ids, _ in alone] != [ids for ids, _ in run(graphed, prompts, greedy)]  # it sampled
