"""The GPU fast path at the layer level: weight re-layout and the fused kernels inside the layers.

* ``fuse_for_inference`` (the engine runs it on CUDA) keeps every parameter's values: Q|K|V|gate
  become one GEMM weight whose row views are the old parameters, the shared expert is stacked
  after the routed experts; CPU outputs stay the same.
* Under Triton's CPU interpreter (ONE child process, the variable must not reach other tests):
  ``MoE.fused_forward`` (the router GEMM + routing kernel, or the two apart; fused experts with
  the folded shared expert; the pairs' sum with the residual) equals the torch path, folded or
  not; ``Attention.forward`` with the fused Q/K norm + RoPE + cache-write kernel and the gate in
  the attention store equals the eager chain (output and cache contents), and so does it inside a
  CUDA-graph build, where a forward from ``Attention.fuse_qk_min_tokens`` (2 there) to 16 tokens
  takes the projection with the Q/K work in its epilogue (kernels/qkv_norm_rope_cache.py) and a
  1-token one does not.
* On CUDA: the same comparisons at Laguna-XS-2.1 widths.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import sys

import pytest
import torch
from interpreter_child import interpreter_script_json

from laguna_dflash.engine.attention import TorchSDPABackend
from laguna_dflash.engine.runner import ForwardItem, build_metadata
from laguna_dflash.engine.triton_attention import TritonPagedBackend
from laguna_dflash.kernels.availability import triton_importable
from laguna_dflash.models import fusion, layers
from laguna_dflash.models.layers import Attention, ForwardContext, MoE, fuse_for_inference
from laguna_dflash.models.rope import RopeSpec, RotaryEmbedding

TOL = {"float32": 1e-5, "bfloat16": 3e-2}


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item()


def _moe(hidden: int, e: int, k: int, inter: int, shared: int, dtype: torch.dtype, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(hidden, e, k, inter, shared, routed_scaling_factor=2.5)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, hidden**-0.5)
        moe.e_score_correction_bias.uniform_(-0.1, 0.1)
    return moe.to(dtype).eval()


def _attention(hidden: int, heads: int, kv_heads: int, head_dim: int, rot: float, window: int | None,
               gating: str | None, dtype: torch.dtype, seed: int = 0) -> Attention:
    torch.manual_seed(seed)
    rotary = RotaryEmbedding(RopeSpec(head_dim=head_dim, theta=10000.0, partial_rotary_factor=rot))
    rotary.ensure(512)
    attn = Attention(hidden, heads, kv_heads, head_dim, rotary, cache_index=0, sliding_window=window,
                     gating=gating)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, hidden**-0.5)
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.weight.uniform_(0.5, 1.5)
    return attn.to(dtype).eval()


def _context(specs: list[tuple[int, int]], kv_heads: int, head_dim: int, dtype: torch.dtype,
             device: str, seed: int = 0) -> ForwardContext:
    """Random caches and metadata for requests ``(context_len, new_tokens)`` (block size 16)."""
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-(c + n) // 16) for c, n in specs)
    perm = torch.randperm(need + 2, generator=g).tolist()
    items = [ForwardItem(n, c, c + n, [perm.pop() for _ in range(-(-(c + n) // 16))]) for c, n in specs]
    num_slots = (need + 3) * 16
    meta = build_metadata(items, 16, num_slots - 16, torch.device(device))
    caches = [(torch.randn(num_slots, kv_heads, head_dim, generator=g).to(device=device, dtype=dtype),
               torch.randn(num_slots, kv_heads, head_dim, generator=g).to(device=device, dtype=dtype))]
    return ForwardContext(meta=meta, kv_caches=caches, backend=TorchSDPABackend())


# ----------------------------------------------------------------------------- re-layout (CPU)


def test_fold_shared_expert_keeps_values_and_outputs() -> None:
    moe = _moe(32, 8, 2, 16, 16, torch.float32)
    before = {n: p.detach().clone() for n, p in moe.named_parameters()}
    x = torch.randn(5, 32)
    with torch.no_grad():
        want = moe(x)
        fuse_for_inference(moe)
        got = moe(x, keep_pairs=True)  # CPU: the reference path, summed
    assert torch.equal(got, want)
    assert {n: p for n, p in moe.named_parameters()}.keys() == before.keys()
    for n, p in moe.named_parameters():
        assert torch.equal(p, before[n]), n
    stacked = moe.gate_up_with_shared
    assert stacked.shape == (9, 32, 32)
    assert moe.experts_gate_up.data_ptr() == stacked.data_ptr()  # views, no second copy
    assert moe.shared_expert.gate_up_proj.weight.data_ptr() == stacked[8].data_ptr()
    assert moe.shared_expert.down_proj.weight.data_ptr() == moe.down_with_shared[8].data_ptr()


def test_fold_needs_a_shared_expert_of_the_expert_width() -> None:
    moe = _moe(32, 8, 2, 16, 24, torch.float32)
    fuse_for_inference(moe)
    assert moe.gate_up_with_shared is None
    moe = _moe(32, 8, 2, 16, 0, torch.float32)
    fuse_for_inference(moe)
    assert moe.gate_up_with_shared is None


def _decoder_layers(gatings: list[str | None], sparse: list[bool]) -> torch.nn.ModuleList:
    out = []
    for i, (gating, is_moe) in enumerate(zip(gatings, sparse, strict=True)):
        attn = _attention(32, 4, 2, 8, 1.0, None, gating, torch.float32, seed=i)
        mlp = _moe(32, 8, 2, 16, 16, torch.float32, seed=i) if is_moe else layers.MLP(32, 64)
        out.append(layers.DecoderLayer(attn, mlp, 32, 1e-6))
    return torch.nn.ModuleList(out)


def test_fusing_links_each_moe_to_the_next_layers_qkvg_weight() -> None:
    """``fuse_for_inference`` points every sparse layer's router prefetch at the weight the next
    layer's first GEMM reads: the fused Q|K|V|gate one, or Q|K|V without gating; the last
    layer's at nothing."""
    model = torch.nn.Module()
    model.layers = _decoder_layers(["per-head", "per-head", None, "per-element"], [False, True, True, True])
    fuse_for_inference(model)
    attn = [layer.self_attn for layer in model.layers]
    mlps = [layer.mlp for layer in model.layers]
    assert not hasattr(mlps[0], "prefetch_next")  # a dense layer
    assert attn[2].qkvg_weight is None and attn[3].qkvg_weight is not None
    for moe, weight in ((mlps[1], attn[2].qkv_proj.weight), (mlps[2], attn[3].qkvg_weight)):
        assert moe.prefetch_next.data_ptr() == weight.data_ptr() and moe.prefetch_next.shape == weight.shape
        assert not isinstance(moe.prefetch_next, torch.nn.Parameter)
    assert mlps[3].prefetch_next is None
    # not registered: each parameter still belongs to one module
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert not any("prefetch" in n for n in names)
    assert MoE.prefetch_next_bytes > 0 and MoE.prefetch_next_max_tokens == 4  # on: decode and verify
    # lists of other modules (a drafter's, an empty one) are left alone
    other = torch.nn.Module()
    other.blocks, other.empty = torch.nn.ModuleList([torch.nn.Linear(4, 4)]), torch.nn.ModuleList()
    fuse_for_inference(other)


