"""Context-K/V kernel (``kernels/context_kv.py``): grouped K-RMSNorm + RoPE + paged-cache writes.

* the torch reference equals the drafter's own ``precompute_and_store_context_kv`` bit for bit
  (both flavours, fp32 and bf16, several shapes, strided slot mappings);
* the Triton kernel equals the reference under Triton's CPU interpreter (``TRITON_INTERPRET=1``,
  set with monkeypatch: triton reads it when a kernel is decorated, and the module builds one
  kernel per mode, so nothing leaks into other tests);
* on CUDA, the kernel (through the model's hook) equals the reference and the torch path.
"""

from __future__ import annotations

import pytest
import torch
from interpreter_child import HAS_TRITON, INTERPRETED, interpreted, run_interpreted_child

from laguna_dflash.kernels import context_kv as ckv
from laguna_dflash.models.dflash import DFlashDraftModel, qwen3_draft_spec
from laguna_dflash.models.laguna_dflash import DFlashLaguna, laguna_draft_spec
from laguna_dflash.models.random_init import randomize_
from laguna_dflash.models.rope import RopeSpec, RotaryEmbedding

HAS_CUDA = torch.cuda.is_available()
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5},
       torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2},  # one bf16 ulp
       torch.float16: {"rtol": 2e-3, "atol": 2e-3}}

# (flavour, drafter layers, kv heads, head_dim, partial_rotary_factor)
SHAPES = [
    ("laguna", 3, 8, 128, 1.0),
    ("laguna", 2, 1, 64, 0.5),
    ("qwen3", 2, 2, 64, 1.0),
    ("qwen3", 4, 8, 64, 0.5),
]


def draft_config(layers: int, kv_heads: int, head_dim: int, partial: float, hidden: int = 64) -> dict:
    return {
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": 8, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "partial_rotary_factor": partial,
        "max_position_embeddings": 4096, "sliding_window": 16,
        "layer_types": ["sliding_attention"] * layers, "gating": "per-head", "num_experts": 0,
        "vocab_size": 64, "draft_vocab_size": 64,
        "dflash_config": {"block_size": 8, "mask_token_id": 3, "num_target_layers": 4,
                          "target_layer_ids": [1, 2], "causal": True},
    }


def build(flavour: str, layers: int, kv_heads: int, head_dim: int, partial: float,
          dtype: torch.dtype, device: str = "cpu", hidden: int = 64):
    cfg = draft_config(layers, kv_heads, head_dim, partial, hidden)
    if flavour == "laguna":
        model = DFlashLaguna(laguna_draft_spec(cfg, {}, None))
    else:
        model = DFlashDraftModel(qwen3_draft_spec(cfg, None))
    with torch.no_grad():
        randomize_(model, seed=layers * 100 + kv_heads)
    model = model.to(device=device, dtype=dtype).eval()
    model._build_context_kv_buffers()
    model.prepare_rope(512, device)
    assert model.rotary.spec.rotary_dim == int(head_dim * partial)
    return model


def inputs(model, n: int, num_slots: int, device: str = "cpu"):
    """Context rows, positions and a NON-contiguous slot mapping (every other entry of a
    permutation); plus caches pre-filled with a sentinel so stray writes show."""
    g = torch.Generator().manual_seed(n)
    dtype = model.fc.weight.dtype
    context = (3 * torch.randn(n, model.spec.hidden_size, generator=g)).to(device=device, dtype=dtype)
    positions = torch.randint(0, 500, (n,), generator=g).to(device)
    slots = torch.randperm(num_slots, generator=g)[: 2 * n].to(device)[::2]
    assert n == 1 or not slots.is_contiguous()
    return context, positions, slots


def caches(model, num_slots: int, dtype: torch.dtype | None = None):
    dtype = dtype or model.fc.weight.dtype
    device = model.fc.weight.device
    shape = (num_slots, model.num_kv_heads, model.head_dim)
    return [(torch.full(shape, 7.0, dtype=dtype, device=device), torch.full(shape, -7.0, dtype=dtype, device=device))
            for _ in model.layers]


def run_reference(model, context, positions, slots, kv) -> None:
    k, v = model._project_context_kv(context)
    ckv.context_kv_reference(k, v, model.context_k_norm_weight, model.spec.rms_norm_eps,
                             model.rotary.cos, model.rotary.sin, positions, slots, kv)


def run_kernel(model, context, positions, slots, kv) -> None:
    k, v = model._project_context_kv(context)  # strided views of the one GEMM output
    assert not k.is_contiguous()
    ckv.fused_context_kv_(k, v, model.context_k_norm_weight, model.spec.rms_norm_eps,
                          model.rotary.cos, model.rotary.sin, positions, slots, kv)


