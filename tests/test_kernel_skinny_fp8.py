"""The skinny GEMM with an fp8 weight (``skinny_gemm(x, w8, scale=s)``, kernels/skinny_gemm.py):
``y[m, n] = s[n] * sum_k x[m, k] w8[n, k]`` with ``w8`` float8_e4m3fn and per-row fp32 scales.

* Under Triton's CPU interpreter (a child pytest, as in ``test_kernel_skinny_gemm.py``): against
  an fp64 bound, both paths (GEMV, tensor-core dot), split-K, ragged tiles, the SwiGLU epilogue
  (bitwise the plain fp8 GEMM then ``silu_mul``), the row-block launch (bitwise the plain launch
  a 16-row block at a time).
* Offline sm_90 compile: the fp8 default configs at the XS-2.1 drafter's shapes build without
  spills, widen e4m3 in registers, and run the dot path on wgmma.
* On CUDA (skipped without one): those shapes against the reference, and a graph replay.
* Everywhere: the argument checks and the fp8 configs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from interpreter_child import (
    HAS_TRITON,
    INTERPRETED,
    interpreted,
    run_interpreted_child,
    run_interpreted_script,
)
from ptx_sm90 import _ptxas_report, can_compile_sm90, compile_sm90

from laguna_dflash.kernels import skinny_gemm as sg
from laguna_dflash.kernels.silu_mul import silu_mul
from laguna_dflash.kernels.skinny_gemm import SkinnyConfig, skinny_gemm, skinny_gemm_rows
from laguna_dflash.models.fp8 import quantize_rows

HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON) or INTERPRETED, reason="needs CUDA and triton")
_U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _problem(m: int, n: int, k: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    w8, scale = quantize_rows((torch.randn(n, k, generator=g) * k**-0.5).to(device))
    return x, w8, scale


def _assert_close_to_exact(y: torch.Tensor, x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> None:
    """``y`` is ``scale[n] * sum_k x w8`` summed in fp32 in some order, times the fp32 scale (one
    more fp32 rounding), rounded once to y.dtype."""
    xd, wd = x.double(), w8.double()
    sd = scale.double()[None, :]
    exact = (xd @ wd.T) * sd
    absprod = (xd.abs() @ wd.abs().T) * sd
    g = x.shape[1] * 2.0**-24 / (1 - x.shape[1] * 2.0**-24) + 2.0**-24
    bound = g * absprod + _U[y.dtype] * (exact.abs() + g * absprod) + 1e-30
    worst = ((y.double() - exact).abs() / bound).max().item()
    assert worst <= 1.0, f"error {worst:.3g} x the bound"


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="triton not installed / already the child")
def test_kernel_under_triton_interpreter() -> None:
    run_interpreted_child(__file__)


# (block_n, block_k, split_k, num_stages, use_dot) on N = 40, K = 100: ragged tiles
_CONFIGS = [(16, 32, 1, 1, False), (8, 64, 3, 2, False), (16, 32, 1, 2, True), (32, 16, 4, 3, True)]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("bn,bk,split,stages,use_dot", _CONFIGS)
def test_interpreted_matches_the_bound(bn, bk, split, stages, use_dot, m, dtype) -> None:
    if not use_dot and m > 4:
        return  # the GEMV has at most 4 rows (test_kernel_skinny_gemm.py checks the error)
    x, w8, scale = _problem(m, 40, 100, dtype, seed=m * 5 + bn)
    cfg = SkinnyConfig(bn, bk, split, num_warps=2, num_stages=stages, use_dot=use_dot)
    y = skinny_gemm(x, w8, cfg, scale=scale)
    _assert_close_to_exact(y, x, w8, scale)
    glu = skinny_gemm(x, w8, cfg, glu=True, scale=scale)  # the activation reads the scaled sums
    assert torch.equal(glu, silu_mul(y))


@interpreted
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("bn,bk,split,stages,use_dot", _CONFIGS)
def test_interpreted_int8_weight_matches_the_bound(bn, bk, split, stages, use_dot, m) -> None:
    """An int8 weight with row scales (kernels/greedy_lm_head.py's lm_head copy) takes the same
    path: exact products, fp32 sums, the scale, one rounding."""
    from laguna_dflash.kernels.greedy_lm_head import quantize

    if not use_dot and m > 4:
        return
    g = torch.Generator().manual_seed(m + bn)
    x = torch.randn(m, 100, generator=g).to(torch.bfloat16)
    head = quantize(torch.randn(40, 100, generator=g).to(torch.bfloat16))
    y = skinny_gemm(x, head.q, SkinnyConfig(bn, bk, split, num_warps=2, num_stages=stages, use_dot=use_dot),
                    scale=head.scale)
    _assert_close_to_exact(y, x, head.q, head.scale)


def test_int8_weights_never_round_x() -> None:
    # the fp16 widening (FP8_DOT_F16) rounds x: only e4m3 takes it
    assert sg.fp8_mode(True, torch.bfloat16) == sg.fp8_mode(True, torch.bfloat16, torch.float8_e4m3fn) == 2
    assert sg.fp8_mode(True, torch.bfloat16, torch.int8) == 1
    assert sg.fp8_mode(False, torch.bfloat16, torch.int8) == 0


@interpreted
def test_interpreted_scales_reach_every_row() -> None:
    # a scale of 0 zeroes its column and only that one; doubling a scale doubles its column
    x, w8, scale = _problem(4, 40, 64, torch.float32, seed=3)
    cfg = SkinnyConfig(16, 32, 2, use_dot=True)
    y = skinny_gemm(x, w8, cfg, scale=scale)
    changed = scale.clone()
    changed[7], changed[33] = 0.0, 2 * scale[33]
    y2 = skinny_gemm(x, w8, cfg, scale=changed)
    assert torch.equal(y2[:, 7], torch.zeros(4)) and torch.equal(y2[:, 33], 2 * y[:, 33])
    keep = [i for i in range(40) if i not in (7, 33)]
    assert torch.equal(y2[:, keep], y[:, keep])


@interpreted
def test_interpreted_rows_config_is_exact_to_the_bound() -> None:
    # fp8.ROWS_CONFIG (the 16-row blocks' measured tile) on a ragged problem: 40 rows, N and K
    # not multiples of its 128 x 128 tile
    from laguna_dflash.models.fp8 import ROWS_CONFIG

    x, w8, scale = _problem(40, 200, 300, torch.bfloat16, seed=11)
    y = skinny_gemm_rows(x, w8, ROWS_CONFIG, scale=scale)
    _assert_close_to_exact(y, x, w8, scale)
    assert torch.equal(y[16:32], skinny_gemm(x[16:32], w8, ROWS_CONFIG, scale=scale))


@interpreted
def test_interpreted_row_blocks_equal_the_plain_launch() -> None:
    x, w8, scale = _problem(40, 24, 96, torch.bfloat16, seed=9)
    cfg = SkinnyConfig(16, 32, 2, num_stages=2, use_dot=True)
    y = skinny_gemm_rows(x, w8, cfg, scale=scale)
    for b in range(0, 40, 16):
        assert torch.equal(y[b : b + 16], skinny_gemm(x[b : b + 16], w8, cfg, scale=scale))
    _assert_close_to_exact(y, x, w8, scale)


# ---- everywhere ---------------------------------------------------------------------------------------


def test_rejects_bad_scales() -> None:
    x = torch.zeros(2, 16)
    w8, scale = quantize_rows(torch.randn(8, 16))
    for kwargs, match in [
        ({"weight": w8}, "needs scale="),
        ({"weight": w8, "scale": scale[:4]}, r"scale must be a contiguous float32 tensor \[N=8\]"),
        ({"weight": w8, "scale": scale.double()}, "scale must be"),
        ({"weight": w8, "scale": torch.zeros(8, 2)[:, 0]}, "scale must be"),
        ({"weight": torch.zeros(8, 16), "scale": scale}, "scale= is for float8_e4m3fn / int8 weights"),
        ({"weight": torch.zeros(8, 16, dtype=torch.int8)}, "int8 weight needs scale="),
    ]:
        with pytest.raises(ValueError, match=match):
            skinny_gemm(x, **kwargs)
    assert not sg.can_use(x, w8) and not sg.can_use(x, torch.zeros(8, 16), scale)
    assert not sg.can_use(x, w8, scale[:4])


def test_fp8_configs_move_the_bf16_bytes_and_take_their_own_overrides(monkeypatch) -> None:
    # measured: its own table, the smallest bucket >= next_pow2(rows) of the shape
    for n, k in {(n, k) for _, n, k in sg._MEASURED_FP8}:
        buckets = sorted(m for m, n2, k2 in sg._MEASURED_FP8 if (n2, k2) == (n, k))
        for rows in range(1, buckets[-1] + 1):
            bucket = next(b for b in buckets if b >= sg._next_pow2(rows))
            assert sg.default_config(rows, n, k, fp8=True) == sg._MEASURED_FP8[bucket, n, k]
    assert sg.default_config(4, 100352, 2048, fp8=True) != sg.default_config(5, 100352, 2048, fp8=True)
    for m, n, k in [(1, 8240, 3072), (8, 100352, 4096), (8, 2048, 8192), (16, 2048, 8192), (1, 2048, 4096)]:
        assert (m, n, k) not in sg._MEASURED_FP8
        bf16, fp8 = sg.default_config(m, n, k), sg.default_config(m, n, k, fp8=True)
        assert dataclasses_equal_but_block_k(bf16, fp8)
        dot = sg._use_dot(bf16, m)
        assert fp8.block_k == (min(2 * bf16.block_k, 256) if dot else 2 * bf16.block_k)
    monkeypatch.setattr(sg, "CONFIG_OVERRIDES", {"fp8,4,2048,8192": {"split_k": 2}})
    assert sg.default_config(4, 2048, 8192, fp8=True).split_k == 2
    assert sg.default_config(4, 2048, 8192).split_k == 4  # bf16 keeps its table entry


def test_an_unmeasured_fp8_width_takes_the_nearest_measured_one_of_its_k() -> None:
    """A draft vocabulary's lm_head (any number of rows, ``--speculative-token-map``): the e4m3
    entry of the same K and row bucket with the nearest N by ratio, not the bf16 heuristic."""
    table = sg._MEASURED_FP8
    assert sg.default_config(3, 20000, 2048, fp8=True) == table[4, 16384, 2048]
    assert sg.default_config(3, 50176, 2048, fp8=True) == table[4, 32768, 2048]
    assert sg.default_config(4, 70000, 2048, fp8=True) == table[4, 100352, 2048]
    assert sg.default_config(1, 4096, 2048, fp8=True) == table[4, 16384, 2048]  # up to bucket 4
    assert sg.default_config(12, 30000, 2048, fp8=True) == table[16, 16384, 2048]  # bucket 16's own
    assert sg.default_config(4, 4096, 8192, fp8=True) == table[4, 2048, 8192]
    # no entry of this K: the bf16 config with block_k doubled, as before
    assert dataclasses_equal_but_block_k(sg.default_config(4, 32768, 3072), sg.default_config(4, 32768, 3072, fp8=True))


def test_int8_configs_take_their_table_then_the_e4m3_one(monkeypatch) -> None:
    """An int8 weight (the greedy lm_head's copy): ``_MEASURED_INT8`` where it has the shape's
    bucket (the one-row lm_head's GEMV), else the e4m3 weight's config; its own override key. The
    e4m3 weight's configs do not change."""
    assert sg.default_config(1, 100352, 2048, int8=True) == sg._MEASURED_INT8[1, 100352, 2048]
    assert not sg.default_config(1, 100352, 2048, int8=True).use_dot
    for m in (2, 3, 4):
        assert sg.default_config(m, 100352, 2048, int8=True) == sg._MEASURED_INT8[4, 100352, 2048]
    assert sg.default_config(1, 100352, 2048, fp8=True) == sg._MEASURED_FP8[4, 100352, 2048]
    assert sg.default_config(3, 100352, 3072, int8=True) == sg._MEASURED_INT8[4, 100352, 3072]
    for m, n, k in [(5, 100352, 2048), (16, 100352, 2048), (5, 100352, 3072), (16, 16384, 2048)]:
        assert sg.default_config(m, n, k, int8=True) == sg.default_config(m, n, k, fp8=True), (m, n, k)
    monkeypatch.setattr(sg, "CONFIG_OVERRIDES", {"int8,1,100352,2048": {"block_n": 32}})
    assert sg.default_config(1, 100352, 2048, int8=True).block_n == 32
    assert sg.default_config(1, 100352, 2048, fp8=True) == sg._MEASURED_FP8[4, 100352, 2048]


def dataclasses_equal_but_block_k(a: SkinnyConfig, b: SkinnyConfig) -> bool:
    return a == SkinnyConfig(**{**b.__dict__, "block_k": a.block_k})


# ---- offline sm_90 compile ----------------------------------------------------------------------------


def _compile_fp8(m: int, n: int, k: int, glu: bool) -> tuple[str, str]:
    cfg = sg.default_config(m, n, k, fp8=True)
    meta = dict(sg._plan(m, n, k, torch.bfloat16, cfg, False, True, glu=glu,
                         w_fp8=sg.fp8_mode(True, torch.bfloat16))[2])
    options = {"num_warps": meta.pop("num_warps"), "num_stages": meta.pop("num_stages"),
               "launch_pdl": meta.pop("launch_pdl")}
    types = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "y_ptr": "*bf16", "part_ptr": "*fp32",
             "count_ptr": "*i32", "scale_ptr": "*fp32"}
    ptx = compile_sm90(sg._kernels(False), types, {"stride_xk": 1, **meta}, options)
    return ptx, _ptxas_report(ptx)


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
@pytest.mark.parametrize("m,n,k,glu", [(4, 100352, 2048, False), (4, 16384, 2048, True), (4, 2048, 8192, False),
                                       (1, 100352, 2048, False), (1, 2048, 8192, False),
                                       (12, 100352, 2048, False), (8, 16384, 2048, True)],
                         ids=["lm_head4", "gate_up4", "down4", "lm_head1", "down1", "lm_head12", "gate_up8"])
def test_sm90_fp8_builds_widen_in_registers_without_spills(m, n, k, glu) -> None:
    """The XS-2.1 drafter's streamed shapes (lm_head 100352 x 2048, the MLP's gate|up 16384 x 2048
    with the SwiGLU, down and o_proj 2048 x 8192) at their fp8 default configs: the dot path on
    tensor cores (wgmma with a warpgroup of 4 warps or more, mma.sync with fewer: the measured
    lm_head config has 2)."""
    ptx, report = _compile_fp8(m, n, k, glu)
    assert "cvt.rn.bf16x2.e4m3x2" in ptx or "e4m3" in ptx  # the weight widened from e4m3
    assert re.findall(r"(\d+) bytes spill stores", report) == ["0"]
    cfg = sg.default_config(m, n, k, fp8=True)
    if sg._use_dot(cfg, m):
        assert ("wgmma.mma_async" if cfg.num_warps >= 4 else "mma.sync.aligned") in ptx


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
@pytest.mark.parametrize("m", [1, 4])
def test_sm90_int8_lm_head_builds_without_spills(m) -> None:
    """The greedy lm_head's int8 copy at its default configs (a GEMV at one row, the e4m3 table's
    dot tile at four, mma.sync at its 2 warps): nothing spilled."""
    cfg = sg.default_config(m, 100352, 2048, int8=True)
    meta = dict(sg._plan(m, 100352, 2048, torch.bfloat16, cfg, False, True,
                         w_fp8=sg.fp8_mode(True, torch.bfloat16, torch.int8))[2])
    options = {"num_warps": meta.pop("num_warps"), "num_stages": meta.pop("num_stages"),
               "launch_pdl": meta.pop("launch_pdl")}
    types = {"x_ptr": "*bf16", "w_ptr": "*i8", "y_ptr": "*bf16", "part_ptr": "*fp32",
             "count_ptr": "*i32", "scale_ptr": "*fp32"}
    ptx = compile_sm90(sg._kernels(False), types, {"stride_xk": 1, **meta}, options)
    assert re.findall(r"(\d+) bytes spill stores", _ptxas_report(ptx)) == ["0"]
    assert sg._use_dot(cfg, m) == (m > 1) == ("mma.sync.aligned" in ptx)


# ---- CUDA ---------------------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("m,n,k,glu", [(4, 100352, 2048, False), (4, 16384, 2048, True), (4, 2048, 8192, False),
                                       (1, 2048, 8192, False), (16, 2048, 8192, False), (6, 100352, 2048, False),
                                       (16, 100352, 2048, False), (8, 16384, 2048, True), (12, 16384, 2048, True)])
