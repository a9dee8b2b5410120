"""The Q|K|V|gate GEMM with the Q/K norm + RoPE + cache write in its epilogue
(``kernels/qkv_norm_rope_cache.py``).

The oracle is the two launches it replaces: ``skinny_gemm`` with the same tile (one head's rows,
the same K step) and no split-K, then ``qk_norm_rope_cache`` on the GEMM's Q|K|V columns. The
fused kernel must equal them bit for bit in the gate columns and the V cache rows, and in q and
the K rows up to the summation order of the norm's statistic (one ulp, on at most 1% of the bf16
elements, as the Q/K kernel against eager); it must leave every other cache slot untouched and
stay within the Q/K kernel's tolerance of the eager reference.

* Under Triton's CPU interpreter (a child pytest): 1, 3 and 16 tokens; 8 / 2 and 64 / 8 heads;
  full (128) and partial (64, S-2.1's YaRN tables) rotary; a per-head gate (64 rows, half a tile)
  and a per-element one (several tiles), and none; fp32, bf16 and a bf16 cache under fp32.
* In this process: bad inputs raise ValueError naming the argument; ``can_use`` refuses a
  head_dim that is not a power of two.
* On CUDA: the same oracle at XS-2.1 shapes in bf16 and fp32, and inside a CUDA graph with PDL.
"""

from __future__ import annotations

import pytest
import torch
from interpreter_child import HAS_TRITON, INTERPRETED, interpreted, run_interpreted_child
from ptx_sm90 import can_compile_sm90, compile_sm90_spills, loads_before_pdl_wait
from test_kernel_qk_norm_rope_cache import (
    STRICT,
    TOL,
    reference,
    rope_tables,
    s21_full_layer_tables,
)

from laguna_dflash.kernels import qk_norm_rope_cache as qnrc
from laguna_dflash.kernels import qkv_norm_rope_cache as fused
from laguna_dflash.kernels import skinny_gemm as sg

EPS = 1e-6


def problem(t: int, nh: int, nkv: int, rot: int, gate_dim: int, dtype: torch.dtype, *,
            hidden: int = 256, cache_dtype: torch.dtype | None = None, num_slots: int = 64,
            device: str = "cpu", seed: int = 0) -> dict:
    """Arguments of one fused call (head_dim 128): x, the stacked Q|K|V|gate weight, caches
    pre-filled with random values, scattered positions and slots."""
    hd = 128
    g = torch.Generator().manual_seed(seed)
    n = (nh + 2 * nkv) * hd + gate_dim
    if rot == 64:
        cos, sin = s21_full_layer_tables()
    else:
        cos, sin = rope_tables(rot)
    cache_dtype = cache_dtype or dtype
    args = {
        "x": torch.randn(t, hidden, generator=g).to(dtype),
        "weight": (torch.randn(n, hidden, generator=g) * hidden**-0.5 * 3).to(dtype),
        "num_heads": nh, "num_kv_heads": nkv, "head_dim": hd,
        "q_weight": (1 + 0.2 * torch.randn(hd, generator=g)).to(dtype),
        "k_weight": (1 + 0.2 * torch.randn(hd, generator=g)).to(dtype),
        "eps": EPS, "cos_table": cos, "sin_table": sin,
        "positions": torch.randint(0, 512, (t,), generator=g),
        "rot": rot, "slot_mapping": torch.randperm(num_slots, generator=g)[:t],
        "k_cache": torch.randn(num_slots, nkv, hd, generator=g).to(cache_dtype),
        "v_cache": torch.randn(num_slots, nkv, hd, generator=g).to(cache_dtype),
    }
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def two_launches(a: dict, config: fused.HeadGemmConfig) -> tuple[torch.Tensor, ...]:
    """(q, gate, k_cache, v_cache) of the path the kernel replaces, on copies of the caches: the
    skinny GEMM with the fused kernel's tile (one head's rows, its K step and warps; the
    interpreter's dot, numpy's, sums in an order that depends on the tile's shape)."""
    cfg = sg.SkinnyConfig(block_n=a["head_dim"], block_k=config.block_k, split_k=1,
                          num_warps=config.num_warps, num_stages=config.num_stages, use_dot=True)
    out = sg.skinny_gemm(a["x"], a["weight"], cfg)
    width = (a["num_heads"] + 2 * a["num_kv_heads"]) * a["head_dim"]
    k_cache, v_cache = a["k_cache"].clone(), a["v_cache"].clone()
    q = qnrc.qk_norm_rope_cache(
        out[:, :width], a["num_heads"], a["num_kv_heads"], a["head_dim"], a["q_weight"], a["k_weight"],
        a["eps"], a["cos_table"], a["sin_table"], a["positions"], a["rot"], a["slot_mapping"],
        k_cache, v_cache)
    return q, out[:, width:], k_cache, v_cache