def assert_caches(got, want, slots, exact: bool, dtype: torch.dtype) -> None:
    untouched = torch.ones(got[0][0].shape[0], dtype=torch.bool, device=slots.device)
    untouched[slots] = False
    for (kg, vg), (kw, vw) in zip(got, want):
        if exact:
            assert torch.equal(kg, kw) and torch.equal(vg, vw)
        else:
            torch.testing.assert_close(kg[slots], kw[slots], **TOL[dtype])
            torch.testing.assert_close(vg[slots], vw[slots], rtol=0, atol=0)  # V is a plain copy
        assert (kg[untouched] == 7).all() and (vg[untouched] == -7).all()


# ---- reference == the model's torch path ------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_reference_equals_model_path(shape, dtype, monkeypatch):
    # the hook must keep the torch path on CPU (also in the TRITON_INTERPRET=1 child)
    monkeypatch.setattr(ckv, "fused_context_kv_", lambda *a, **k: pytest.fail("fused path on CPU"))
    model = build(*shape, dtype)
    context, positions, slots = inputs(model, 13, 64)
    kv_model, kv_ref = caches(model, 64), caches(model, 64)
    model.precompute_and_store_context_kv(context, positions, slots, kv_model)
    run_reference(model, context, positions, slots, kv_ref)
    assert_caches(kv_ref, kv_model, slots, exact=True, dtype=dtype)


def test_reference_matches_per_layer_loop():
    """Semantics anchor independent of the fused GEMM: the per-layer reference of the model."""
    model = build("laguna", 3, 2, 64, 0.5, torch.float32)
    context, positions, slots = inputs(model, 9, 32)
    kv = caches(model, 32)
    run_reference(model, context, positions, slots, kv)
    for (k_ref, v_ref), (kc, vc) in zip(model.reference_context_kv(context, positions), kv):
        torch.testing.assert_close(kc[slots], k_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vc[slots], v_ref, rtol=1e-5, atol=1e-5)


# ---- Triton kernel (CPU interpreter) == reference ---------------------------------------------------
#
# Triton's interpreter needs TRITON_INTERPRET=1 before triton is imported (its standard-library
# functions such as tl.sum are decorated at import, and the package imports triton early), so the
# interpreted tests run in a child pytest with the variable set; in this process they skip.



@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="triton not installed / already the child")
def test_kernel_under_triton_interpreter():
    run_interpreted_child(__file__)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_kernel_interpreted_equals_reference(shape, dtype):
    assert ckv.is_available("cpu")
    model = build(*shape, dtype)
    context, positions, slots = inputs(model, 7, 32)
    kv_kernel, kv_ref = caches(model, 32), caches(model, 32)
    run_kernel(model, context, positions, slots, kv_kernel)
    run_reference(model, context, positions, slots, kv_ref)
    assert_caches(kv_kernel, kv_ref, slots, exact=False, dtype=dtype)


@interpreted
@pytest.mark.parametrize("in_dtype,cache_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                                  (torch.float16, torch.float16)])
def test_kernel_interpreted_dtype_mix(in_dtype, cache_dtype):
    """Raw tensors: bf16 K/V into an fp32 cache and the reverse, fp16, int32 slots/positions."""
    g = torch.Generator().manual_seed(1)
    layers, n, heads, hd = 2, 5, 2, 64
    gemm = (2 * torch.randn(n, layers, 2, heads, hd, generator=g)).to(in_dtype)
    k, v = gemm.permute(2, 1, 0, 3, 4).unbind(0)
    w = (1 + 0.1 * torch.randn(layers, hd, generator=g)).to(in_dtype)
    rope = RotaryEmbedding(RopeSpec(hd, 10000.0))
    rope.ensure(64)
    positions = torch.randint(0, 64, (n,), generator=g, dtype=torch.int32)
    slots = torch.randperm(16, generator=g)[:n].to(torch.int32)
    shape = (16, heads, hd)
    kv_ref = [(torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)) for _ in range(layers)]
    kv_kernel = [(a.clone(), b.clone()) for a, b in kv_ref]
    ckv.context_kv_reference(k, v, w, 1e-6, rope.cos, rope.sin, positions.long(), slots.long(), kv_ref)
    ckv.fused_context_kv_(k, v, w, 1e-6, rope.cos, rope.sin, positions, slots, kv_kernel)
    tol = TOL[torch.bfloat16] if torch.bfloat16 in (in_dtype, cache_dtype) else TOL[in_dtype]
    for (a, b), (c, d) in zip(kv_kernel, kv_ref):
        torch.testing.assert_close(a, c, **tol)
        torch.testing.assert_close(b, d, rtol=0, atol=0)