def test_router_gets_the_configured_region_of_the_next_weight(monkeypatch) -> None:
    """With ``prefetch_next_bytes`` set, the fused router is handed that many bytes of the next
    layer's weight: the end of every row (``prefetch_next_rows``), else its tail (or its head with
    ``prefetch_next_from_end`` False); with it 0, or past ``prefetch_next_max_tokens``, nothing."""
    from laguna_dflash.kernels import l2_prefetch, moe_routing

    class Called(Exception):
        pass

    seen = []

    def spy(*args, prefetch=None, **kwargs):
        seen.append(prefetch)
        raise Called

    moe = _moe(32, 8, 2, 16, 16, torch.float32)
    moe.prefetch_next = torch.randn(40, 32)  # 5120 bytes, rows of 128
    monkeypatch.setattr(moe_routing, "can_fuse_router", lambda x, w: True)
    monkeypatch.setattr(moe_routing, "fused_router_route", spy)
    x = torch.randn(1, 32)
    for nbytes, rows, from_end in ((0, True, True), (2000, True, True), (1000, False, True),
                                   (1000, False, False), (10**9, False, True), (1000, False, True)):
        if len(seen) == 5:
            monkeypatch.setattr(MoE, "prefetch_next_max_tokens", 1)
            x = torch.randn(2, 32)  # past prefetch_next_max_tokens: nothing
        monkeypatch.setattr(MoE, "prefetch_next_bytes", nbytes)
        monkeypatch.setattr(MoE, "prefetch_next_rows", rows)
        monkeypatch.setattr(MoE, "prefetch_next_from_end", from_end)
        with pytest.raises(Called):
            moe.fused_forward(x)
    flat = moe.prefetch_next.reshape(-1)
    assert seen[0] is None
    # 2000 bytes over 40 rows: the last 48 bytes (50 rounded down to 16) of each row of 128
    assert isinstance(seen[1], l2_prefetch.Spread)
    assert (seen[1].stride, seen[1].size, seen[1].num_pieces) == (128, 48, 40)
    assert seen[1].base.data_ptr() == flat[20:].data_ptr()
    # 1000 bytes -> 992 (a whole number of 16-byte units): 248 floats
    assert seen[2].data_ptr() == flat[-248:].data_ptr() and seen[2].numel() == 248
    assert seen[3].data_ptr() == flat.data_ptr() and seen[3].numel() == 248
    assert seen[4].numel() == flat.numel()
    assert seen[5] is None
    # the same switches again: the same region object (kept), a new weight: a new one
    monkeypatch.setattr(MoE, "prefetch_next_max_tokens", 4)
    for _ in range(2):
        with pytest.raises(Called):
            moe.fused_forward(x)
    assert seen[6] is seen[7] and seen[6].data_ptr() == flat[-248:].data_ptr()
    moe.prefetch_next = torch.randn(40, 32)
    with pytest.raises(Called):
        moe.fused_forward(x)
    assert seen[8].data_ptr() == moe.prefetch_next.reshape(-1)[-248:].data_ptr()