def test_cuda_drafter_shapes(m, n, k, glu) -> None:
    x, w8, scale = _problem(m, n, k, torch.bfloat16, seed=m + n, device="cuda")
    y = skinny_gemm(x, w8, glu=glu, scale=scale)
    if glu:
        assert torch.equal(y, silu_mul(skinny_gemm(x, w8, scale=scale)))
    else:
        _assert_close_to_exact(y.cpu(), x.cpu(), w8.cpu(), scale.cpu())


@cuda
def test_cuda_graph_replay() -> None:
    x, w8, scale = _problem(4, 2048, 8192, torch.bfloat16, seed=1, device="cuda")
    expected = skinny_gemm(x, w8, scale=scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = skinny_gemm(x, w8, scale=scale)
    x.copy_(_problem(4, 2048, 8192, torch.bfloat16, seed=2, device="cuda")[0])
    graph.replay()
    assert not torch.equal(y, expected)
    assert torch.equal(y, skinny_gemm(x, w8, scale=scale))


@cuda
def test_cuda_fp16_widening_matches_bf16_widening_and_saturates(monkeypatch) -> None:
    """FP8_DOT_F16 (the dot path's e4m3 tiles and a bf16 x in fp16): within the rounding of the
    bf16 widening's result for ordinary x (the products are exact in both, only the fp32 order
    and x's tails differ); an x beyond fp16's 65504 saturates instead of turning inf."""
    x, w8, scale = _problem(4, 16384, 2048, torch.bfloat16, seed=3, device="cuda")
    assert sg.fp8_mode(True, torch.bfloat16) == 2
    widened16 = skinny_gemm(x, w8, scale=scale)
    monkeypatch.setattr(sg, "FP8_DOT_F16", False)
    assert sg.fp8_mode(True, torch.bfloat16) == 1
    widened_bf16 = skinny_gemm(x, w8, scale=scale)
    torch.testing.assert_close(widened16.float(), widened_bf16.float(), rtol=2.0**-7, atol=1e-2)
    monkeypatch.setattr(sg, "FP8_DOT_F16", True)
    x[0, 0] = 1e6  # bf16 holds it, fp16 does not
    y = skinny_gemm(x, w8, scale=scale)
    assert torch.isfinite(y).all()
    _assert_close_to_exact(y[1:].cpu(), x[1:].cpu(), w8.cpu(), scale.cpu())


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="triton not installed / already the child")
def test_rows_benchmark_cpu_wiring_check() -> None:
    """``bench_fp8_rows.py --device cpu --tiny --each`` runs under the interpreter: a table row
    per row count (5: the one-launch kernel; 17, 40: row blocks), each candidate checked against
    the fp32 product (none reported wrong) and timed (``--each``: the configured one and both
    candidates)."""
    repo = Path(__file__).resolve().parent.parent
    proc = run_interpreted_script(repo / "benchmarks" / "bench_fp8_rows.py", "--device", "cpu", "--tiny",
                                  "--each", cwd=repo)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 256 x 128 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["5", "17", "40"], proc.stdout
    each = [line for line in proc.stdout.splitlines() if line.startswith("  256 x 128, ")]
    assert [line.split(" rows")[0].split(", ")[1] for line in each] == ["5", "17", "40"], each
    assert all(line.split(": ", 1)[1].startswith("configured ") and len(line.split("; ")) == 3
               for line in each), each
    assert "wrong" not in proc.stdout