def s21_drafter_problem(n: int, kv_heads: int, dtype: torch.dtype, device: str = "cpu", num_slots: int = 64):
    """The S-2.1 drafter's context K/V: 6 layers, hidden 3072, ``kv_heads`` (8; 4 a rank under
    2-way TP) x 128, theta 5e5 full rotary. K and V are the strided views ``_split_context_kv``
    makes of ONE GEMM ``[N, 3072] @ [6 * 2 * kv * 128, 3072]^T``; caches pre-filled (7 / -7).
    Returns (k, v, k_norm_weight, rope, positions, slots, caches)."""
    layers, hidden, hd = 6, 3072, 128
    g = torch.Generator().manual_seed(n + kv_heads)
    context = torch.randn(n, hidden, generator=g).to(device, dtype)
    weight = (torch.randn(layers * 2 * kv_heads * hd, hidden, generator=g) * hidden**-0.5).to(device, dtype)
    kv = torch.nn.functional.linear(context, weight)
    k, v = kv.view(n, layers, 2, kv_heads, hd).permute(2, 1, 0, 3, 4)  # as DFlashDraftModel._split_context_kv
    w = (1 + 0.1 * torch.randn(layers, hd, generator=g)).to(device, dtype)
    rope = RotaryEmbedding(RopeSpec(hd, 500000.0), device)
    rope.ensure(4096)
    positions = torch.randint(0, 4096, (n,), generator=g).to(device)
    slots = torch.randperm(num_slots, generator=g)[:n].to(device)
    shape = (num_slots, kv_heads, hd)
    kv_caches = [(torch.full(shape, 7.0, dtype=dtype, device=device), torch.full(shape, -7.0, dtype=dtype, device=device))
                 for _ in range(layers)]
    return k, v, w, rope, positions, slots, kv_caches


def s21_check(n: int, kv_heads: int, dtype: torch.dtype, device: str = "cpu", num_slots: int = 64) -> None:
    k, v, w, rope, positions, slots, kv_kernel = s21_drafter_problem(n, kv_heads, dtype, device, num_slots)
    assert not k.is_contiguous()
    kv_ref = [(a.clone(), b.clone()) for a, b in kv_kernel]
    ckv.context_kv_reference(k, v, w, 1e-6, rope.cos, rope.sin, positions, slots, kv_ref)
    ckv.fused_context_kv_(k, v, w, 1e-6, rope.cos, rope.sin, positions, slots, kv_kernel)
    assert_caches(kv_kernel, kv_ref, slots, exact=False, dtype=dtype)


@interpreted
@pytest.mark.parametrize("kv_heads,dtype", [(8, torch.bfloat16), (4, torch.float32)], ids=["s21", "s21_tp2"])
def test_kernel_interpreted_s21_drafter(kv_heads, dtype):
    """The S-2.1 drafter's 6 layers x hidden 3072 context K/V (one program a row and layer)."""
    s21_check(3, kv_heads, dtype)


def test_fused_rejects_bad_inputs():
    k = torch.zeros(2, 3, 1, 8)
    cos = torch.zeros(4, 8)
    pos, slots = torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long)
    kv = [(torch.zeros(4, 1, 8), torch.zeros(4, 1, 8))]
    with pytest.raises(ValueError, match="cache layers"):
        ckv.fused_context_kv_(k, k, torch.ones(2, 8), 1e-6, cos, cos, pos, slots, kv)
    with pytest.raises(ValueError, match="rotary_dim"):
        ckv.fused_context_kv_(k, k, torch.ones(2, 8), 1e-6, torch.zeros(4, 3), torch.zeros(4, 3), pos, slots, kv * 2)


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="triton not installed / interpreter on")
def test_is_available_without_interpreter():
    assert not ckv.is_available("cpu")


# ---- CUDA -------------------------------------------------------------------------------------------


@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON) or INTERPRETED, reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES + [("laguna", 5, 8, 128, 1.0), ("qwen3", 5, 8, 128, 1.0)],
                         ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("n", [1, 16, 700])
def test_kernel_cuda_equals_reference(shape, dtype, n, monkeypatch):
    hidden = 2048 if shape[3] == 128 and shape[1] == 5 else 64
    model = build(*shape, dtype, device="cuda", hidden=hidden)
    calls = []
    fused = ckv.fused_context_kv_
    monkeypatch.setattr(ckv, "fused_context_kv_", lambda *a: calls.append(1) or fused(*a))
    context, positions, slots = inputs(model, n, 2048, device="cuda")
    kv_hook, kv_ref, kv_torch = caches(model, 2048), caches(model, 2048), caches(model, 2048)
    model.precompute_and_store_context_kv(context, positions, slots, kv_hook)
    assert calls, "the model hook did not take the Triton path on CUDA"
    run_reference(model, context, positions, slots, kv_ref)
    model.use_triton_context_kv = False
    model.precompute_and_store_context_kv(context, positions, slots, kv_torch)
    assert len(calls) == 1
    assert_caches(kv_torch, kv_ref, slots, exact=True, dtype=dtype)
    assert_caches(kv_hook, kv_ref, slots, exact=False, dtype=dtype)


@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON) or INTERPRETED, reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_heads", [8, 4], ids=["s21", "s21_tp2"])
@pytest.mark.parametrize("n", [1, 16, 700])
def test_kernel_cuda_s21_drafter(n, kv_heads, dtype):
    s21_check(n, kv_heads, dtype, device="cuda", num_slots=2048)