@pytest.mark.parametrize("gating", ["per-head", "per-element"])
def test_fuse_projections_keeps_values_and_outputs(gating: str) -> None:
    attn = _attention(64, 4, 2, 16, 1.0, None, gating, torch.float32)
    before = {n: p.detach().clone() for n, p in attn.named_parameters()}
    x = torch.randn(6, 64)
    ctx = _context([(3, 2), (20, 4)], 2, 16, torch.float32, "cpu")
    caches = [c.clone() for c in ctx.kv_caches[0]]
    with torch.no_grad():
        want = attn(x, ctx)
        want_caches = [c.clone() for c in ctx.kv_caches[0]]
        ctx.kv_caches[0] = tuple(c.clone() for c in caches)
        fuse_for_inference(attn)
        got = attn(x, ctx)
    assert attn.qkvg_weight is not None
    assert attn.qkv_proj.weight.data_ptr() == attn.qkvg_weight.data_ptr()
    for n, p in attn.named_parameters():
        assert torch.equal(p, before[n]), n
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for c, w in zip(ctx.kv_caches[0], want_caches):
        torch.testing.assert_close(c, w, rtol=1e-5, atol=1e-6)


def test_ungated_attention_is_not_refused() -> None:
    attn = _attention(64, 4, 2, 16, 1.0, None, None, torch.float32)
    fuse_for_inference(attn)
    assert attn.qkvg_weight is None


