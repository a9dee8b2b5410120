"""``skinny_gemm_add_rms_norm`` (kernels/skinny_gemm.py): the skinny GEMM whose last program to
finish adds the residual and RMS-normalises the rows, against the two launches it replaces
(``skinny_gemm`` then ``add_rms_norm``).

* Under Triton's CPU interpreter (child pytest, as ``test_kernel_skinny_gemm.py``): GEMV and dot
  paths, split-K 1 / 3 / 4, M in {1, 3, 16}, ragged N, fp32 and bf16: the residual equals the
  two-launch residual bitwise and the normed rows are within one output rounding of the
  two-launch ones (only the order of ``mean(s^2)``'s sum may differ); the grid counter is re-armed
  after every call, and a counter left armed changes the result (it decides who normalises).
* Offline sm_90 compile: the epilogue's acq_rel grid counter and L2 (.cg) reads are in the PTX, no
  spills at the o_proj shapes, and PDL still loads only weights before the wait.
* CUDA (skipped without one): the o_proj shapes at M = 1, 4, 16 in bf16 / fp32, bitwise
  reproducible over calls, inside a CUDA graph, and in a PDL chain whose producer writes x right
  before the launch.
* Everywhere: operand validation names the argument.
"""

from __future__ import annotations

import pytest
import torch
from interpreter_child import HAS_TRITON, INTERPRETED, interpreted, run_interpreted_child
from ptx_sm90 import can_compile_sm90, compile_sm90_spills, loads_before_pdl_wait

from laguna_dflash.kernels import add_rms_norm as norm_kernel
from laguna_dflash.kernels import pdl
from laguna_dflash.kernels import skinny_gemm as sg
from laguna_dflash.kernels.skinny_gemm import SkinnyConfig, skinny_gemm, skinny_gemm_add_rms_norm

HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON) or INTERPRETED, reason="needs CUDA and triton")
EPS = 1e-6


def _problem(m: int, n: int, k: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * k**-0.5
    h = torch.randn(m, n, generator=g)
    nw = 1.0 + 0.1 * torch.randn(n, generator=g)
    return tuple(t.to(device=device, dtype=dtype) for t in (x, w, h, nw))


def _two_launches(x, w, h, nw, cfg):
    return norm_kernel.add_rms_norm(h, skinny_gemm(x, w, cfg), nw, EPS)


def _assert_matches_two_launches(x, w, h, nw, cfg) -> None:
    res, normed = skinny_gemm_add_rms_norm(x, w, h, nw, EPS, cfg)
    want_res, want_normed = _two_launches(x, w, h, nw, cfg)
    assert res.shape == normed.shape == h.shape and res.dtype == normed.dtype == h.dtype
    assert torch.equal(res, want_res)  # adds and roundings only: bitwise
    # the same rounding chain; only mean(s^2)'s summation order may differ: one output rounding
    u = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}[h.dtype]
    torch.testing.assert_close(normed.float(), want_normed.float(), rtol=u, atol=1e-6)


# ---- Triton kernel (CPU interpreter) ----------------------------------------------------------------


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="triton not installed / already the child")
def test_kernel_under_triton_interpreter() -> None:
    run_interpreted_child(__file__)


# (block_n, block_k, split_k, num_stages, use_dot) on N = 40, K = 100 (ragged tiles)
_CONFIGS = [(16, 32, 1, 2, False), (8, 64, 3, 2, False), (16, 32, 4, 1, False), (16, 32, 1, 3, True),
            (32, 16, 4, 3, True)]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("bn,bk,split,stages,use_dot", _CONFIGS)
def test_interpreted_matches_the_two_launches(bn, bk, split, stages, use_dot, m, dtype) -> None:
    if not use_dot and m > 4:
        return  # the GEMV takes <= 4 rows (test_kernel_skinny_gemm.py checks the error)
    x, w, h, nw = _problem(m, 40, 100, dtype, seed=m * 5 + bn + split)
    cfg = SkinnyConfig(bn, bk, split, num_warps=2, num_stages=stages, use_dot=use_dot)
    _assert_matches_two_launches(x, w, h, nw, cfg)


@interpreted
def test_interpreted_grid_counter_rearms_and_decides_who_normalises() -> None:
    cfg = SkinnyConfig(8, 32, 2, num_warps=2, num_stages=2, use_dot=False)
    x, w, h, nw = _problem(2, 40, 100, torch.bfloat16, seed=3)
    first = skinny_gemm_add_rms_norm(x, w, h, nw, EPS, cfg)
    _, counters = sg._WORKSPACES[(x.device, 40, 2)]
    assert torch.count_nonzero(counters) == 0  # tile counters and the grid counter re-armed
    again = skinny_gemm_add_rms_norm(x, w, h, nw, EPS, cfg)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    # a grid counter left at 1: the second-to-last tile's program normalises, before the last
    # tile's columns of y exist in this call (the interpreter runs programs in order), so the
    # rows it adds are wrong where that tile's y is stale (the previous call's y was another
    # buffer: torch.empty)
    counters[-1] = 1
    res, _ = skinny_gemm_add_rms_norm(x * 2, w, h, nw, EPS, cfg)
    counters.zero_()
    want_res, _ = _two_launches(x * 2, w, h, nw, cfg)
    assert not torch.equal(res[:, -8:], want_res[:, -8:])


