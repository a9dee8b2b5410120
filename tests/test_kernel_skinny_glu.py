"""The skinny GEMM's SwiGLU epilogue (``skinny_gemm(x, gate_up, glu=True)``, kernels/skinny_gemm.py)
against the two launches it replaces, ``silu_mul(skinny_gemm(x, gate_up))``, and against eager
``F.silu(x Wg^T) * (x Wu^T)``.

* Under Triton's CPU interpreter (child pytest, ``TRITON_INTERPRET=1``): GEMV and dot paths, split
  1 and split-K (the activation in the last program's reduction), M in {1, 3, 5}, an output width
  that is not a multiple of the tile's half, fp32 and bf16: bitwise equal to the two launches, and
  within an output rounding of eager.
* In this process: an odd gate|up width and K = 0 (no launch).
* Offline sm_90 PTX: the epilogue's ``1 + exp(-g)`` is a round-to-nearest add (no FMA can merge
  it), the division correctly rounded; with PDL the GEMV still loads only weights before
  its wait.
* On CUDA (skipped without one): the dense MLP shapes of Laguna-XS-2.1 (target layer 0, drafter)
  and S-2.1 at M in {1, 3, 4, 8, 16} with the tuned configs, bitwise equal to the two launches;
  CUDA-graph capture with PDL; ``layers.gate_up_silu`` taking it while a graph is built.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from interpreter_child import HAS_TRITON, INTERPRETED, interpreted, run_interpreted_child
from ptx_sm90 import can_compile_sm90, compile_sm90, loads_before_pdl_wait

from laguna_dflash.kernels import pdl
from laguna_dflash.kernels import silu_mul as sm
from laguna_dflash.kernels import skinny_gemm as sg
from laguna_dflash.kernels.skinny_gemm import SkinnyConfig, skinny_gemm

HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON) or INTERPRETED, reason="needs CUDA and triton")


def _problem(m: int, inter: int, k: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    """x [M, K] and gate_up [2I, K]: gate rows scaled up so that silu's curved range is hit."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(2 * inter, k, generator=g) * k**-0.5
    w[:inter] *= 3.0
    return x.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype)


def _two_launches(x: torch.Tensor, w: torch.Tensor, cfg: SkinnyConfig | None) -> torch.Tensor:
    return sm.silu_mul(skinny_gemm(x, w, cfg))


def _eager(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x.double(), w.double()).chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="triton not installed / already the child")
def test_kernel_under_triton_interpreter() -> None:
    run_interpreted_child(__file__)


# (block_n, block_k, split_k, num_stages, use_dot) on I = 44 (2I = 88 virtual rows), K = 100
_CONFIGS = [
    (8, 32, 1, 2, False),
    (16, 32, 3, 1, False),  # 3 splits of 64 -> 2 chunks; the activation in the reduction
    (16, 32, 1, 2, True),
    (32, 16, 4, 3, True),
]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 3, 5])
@pytest.mark.parametrize("bn,bk,split,stages,use_dot", _CONFIGS)
def test_interpreted_equals_the_two_launches(bn, bk, split, stages, use_dot, m, dtype) -> None:
    if m > 4 and not use_dot:
        return  # the GEMV takes <= 4 rows (test_kernel_skinny_gemm.py checks the refusal)
    x, w = _problem(m, 44, 100, dtype, seed=m + 10 * bn + split)
    cfg = SkinnyConfig(bn, bk, split, num_warps=2, num_stages=stages, use_dot=use_dot)
    y = skinny_gemm(x, w, cfg, glu=True)
    assert y.shape == (m, 44) and y.dtype == dtype and y.is_contiguous()
    assert torch.equal(y, _two_launches(x, w, cfg))
    # and near eager in exact arithmetic: gate and up each rounded once, silu once, product once
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(y.double(), _eager(x, w), rtol=tol, atol=tol)


@interpreted
def test_interpreted_gate_and_up_are_their_own_rows() -> None:
    """Output column c takes gate row c and up row I + c: with every up row but one zero, only
    that column is non-zero (a swapped half or a shifted row would move or zero it)."""
    x, w = _problem(2, 24, 64, torch.float32, seed=3)
    w[24:] = 0.0
    w[24 + 5] = 1.0 / 64
    y = skinny_gemm(x, w, SkinnyConfig(8, 32, 1, 2, 2, use_dot=False), glu=True)
    assert torch.count_nonzero(y[:, torch.arange(24) != 5]) == 0
    assert torch.all(y[:, 5] != 0)
    torch.testing.assert_close(y.double(), _eager(x, w), rtol=1e-5, atol=1e-7)


# ---- host side (no launch) ----------------------------------------------------------------------------


def test_refuses_an_odd_gate_up_width() -> None:
    with pytest.raises(ValueError, match="glu=True needs weight"):
        skinny_gemm(torch.zeros(1, 8), torch.zeros(7, 8), glu=True)


def test_empty_k_gives_zeros_without_launch() -> None:
    y = skinny_gemm(torch.zeros(2, 0, dtype=torch.bfloat16), torch.zeros(6, 0, dtype=torch.bfloat16), glu=True)
    assert y.shape == (2, 3) and torch.count_nonzero(y) == 0


# ---- offline sm_90 compile ---------------------------------------------------------------------------


