"""Q/K norm + RoPE + paged K/V write kernel (``kernels/qk_norm_rope_cache.py``).

* Under Triton's CPU interpreter (``TRITON_INTERPRET=1``, in a child pytest: triton reads the
  variable at import, so nothing leaks into other tests) the kernel equals the eager reference,
  ``fusion.rms_norm_rope.eager`` of the Q and K heads plus index assignment of K and V into cloned
  caches: head_dim 128 with rot 128 and 64, 8/2 and 64/8 heads, T in {1, 7}, scattered positions
  and slots, ``qkv`` a column slice of a wider GEMM output, caches pre-filled with random values
  (untouched slots must stay bit-identical), fp32 (1e-5) and bf16 (one ulp); plus a padded
  head_dim (96), strided caches, fp16, int32 indices and a cache dtype other than qkv's.
* In this process: bad inputs raise ValueError naming the argument; T == 0 returns an empty q
  without launching; ``is_available("cpu")`` is False without the interpreter.
* On CUDA (skipped without one): larger shapes vs the reference, and CUDA-graph capture.
"""

from __future__ import annotations

import pytest
import torch
from interpreter_child import HAS_TRITON, INTERPRETED, interpreted, run_interpreted_child
from ptx_sm90 import can_compile_sm90, compile_sm90, loads_before_pdl_wait

from laguna_dflash.kernels import qk_norm_rope_cache as qnrc
from laguna_dflash.models.fusion import rms_norm_rope

TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5},
       torch.bfloat16: {"rtol": 1.6e-2, "atol": 2e-2},  # one bf16 ulp
       torch.float16: {"rtol": 2e-3, "atol": 2e-3}}
# interpreter (correctly rounded sqrt and division like torch's CPU rsqrt): fraction of elements
# allowed to differ from eager at all; fp32 sums in another order, bf16 rounds where eager does
STRICT = {torch.float32: 1.0, torch.bfloat16: 0.01}
EPS = 1e-6
EXTRA_COLS = 24  # gate columns after V in the wider GEMM output (not read)