@interpreted
def test_interpreted_strided_residual() -> None:
    x, w, h, nw = _problem(3, 40, 100, torch.float32, seed=9)
    wide = torch.zeros(3, 64)
    wide[:, :40] = h
    _assert_matches_two_launches(x, w, wide[:, :40], nw, SkinnyConfig(16, 32, 2, num_stages=2, use_dot=False))


def test_rejects_bad_operands() -> None:
    x, w, h, nw = _problem(2, 40, 100, torch.float32, seed=0)
    with pytest.raises(ValueError, match="h must be"):
        skinny_gemm_add_rms_norm(x, w, h[:1], nw, EPS)
    with pytest.raises(ValueError, match="norm_weight"):
        skinny_gemm_add_rms_norm(x, w, h, nw.double(), EPS)
    with pytest.raises(ValueError, match="norm_weight"):
        skinny_gemm_add_rms_norm(x, w, h, nw[:-1], EPS)
    with pytest.raises(ValueError, match="disagree on K"):  # the GEMM's own checks run first
        skinny_gemm_add_rms_norm(x[:, :50], w, h, nw, EPS)


def test_empty_rows_need_no_launch() -> None:
    x, w, h, nw = _problem(0, 40, 100, torch.float32, seed=0)
    res, normed = skinny_gemm_add_rms_norm(x, w, h, nw, EPS)
    assert res.shape == normed.shape == (0, 40)


# ---- offline sm_90 compile -----------------------------------------------------------------------------


def _compile(m: int, n: int, k: int, cfg: SkinnyConfig, pdl_on: bool) -> tuple[str, list[int]]:
    grid, _, meta = sg._plan(m, n, k, torch.bfloat16, cfg, False, pdl_on)
    meta = dict(meta, ADD_NORM=True, NUM_TILES=grid[0], BLOCK_H=sg._next_pow2(n))
    options = {"num_warps": meta.pop("num_warps"), "num_stages": meta.pop("num_stages")}
    if "launch_pdl" in meta:
        options["launch_pdl"] = meta.pop("launch_pdl")
    pointers = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32",
                "h_ptr": "*bf16", "nw_ptr": "*bf16", "res_ptr": "*bf16", "norm_ptr": "*bf16",
                "grid_count_ptr": "*i32", "eps": "fp32"}
    return compile_sm90_spills(sg._kernels(False), pointers, {"stride_xk": 1, **meta}, options)


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
@pytest.mark.parametrize("m,k", [(1, 6144), (1, 8192), (4, 8192), (16, 8192)])
def test_sm90_epilogue_code(m, k) -> None:
    """The o_proj configs the engine uses (default_config), with the epilogue: a gpu-scope acq_rel
    grid counter, y re-read through L2, no spills; under PDL only weights load before the wait."""
    cfg = sg.default_config(m, 2048, k)
    ptx, spills = _compile(m, 2048, k, cfg, pdl_on=True)
    assert ptx.count("atom.global.gpu.acq_rel.add") == (2 if cfg.split_k > 1 else 1)
    assert "ld.global.cg" in ptx
    assert spills == [0] * len(spills), spills
    assert all("evict_first" in line for line in loads_before_pdl_wait(ptx))


# ---- CUDA -------------------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("k", [6144, 8192])
def test_cuda_o_proj_shapes(k, m, dtype) -> None:
    x, w, h, nw = _problem(m, 2048, k, dtype, seed=m + k, device="cuda")
    cfg = sg.default_config(m, 2048, k)
    res, normed = skinny_gemm_add_rms_norm(x, w, h, nw, EPS)
    want_res, want_normed = _two_launches(x, w, h, nw, cfg)
    assert torch.equal(res, want_res)
    u = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}[dtype]
    torch.testing.assert_close(normed.float(), want_normed.float(), rtol=u, atol=1e-6)
    for _ in range(20):  # arrival order varies on the GPU; the result does not
        again = skinny_gemm_add_rms_norm(x, w, h, nw, EPS)
        assert torch.equal(again[0], res) and torch.equal(again[1], normed)


@cuda
@pytest.mark.parametrize("m", [1, 4])
def test_cuda_graph_replays_with_a_pdl_producer(m, monkeypatch) -> None:
    """Captured right after the kernel that writes x (PDL on where sm90+): replays with new
    inputs give the eager call's outputs bitwise, and the counters stay re-armed."""
    x0, w, h, nw = _problem(m, 2048, 8192, torch.bfloat16, seed=0, device="cuda")
    x = torch.empty_like(x0)
    torch.mul(x0, 2, out=x)
    skinny_gemm_add_rms_norm(x, w, h, nw, EPS)  # compile, workspace outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.mul(x0, 2, out=x)
        res, normed = skinny_gemm_add_rms_norm(x, w, h, nw, EPS)
    for seed in (1, 2, 3):
        x_new, _, h_new, _ = _problem(m, 2048, 8192, torch.bfloat16, seed=seed, device="cuda")
        x0.copy_(x_new)
        h.copy_(h_new)
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setattr(pdl, "USE_PDL", False)
        want = skinny_gemm_add_rms_norm(x0 * 2, w, h, nw, EPS)
        monkeypatch.undo()
        assert torch.equal(res, want[0]) and torch.equal(normed, want[1]), seed