# ----------------------------------------------------------------------------- kernels in the layers


def _moe_cases(device: str) -> dict[str, float]:
    """Relative error of ``MoE.fused_forward`` against the torch path (an fp32 copy) per case."""
    errors = {}
    for dtype in (torch.float32, torch.bfloat16):
        for fold in (False, True):
            for t in (1, 3):
                moe = _moe(48, 16, 4, 24, 24, dtype, seed=t).to(device)
                ref = copy.deepcopy(moe).float()
                ref.use_fused_moe = False
                x = torch.randn(t, 48, dtype=dtype, device=device)
                residual = torch.randn(t, 48, dtype=dtype, device=device)
                with torch.no_grad():
                    want = residual.float() + ref(x.float())
                    if fold:
                        fuse_for_inference(moe)
                    summed = fusion.add(residual, moe.fused_forward(x))
                    deferred = fusion.add_rms_norm(residual, moe.fused_forward(x, keep_pairs=True),
                                                   torch.ones_like(residual[0]), 1e-6)[0]
                    moe.use_fused_router = False  # router GEMM and routing kernel apart
                    two_launch = fusion.add(residual, moe.fused_forward(x))
                name = f"moe-{dtype}-fold{fold}-T{t}"
                errors[name] = _rel_err(summed, want)
                errors[name + "-deferred"] = _rel_err(deferred, want)
                errors[name + "-unfused-router"] = _rel_err(two_launch, want)
    return errors


def _attention_cases(device: str) -> dict[str, float]:
    """Relative error of ``Attention.forward`` with the fused Q/K/cache kernel and fused gate
    against the eager chain, for the output and the written cache rows."""
    errors = {}
    for dtype in (torch.float32, torch.bfloat16):
        for rot, window, gating in ((1.0, None, "per-head"), (0.5, 16, "per-head"), (1.0, None, "per-element")):
            attn = _attention(64, 8, 2, 32, rot, window, gating, dtype, seed=int(rot * 10)).to(device)
            attn.rotary.to(device)
            x = torch.randn(6, 64, dtype=dtype, device=device)
            ctx = _context([(3, 2), (40, 4)], 2, 32, dtype, device)
            caches = [c.clone() for c in ctx.kv_caches[0]]
            name = f"attn-{dtype}-rot{rot}-w{window}-{gating}"
            with torch.no_grad():
                attn.use_fused_qk_cache = False
                want = attn(x, ctx)
                want_caches = [c.clone() for c in ctx.kv_caches[0]]
                ctx.kv_caches[0] = tuple(c.clone() for c in caches)
                attn.use_fused_qk_cache = True
                fuse_for_inference(attn)
                ctx.backend = TritonPagedBackend()
                got = attn(x, ctx)
            errors[name] = _rel_err(got, want)
            slots = ctx.meta.slot_mapping
            errors[name + "-cache"] = max(_rel_err(c[slots], w[slots]) for c, w in zip(ctx.kv_caches[0], want_caches))
            untouched = torch.ones(caches[0].shape[0], dtype=torch.bool, device=device)
            untouched[slots] = False
            errors[name + "-untouched"] = float(not all(
                torch.equal(c[untouched], w[untouched]) for c, w in zip(ctx.kv_caches[0], want_caches)))
            errors.update(_head_gemm_case(name, attn, x, ctx, caches, want, want_caches))
    return errors