def rope_tables(rot: int, max_pos: int = 512, theta: float = 10000.0) -> tuple[torch.Tensor, ...]:
    inv_freq = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def problem(t: int, nh: int, nkv: int, hd: int, rot: int, dtype: torch.dtype, *,
            cache_dtype: torch.dtype | None = None, num_slots: int = 64, strided_cache: bool = False,
            index_dtype: torch.dtype = torch.int64, device: str = "cpu", seed: int = 0) -> dict:
    """Inputs of one call; ``qkv`` is a column slice of a wider tensor (gate columns after V)."""
    g = torch.Generator().manual_seed(seed)
    width = (nh + 2 * nkv) * hd
    wide = 3 * torch.randn(t, width + EXTRA_COLS, generator=g)
    cos, sin = rope_tables(rot)
    positions = torch.tensor([0, 3, 17, 250, 64, 511, 100, 9])[:t] if t <= 8 else \
        torch.randint(0, 512, (t,), generator=g)
    slots = torch.randperm(num_slots, generator=g)[:t]  # scattered, in no order
    cache_dtype = cache_dtype or dtype
    if strided_cache:  # K and V of one slot side by side: [num_slots, 2, nkv, hd] -> strided views
        kv = torch.randn(num_slots, 2, nkv, hd, generator=g).to(cache_dtype)
        k_cache, v_cache = kv[:, 0], kv[:, 1]
    else:
        k_cache = torch.randn(num_slots, nkv, hd, generator=g).to(cache_dtype)
        v_cache = torch.randn(num_slots, nkv, hd, generator=g).to(cache_dtype)
    args = {
        "qkv": wide.to(dtype)[:, :width],
        "num_heads": nh, "num_kv_heads": nkv, "head_dim": hd,
        "q_weight": (1 + 0.2 * torch.randn(hd, generator=g)).to(dtype),
        "k_weight": (1 + 0.2 * torch.randn(hd, generator=g)).to(dtype),
        "eps": EPS, "cos_table": cos, "sin_table": sin, "positions": positions.to(index_dtype),
        "rot": rot, "slot_mapping": slots.to(index_dtype), "k_cache": k_cache, "v_cache": v_cache,
    }
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def reference(a: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k_cache, v_cache) of the eager path: ``rms_norm_rope`` of Q and K, index assignment."""
    t, nh, nkv, hd = a["qkv"].shape[0], a["num_heads"], a["num_kv_heads"], a["head_dim"]
    q, k, v = a["qkv"][:, : (nh + 2 * nkv) * hd].split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    pos, slots = a["positions"].long(), a["slot_mapping"].long()
    tables = (a["cos_table"], a["sin_table"], pos, a["rot"])
    q = rms_norm_rope.eager(q.reshape(t, nh, hd), a["q_weight"], a["eps"], *tables)
    k = rms_norm_rope.eager(k.reshape(t, nkv, hd), a["k_weight"], a["eps"], *tables)
    k_cache, v_cache = a["k_cache"].clone(), a["v_cache"].clone()
    k_cache[slots] = k.to(k_cache.dtype)
    v_cache[slots] = v.reshape(t, nkv, hd).to(v_cache.dtype)
    return q, k_cache, v_cache


def check(a: dict, max_mismatch: float = 1.0) -> None:
    """Run the kernel on ``a`` (writing its caches) and compare with :func:`reference`; at most a
    fraction ``max_mismatch`` of the q and K elements may differ from it at all (the tolerances
    allow one ulp; rounding where eager rounds keeps nearly all of them bit-identical)."""
    q_ref, k_ref, v_ref = reference(a)
    k_before, v_before = a["k_cache"].clone(), a["v_cache"].clone()
    q = qnrc.qk_norm_rope_cache(**a)
    dtype = a["qkv"].dtype
    assert q.dtype == dtype and q.is_contiguous()
    assert q.shape == (a["qkv"].shape[0], a["num_heads"], a["head_dim"])
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    slots = a["slot_mapping"].long()
    tol = TOL[torch.bfloat16] if torch.bfloat16 in (dtype, a["k_cache"].dtype) else TOL[dtype]
    torch.testing.assert_close(a["k_cache"][slots], k_ref[slots], **tol)
    torch.testing.assert_close(a["v_cache"], v_ref, rtol=0, atol=0)  # V is a plain copy
    if a["k_cache"].dtype == dtype:
        differ = (q != q_ref).sum() + (a["k_cache"][slots] != k_ref[slots]).sum()
        assert differ <= max_mismatch * (q.numel() + k_ref[slots].numel()), int(differ)
    untouched = torch.ones(a["k_cache"].shape[0], dtype=torch.bool, device=slots.device)
    untouched[slots] = False
    assert torch.equal(a["k_cache"][untouched], k_before[untouched])
    assert torch.equal(a["v_cache"][untouched], v_before[untouched])


# ---- Triton kernel (CPU interpreter) == reference ---------------------------------------------------
#
# Triton's interpreter needs TRITON_INTERPRET=1 before triton is imported (as in
# test_kernel_context_kv.py), so the interpreted tests run in a child pytest with the variable set;
# in this process they skip.



@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="triton not installed / already the child")
def test_kernel_under_triton_interpreter():
    run_interpreted_child(__file__)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rot", [128, 64], ids=["rot128", "rot64"])
@pytest.mark.parametrize("t", [1, 7])
def test_interpreted_equals_reference(t, rot, dtype):
    assert qnrc.is_available("cpu")
    check(problem(t, 8, 2, 128, rot, dtype, seed=t + rot), max_mismatch=STRICT[dtype])


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interpreted_gqa_64_8(dtype):
    check(problem(2, 64, 8, 128, 64, dtype, seed=3), max_mismatch=STRICT[dtype])


@interpreted
@pytest.mark.parametrize(
    "dtype,cache_dtype,index_dtype",
    [(torch.bfloat16, torch.float32, torch.int32), (torch.float32, torch.bfloat16, torch.int64),
     (torch.float16, torch.float16, torch.int32)],
    ids=["bf16-fp32cache-int32", "fp32-bf16cache", "fp16-int32"],
)
def test_interpreted_padded_head_dim_strided_caches(dtype, cache_dtype, index_dtype):
    """head_dim 96 (padded to 128 in the kernel), rot 32, K/V caches strided views of one buffer."""
    a = problem(5, 4, 2, 96, 32, dtype, cache_dtype=cache_dtype, strided_cache=True,
                index_dtype=index_dtype, seed=5)
    assert not a["k_cache"].is_contiguous()
    check(a)


def s21_full_layer_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """S-2.1's full-attention RoPE: YaRN factor 128 over 8192, beta_fast 32, beta_slow 1,
    theta 5e5, partial 0.5 (64 of 128 dims), mscale 1.4852 folded into cos / sin; 512 positions."""
    from laguna_dflash.models.rope import RopeSpec, RotaryEmbedding

    spec = RopeSpec(128, theta=500000.0, rope_type="yarn", partial_rotary_factor=0.5, factor=128.0,
                    original_max_position_embeddings=8192, beta_fast=32.0, beta_slow=1.0,
                    attention_factor=1.4852030263919618)
    rope = RotaryEmbedding(spec)
    rope.ensure(512)
    assert rope.cos.shape == (512, 64) and rope.cos.abs().max() > 1.4  # the magnitude factor
    return rope.cos, rope.sin


# (num_heads, kv_heads, rot, dtype): sliding layers (72 over 8; 36 over 4 a rank under 2-way TP)
# with full rotary, full layers (48 over 8; 24 over 4) with the YaRN tables on half the dims
S21_LAYOUTS = [(72, 8, 128, torch.bfloat16), (36, 4, 128, torch.float32), (48, 8, 64, torch.bfloat16),
               (24, 4, 64, torch.float32)]


def s21_problem(nh: int, nkv: int, rot: int, dtype: torch.dtype, t: int, device: str = "cpu", **kw) -> dict:
    a = problem(t, nh, nkv, 128, rot, dtype, device=device, seed=nh + rot, **kw)
    if rot == 64:
        a["cos_table"], a["sin_table"] = (tab.to(device) for tab in s21_full_layer_tables())
    return a


@interpreted
@pytest.mark.parametrize("nh,nkv,rot,dtype", [(36, 4, 128, torch.float32), (72, 8, 64, torch.bfloat16)],
                         ids=["s21_tp2_swa36_rot128", "s21_72_yarn_rot64"])
def test_interpreted_s21_heads(nh, nkv, rot, dtype):
    """S-2.1 head counts (72 / 36 heads: 80 / 40 programs a token) with full rotary and with
    the YaRN partial (0.5) tables, one decode token (the other layouts: the CUDA test)."""
    check(s21_problem(nh, nkv, rot, dtype, t=1), max_mismatch=STRICT[dtype])


# ---- host side (no launch) ----------------------------------------------------------------------------


def test_empty_batch_returns_empty_q_without_launch():
    a = problem(0, 8, 2, 128, 64, torch.bfloat16)
    k_before, v_before = a["k_cache"].clone(), a["v_cache"].clone()
    q = qnrc.qk_norm_rope_cache(**a)  # a launch on a CPU tensor would fail without the interpreter
    assert q.shape == (0, 8, 128) and q.dtype == torch.bfloat16
    assert torch.equal(a["k_cache"], k_before) and torch.equal(a["v_cache"], v_before)


def _bad(**changes) -> dict:
    a = problem(3, 4, 2, 64, 32, torch.float32)
    a.update(changes)
    return a


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"qkv": torch.zeros(3, (4 + 2 * 2) * 64 - 1)}, "qkv"),
        ({"qkv": torch.zeros(3, 512, dtype=torch.int32)}, "qkv"),
        ({"q_weight": torch.ones(32)}, "q_weight"),
        ({"k_weight": torch.ones(64, dtype=torch.bfloat16)}, "k_weight"),
        ({"rot": 31}, "rot"),
        ({"rot": 128}, "rot"),
        ({"rot": 0}, "rot"),
        ({"cos_table": torch.zeros(512, 16)}, "cos_table"),
        ({"sin_table": torch.zeros(512, 32, dtype=torch.float64)}, "sin_table"),
        ({"positions": torch.zeros(4, dtype=torch.long)}, "positions"),
        ({"positions": torch.zeros(3)}, "positions"),
        ({"slot_mapping": torch.zeros(2, dtype=torch.long)}, "slot_mapping"),
        ({"k_cache": torch.zeros(8, 4, 64)}, "k_cache"),
        ({"v_cache": torch.zeros(8, 2, 32)}, "v_cache"),
        ({"v_cache": torch.zeros(8, 2, 64, dtype=torch.bfloat16)}, "v_cache"),
        ({"num_heads": 0}, "num_heads"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_rejects_bad_inputs(changes, match):
    with pytest.raises(ValueError, match=match):
        qnrc.qk_norm_rope_cache(**_bad(**changes))


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="triton not installed / interpreter on")
def test_is_available_without_interpreter():
    assert not qnrc.is_available("cpu")


# ---- CUDA -------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(INTERPRETED or not qnrc.is_available("cuda"),
                          reason="needs a CUDA GPU (sm80+) and triton")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rot", [128, 64], ids=["rot128", "rot64"])
@pytest.mark.parametrize("t,nh,nkv", [(1, 8, 2), (7, 8, 2), (1, 64, 8), (16, 64, 8), (300, 32, 4)])
def test_cuda_equals_reference(t, nh, nkv, rot, dtype):
    check(problem(t, nh, nkv, 128, rot, dtype, num_slots=1024, device="cuda", seed=t))


@cuda
@pytest.mark.parametrize("t", [1, 16, 300])
@pytest.mark.parametrize("nh,nkv,rot,dtype", S21_LAYOUTS,
                         ids=["s21_swa72", "s21_tp2_swa36", "s21_full48_yarn", "s21_tp2_full24_yarn"])
def test_cuda_s21_heads(nh, nkv, rot, dtype, t):
    check(s21_problem(nh, nkv, rot, dtype, t=t, device="cuda", num_slots=1024))


@cuda
def test_cuda_graph_capture():
    a = problem(16, 64, 8, 128, 64, torch.bfloat16, num_slots=256, device="cuda", seed=1)
    qnrc.qk_norm_rope_cache(**a)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_q = qnrc.qk_norm_rope_cache(**a)
    new = problem(16, 64, 8, 128, 64, torch.bfloat16, num_slots=256, device="cuda", seed=2)
    for name in ("qkv", "positions", "slot_mapping"):
        a[name].copy_(new[name])
    k_before, v_before = a["k_cache"].clone(), a["v_cache"].clone()
    graph.replay()
    torch.cuda.synchronize()
    a_ref = {**a, "k_cache": k_before, "v_cache": v_before}
    q_ref, k_ref, v_ref = reference(a_ref)
    torch.testing.assert_close(static_q, q_ref, **TOL[torch.bfloat16])
    torch.testing.assert_close(a["k_cache"], k_ref, **TOL[torch.bfloat16])
    torch.testing.assert_close(a["v_cache"], v_ref, rtol=0, atol=0)


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
def test_sm90_programmatic_dependent_launch_order() -> None:
    """With ``kernels.pdl.USE_PDL`` every program reads only its position, slot, norm weight and
    cos / sin rows before it waits for the QKV GEMM (``PRELOAD_PARAMS``: position and slot
    through L2), then signals the attention kernel and reads its head row; without the preload
    it loads nothing before the wait; without PDL no griddepcontrol is emitted."""
    types = {n: "*bf16" for n in ("qkv_ptr", "qw_ptr", "kw_ptr", "q_ptr", "kc_ptr", "vc_ptr")}
    types.update(cos_ptr="*fp32", sin_ptr="*fp32", pos_ptr="*i64", slot_ptr="*i64", eps="fp32")

    def ptx_of(pdl: bool, preload: bool = True) -> str:
        constexprs = dict(stride_xd=1, stride_qw=1, stride_kw=1, stride_kcd=1, stride_vcd=1,
                          NUM_HEADS=8, NUM_KV_HEADS=2, HEAD_DIM=128, ROT_DIM=64, BLOCK_D=128,
                          DTYPE=1, CACHE_DTYPE=1, PDL=pdl, PRELOAD=preload)
        return compile_sm90(qnrc._kernels(False), types, constexprs,
                            {"num_warps": 1, "enable_fp_fusion": False, "launch_pdl": pdl})

    assert "griddepcontrol" not in ptx_of(False)
    ptx = ptx_of(True)
    before_wait = loads_before_pdl_wait(ptx)
    # position and slot (.cg, 8-byte), weight and partner (bf16), cos and sin (fp32)
    assert sum(".cg" in line for line in before_wait) >= 2 and len(before_wait) >= 6, before_wait
    after_wait = ptx[ptx.index("griddepcontrol.wait"):]
    assert "ld.global" in after_wait  # the head row
    plain = ptx_of(True, preload=False)
    assert loads_before_pdl_wait(plain) == [] and "ld.global" in plain