def check(a: dict) -> None:
    cfg = fused.FP32_CONFIG if a["x"].dtype == torch.float32 else fused.DEFAULT_CONFIG
    q_two, gate_two, k_two, v_two = two_launches(a, cfg)
    k_before, v_before = a["k_cache"].clone(), a["v_cache"].clone()
    q, gate = fused.qkv_norm_rope_cache(**a)
    assert q.shape == q_two.shape and q.dtype == a["x"].dtype and q.is_contiguous()
    assert gate.shape == gate_two.shape and gate.is_contiguous()
    # V and the gate are the GEMM's output, rounded once: bitwise. Q and K add the norm, whose
    # mean(x^2) sums in the tile's layout (another order than the Q/K kernel's row): one ulp of
    # the statistic may flip a rounding, as between the Q/K kernel and eager
    assert torch.equal(gate, gate_two)
    assert torch.equal(a["v_cache"], v_two)
    slots = a["slot_mapping"].long()
    dtype = a["x"].dtype
    tol = TOL[torch.bfloat16] if torch.bfloat16 in (dtype, a["k_cache"].dtype) else TOL[dtype]
    torch.testing.assert_close(q, q_two, **tol)
    torch.testing.assert_close(a["k_cache"], k_two, **tol)
    differ = (q != q_two).sum() + (a["k_cache"][slots] != k_two[slots]).sum()
    assert differ <= STRICT[dtype] * (q.numel() + k_two[slots].numel()), int(differ)
    untouched = torch.ones(a["k_cache"].shape[0], dtype=torch.bool, device=slots.device)
    untouched[slots] = False
    assert torch.equal(a["k_cache"][untouched], k_before[untouched])
    assert not torch.equal(a["k_cache"][slots], k_before[slots])
    # and within the Q/K kernel's tolerance of the eager reference on that GEMM output
    width = (a["num_heads"] + 2 * a["num_kv_heads"]) * a["head_dim"]
    gemm = (a["x"].double() @ a["weight"].double().T).to(a["x"].dtype)
    ref = {"qkv": gemm[:, :width], "k_cache": k_before, "v_cache": v_before,
           **{k: a[k] for k in ("num_heads", "num_kv_heads", "head_dim", "q_weight", "k_weight", "eps",
                                "cos_table", "sin_table", "positions", "rot", "slot_mapping")}}
    q_ref, _, _ = reference(ref)
    tol = {torch.float32: {"rtol": 1e-4, "atol": 1e-4}}.get(a["x"].dtype, TOL[torch.bfloat16])
    torch.testing.assert_close(q.float(), q_ref.float(), **tol)


# ---- Triton kernel (CPU interpreter) --------------------------------------------------------------


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="triton not installed / already the child")
def test_kernel_under_triton_interpreter():
    run_interpreted_child(__file__, timeout=600)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rot", [128, 64], ids=["rot128", "yarn_rot64"])
@pytest.mark.parametrize("t", [1, 3])
def test_interpreted_equals_two_launches(t, rot, dtype):
    check(problem(t, 8, 2, rot, 8, dtype, seed=t + rot))


@interpreted
def test_interpreted_xs_heads_sixteen_tokens_per_head_gate():
    """64 / 8 heads (80 head programs) and Laguna's per-head gate: 64 rows, half a tile."""
    check(problem(16, 64, 8, 128, 64, torch.bfloat16, num_slots=32, seed=4))


@interpreted
@pytest.mark.parametrize("gate_dim", [0, 2 * 128 + 24], ids=["no_gate", "per_element_gate"])
def test_interpreted_gate_tiles(gate_dim):
    check(problem(2, 4, 2, 128, gate_dim, torch.bfloat16, seed=gate_dim))