def _compile_sm90(m: int, n: int, k: int, cfg: SkinnyConfig, pdl_on: bool = False) -> str:
    meta = dict(sg._plan(m, n, k, torch.bfloat16, cfg, False, pdl_on, glu=True)[2])
    options = {"num_warps": meta.pop("num_warps"), "num_stages": meta.pop("num_stages")}
    if "launch_pdl" in meta:
        options["launch_pdl"] = meta.pop("launch_pdl")
    pointers = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32"}
    return compile_sm90(sg._kernels(False), pointers, {"stride_xk": 1, **meta}, options)


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
@pytest.mark.parametrize("m,cfg", [
    (1, SkinnyConfig(8, 128, 1, 8, 1, use_dot=False)),  # the tuned M = 1 gate_up config
    (4, SkinnyConfig(64, 128, 1, 4, 3, use_dot=True, evict_first=False)),  # the tuned M = 4 one
    (4, SkinnyConfig(64, 128, 2, 4, 3, use_dot=True)),  # split-K: the activation in the reduction
], ids=["gemv", "dot", "dot_split"])
def test_sm90_epilogue_rounds_like_the_activation_kernel(m, cfg) -> None:
    """The activation's ``1 + e`` is an explicit ``add.rn`` (never contracted into an ``fma``
    with exp's last product, whose single rounding would differ from silu_mul's) and the division
    ``div.rn``; a plain ``+`` there compiles to neither."""
    ptx = _compile_sm90(m, 16384, 2048, cfg)
    assert re.search(r"\badd\.rn(\.ftz)?\.f32", ptx) and "div.rn.f32" in ptx
    plain = dict(sg._plan(m, 16384, 2048, torch.bfloat16, cfg, False, False)[2])
    assert plain["GLU"] is False  # the plain build is another specialisation


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
def test_sm90_glu_gemv_loads_only_weights_before_the_pdl_wait() -> None:
    ptx = _compile_sm90(1, 16384, 2048, SkinnyConfig(8, 128, 1, 8, 2, use_dot=False), pdl_on=True)
    early = loads_before_pdl_wait(ptx)
    assert early and all("evict_first" in line for line in early)


# ---- CUDA ---------------------------------------------------------------------------------------------

# (I, K): Laguna-XS-2.1's dense MLPs (target layer 0 and the drafter: 8192 x 2048) and S-2.1's
# target layer 0 (12288 x 3072)
_DENSE = [(8192, 2048), (12288, 3072)]


@cuda
@pytest.mark.parametrize("m", [1, 3, 4, 8, 16])
@pytest.mark.parametrize("inter,k", _DENSE, ids=["xs21", "s21"])
def test_cuda_dense_shapes_equal_the_two_launches(inter, k, m) -> None:
    x, w = _problem(m, inter, k, torch.bfloat16, seed=m, device="cuda")
    y = skinny_gemm(x, w, glu=True)
    assert torch.equal(y, _two_launches(x, w, None))
    torch.testing.assert_close(y.double(), _eager(x, w), rtol=3e-2, atol=3e-2)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_cuda_other_dtypes_equal_the_two_launches(dtype) -> None:
    for m in (1, 4):
        x, w = _problem(m, 8192, 2048, dtype, seed=m, device="cuda")
        assert torch.equal(skinny_gemm(x, w, glu=True), _two_launches(x, w, None))


@cuda
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability() < (9, 0), reason="needs sm90+")
def test_cuda_graph_with_pdl_equals_eager(monkeypatch) -> None:
    """In a captured chain (x written by the kernel right before, PDL on) the fused launch gives
    the two launches' values over replays with new inputs, split-K and not."""
    monkeypatch.setattr(pdl, "USE_PDL", True)
    configs = [None, SkinnyConfig(64, 128, 2, 4, 3, use_dot=True), SkinnyConfig(16, 256, 1, 4, 2, use_dot=False)]
    src, w = _problem(4, 8192, 2048, torch.bfloat16, seed=0, device="cuda")
    x = torch.empty_like(src)
    for cfg in configs:  # compile and allocate outside the capture
        torch.mul(src, 2, out=x)
        skinny_gemm(x, w, cfg, glu=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = []
        for cfg in configs:
            torch.mul(src, 2, out=x)
            outs.append(skinny_gemm(x, w, cfg, glu=True))
    for seed in (1, 2):
        src.copy_(_problem(4, 8192, 2048, torch.bfloat16, seed=seed, device="cuda")[0])
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        for cfg, out in zip(configs, outs):
            assert torch.equal(out, _two_launches(src * 2, w, cfg)), cfg


@cuda
def test_cuda_layers_gate_up_silu_fuses_while_a_graph_is_built(monkeypatch) -> None:
    """``layers.gate_up_silu`` takes the fused launch where ``linear`` takes the skinny GEMM (a
    graph build, a tuned shape) and gives the two launches' bits; eagerly and with
    ``use_glu_epilogue`` off it runs the GEMM and the activation."""
    from laguna_dflash.models import layers

    calls = []
    original = sg.skinny_gemm
    monkeypatch.setattr(sg, "skinny_gemm", lambda x, w, cfg=None, glu=False: (calls.append(glu), original(x, w, cfg, glu))[1])
    with torch.inference_mode():
        x, w = _problem(4, 8192, 2048, torch.bfloat16, seed=1, device="cuda")
        layers.gate_up_silu(x, w)
        assert calls == []  # eager: cuBLAS and the activation
        with layers.building_cuda_graph():
            y = layers.gate_up_silu(x, w)
            assert calls == [True]
            assert torch.equal(y, _two_launches(x, w, None))
            monkeypatch.setattr(layers, "use_glu_epilogue", False)
            assert torch.equal(layers.gate_up_silu(x, w), y)
            assert calls == [True, False]