def _head_gemm_case(name: str, attn: Attention, x: torch.Tensor, ctx: ForwardContext, caches: list,
                    want: torch.Tensor, want_caches: list) -> dict[str, float]:
    """The same forward inside a CUDA-graph build, where ``Attention.fuse_qk_min_tokens`` (set
    to 2 here) hands Q|K|V|gate with the Q/K norm, RoPE and cache write to ONE kernel
    (kernels/qkv_norm_rope_cache.py): it must run for these 6 tokens, match the eager chain, and
    not run for a 1-token forward."""
    from laguna_dflash.kernels import qkv_norm_rope_cache as head_gemm

    rows = []
    kernel, min_tokens = head_gemm.qkv_norm_rope_cache, Attention.fuse_qk_min_tokens
    head_gemm.qkv_norm_rope_cache = lambda x, *a, **kw: rows.append(x.shape[0]) or kernel(x, *a, **kw)
    Attention.fuse_qk_min_tokens = 2
    try:
        ctx.kv_caches[0] = tuple(c.clone() for c in caches)
        with torch.no_grad(), layers.building_cuda_graph():
            got = attn(x, ctx)
            one_ctx = _context([(5, 1)], *caches[0].shape[1:], x.dtype, str(x.device))
            attn(x[:1], one_ctx)
    finally:
        head_gemm.qkv_norm_rope_cache, Attention.fuse_qk_min_tokens = kernel, min_tokens
    slots = ctx.meta.slot_mapping
    untouched = torch.ones(caches[0].shape[0], dtype=torch.bool, device=x.device)
    untouched[slots] = False
    name += "-head-gemm"
    return {
        name: _rel_err(got, want),
        name + "-cache": max(_rel_err(c[slots], w[slots]) for c, w in zip(ctx.kv_caches[0], want_caches)),
        name + "-untouched": float(not all(
            torch.equal(c[untouched], w[untouched]) for c, w in zip(ctx.kv_caches[0], want_caches))),
        name + "-ran-for-6-not-1-token": float(rows != [6]),
    }


def _case_tol(name: str) -> float:
    if name.endswith(("-untouched", "-token")):
        return 0.0
    return TOL["bfloat16" if "bfloat16" in name else "float32"] * (3 if name.startswith("moe") else 1)


@pytest.fixture(scope="module")
def interpreter_errors() -> dict[str, float]:
    if not triton_importable():
        pytest.skip("triton is not installed")
    return interpreter_script_json(__file__, timeout=600)


def test_layers_under_triton_interpreter_match_eager(interpreter_errors: dict[str, float]) -> None:
    assert len(interpreter_errors) == 24 + 18 + 24
    bad = {n: e for n, e in interpreter_errors.items() if not e <= _case_tol(n)}
    assert not bad, bad


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_layers_on_cuda_match_eager() -> None:
    errors = {**_moe_cases("cuda"), **_attention_cases("cuda")}
    bad = {n: e for n, e in errors.items() if not e <= _case_tol(n)}
    assert not bad, bad


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fusing_leaves_no_reserved_memory_behind_on_cuda() -> None:
    """Folding each layer's shared expert allocates new stacks and frees the old ones; with the
    freed segments kept cached, the next layer's down stack (half a gate_up stack) split the
    previous gate_up segment and the other half stayed reserved, counted in use when the KV
    cache is sized (17.7 GiB at XS-2.1 size). After fuse_for_inference and an empty_cache torch
    holds (almost) no reserved memory that no tensor uses: without the per-module empty_cache,
    ~3 x 31 MiB (three down stacks in freed gate_up segments). Not yet run on a GPU."""
    layers = torch.nn.ModuleList(
        [_moe(1024, 32, 2, 512, 512, torch.bfloat16, seed=i).cuda() for i in range(4)])
    gc.collect()
    torch.cuda.empty_cache()
    fuse_for_inference(layers)
    gc.collect()
    torch.cuda.empty_cache()  # as the engine does after fusing: releases whole free segments only
    idle = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    down_stack = 33 * 1024 * 512 * 2  # bytes of one layer's stacked down experts
    assert idle < down_stack, (idle / 2**20, down_stack / 2**20)


if __name__ == "__main__" and sys.argv[1:] == ["--interpreter-cases"]:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    print(json.dumps({**_moe_cases("cpu"), **_attention_cases("cpu")}))