@interpreted
@pytest.mark.parametrize("tiles", [0, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interpreted_other_preload_depths_sum_alike(dtype, tiles, monkeypatch):
    """``PRELOAD_TILES`` 0 (the plain K loop) or 2 (two steps peeled, their weight tiles loaded
    before the PDL wait) instead of the default 1: the same dots in the same order. The hidden
    size of 320 is three 128-wide steps, the last one ragged, so with 2 the loop runs one step."""
    monkeypatch.setattr(fused, "PRELOAD_TILES", tiles)
    monkeypatch.setattr(fused, "EARLY_SIGNAL", False)
    check(problem(3, 4, 2, 128, 8, dtype, hidden=320, seed=11))


@pytest.mark.parametrize("tiles,k_iters,want", [(1, 16, 1), (2, 16, 2), (2, 2, 1), (2, 1, 0), (0, 16, 0)])
def test_preload_tiles_leave_the_loop_a_step(tiles, k_iters, want, monkeypatch):
    monkeypatch.setattr(fused, "PRELOAD_TILES", tiles)
    assert fused.preload_tiles(k_iters) == want


@pytest.mark.parametrize("tiles", [3, True, -1])
def test_preload_tiles_rejects_other_values(tiles, monkeypatch):
    monkeypatch.setattr(fused, "PRELOAD_TILES", tiles)
    with pytest.raises(ValueError, match="PRELOAD_TILES must be 0, 1 or 2"):
        fused.preload_tiles(16)


@interpreted
def test_interpreted_bf16_cache_under_fp32():
    check(problem(3, 4, 1, 64, 4, torch.float32, cache_dtype=torch.bfloat16, seed=9))


# ---- host side ------------------------------------------------------------------------------------


def _bad(**changes) -> dict:
    a = problem(2, 4, 2, 128, 8, torch.float32)
    a.update(changes)
    return a


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"head_dim": 96}, "head_dim"),
        ({"num_kv_heads": 0}, "num_kv_heads"),
        ({"weight": torch.zeros((4 + 2 * 2) * 128 - 1, 256)}, "weight"),
        ({"weight": torch.zeros(1032, 256, dtype=torch.bfloat16)}, "weight"),
        ({"x": torch.zeros(17, 256)}, "rows"),
        ({"positions": torch.zeros(3, dtype=torch.long)}, "positions"),
        ({"k_cache": torch.zeros(8, 4, 128)}, "k_cache"),
        ({"q_weight": torch.ones(128, dtype=torch.bfloat16)}, "q_weight"),
        ({"config": "128"}, "config"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_rejects_bad_inputs(changes, match):
    with pytest.raises(ValueError, match=match):
        fused.qkv_norm_rope_cache(**_bad(**changes))


def test_config_rejects_bad_tiles():
    for kwargs, match in (({"block_k": 48}, "block_k"), ({"num_warps": 3}, "num_warps"),
                          ({"num_stages": 0}, "num_stages")):
        with pytest.raises(ValueError, match=match):
            fused.HeadGemmConfig(**kwargs)


def test_can_use_needs_a_power_of_two_head_dim():
    x, w = torch.zeros(1, 64), torch.zeros(256, 64)
    assert not fused.can_use(x, w, 96)
    assert not fused.can_use(x, w, 8)


# ---- offline sm_90 build ---------------------------------------------------------------------------


def _sm90_build(dtype: str, preload: int = 0, early: bool = False) -> tuple[str, list[int]]:
    # the XS-2.1 sliding layer's build (64 / 8 heads, 2048 hidden) with the default tile (fp32: its
    # own): (PTX, spill bytes)
    cfg = fused.DEFAULT_CONFIG if dtype == "bf16" else fused.FP32_CONFIG
    types = {n: f"*{dtype}" for n in ("x_ptr", "w_ptr", "qw_ptr", "kw_ptr", "q_ptr", "g_ptr", "kc_ptr", "vc_ptr")}
    types.update(cos_ptr="*fp32", sin_ptr="*fp32", pos_ptr="*i64", slot_ptr="*i64", eps="fp32")
    constexprs = dict(stride_xk=1, stride_qw=1, stride_kw=1, stride_kcd=1, stride_vcd=1,
                      N=10304, K=2048, GATE_DIM=64, NUM_HEADS=64, NUM_KV_HEADS=8, HEAD_DIM=128,
                      ROT_DIM=128, M_PAD=16, BLOCK_K=cfg.block_k, K_ITERS=2048 // cfg.block_k,
                      IEEE=dtype == "fp32", MASK_W=True, DTYPE=1 if dtype == "bf16" else 0,
                      CACHE_DTYPE=1 if dtype == "bf16" else 0, PDL=True, PRELOAD=preload, EARLY=early)
    return compile_sm90_spills(
        fused._kernels(False), types, constexprs,
        {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "enable_fp_fusion": False,
         "launch_pdl": True})


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_sm90_build_loads_only_parameters_before_the_pdl_wait(dtype):
    """With both switches off: before ``griddepcontrol.wait`` a program reads only positions and
    slots (through L2), the
    norm weight and the cos / sin rows, never x or the weight; the weight streams after it;
    nothing spills."""
    ptx, spills = _sm90_build(dtype)
    assert spills == [0], spills
    before = loads_before_pdl_wait(ptx)
    assert before and not any("cp.async" in line for line in before), before
    assert sum(".cg" in line for line in before) >= 2, before  # position and slot
    after = ptx[ptx.index("griddepcontrol.wait"):]
    assert "cp.async" in after or "ld.global" in after
    # the signal after the K loop: the weight's loads come before it
    assert "cp.async" in ptx[:ptx.index("griddepcontrol.launch_dependents")] or dtype == "fp32"


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
def test_sm90_switches_move_the_first_tiles_and_the_signal():
    """``PRELOAD_TILES`` adds the first weight tiles' loads before the wait (x still after it),
    twice as many for two tiles, without spills; ``EARLY_SIGNAL`` puts launch_dependents before
    the K loop's loads."""
    plain, _ = _sm90_build("bf16")
    ptx, spills = _sm90_build("bf16", preload=1, early=True)
    two, two_spills = _sm90_build("bf16", preload=2, early=True)
    assert spills == [0] and two_spills == [0], (spills, two_spills)
    num_plain = len(loads_before_pdl_wait(plain))
    num_one, num_two = len(loads_before_pdl_wait(ptx)) - num_plain, len(loads_before_pdl_wait(two)) - num_plain
    assert num_one > 0 and num_two == 2 * num_one, (num_plain, num_one, num_two)
    for build in (ptx, two):
        signal = build.index("griddepcontrol.launch_dependents")
        assert "cp.async" not in build[:signal] and "cp.async" in build[signal:]


# ---- CUDA -----------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(INTERPRETED or not fused.can_use(torch.zeros(1, 16, device="cuda"),
                                                           torch.zeros(16, 16, device="cuda"), 128)
                          if torch.cuda.is_available() else True, reason="needs a CUDA GPU (sm80+) and triton")


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("nh,rot,gate", [(64, 128, 64), (48, 64, 48)], ids=["xs_sliding", "xs_full_yarn"])
@pytest.mark.parametrize("t", [1, 4, 16])
def test_cuda_xs_shapes_equal_two_launches(t, nh, rot, gate, dtype):
    check(problem(t, nh, 8, rot, gate, dtype, hidden=2048, num_slots=1024, device="cuda", seed=t + nh))


@cuda
@pytest.mark.parametrize("t", [1, 4])
def test_cuda_two_preloaded_tiles_equal_two_launches(t, monkeypatch):
    """``PRELOAD_TILES = 2`` (two weight tiles before the PDL wait) at XS-2.1 shapes."""
    monkeypatch.setattr(fused, "PRELOAD_TILES", 2)
    check(problem(t, 64, 8, 128, 64, torch.bfloat16, hidden=2048, num_slots=1024, device="cuda", seed=t))


@cuda
def test_cuda_graph_replays_equal_two_launches():
    """Captured with PDL (the default), replayed on new inputs: still the two launches' bits."""
    a = problem(4, 64, 8, 128, 64, torch.bfloat16, hidden=2048, num_slots=256, device="cuda", seed=1)
    fused.qkv_norm_rope_cache(**a)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, gate = fused.qkv_norm_rope_cache(**a)
    for seed in (2, 3):
        new = problem(4, 64, 8, 128, 64, torch.bfloat16, hidden=2048, num_slots=256, device="cuda", seed=seed)
        for name in ("x", "positions", "slot_mapping"):
            a[name].copy_(new[name])
        q_two, gate_two, k_two, v_two = two_launches(a, fused.DEFAULT_CONFIG)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(q, q_two) and torch.equal(gate, gate_two)
        assert torch.equal(a["k_cache"], k_two) and torch.equal(a["v_cache"], v_two)
