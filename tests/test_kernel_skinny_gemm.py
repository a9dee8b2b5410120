"""Skinny GEMM kernel (``kernels/skinny_gemm.py``) against an fp64 reference and ``F.linear``.

* Under Triton's CPU interpreter (``TRITON_INTERPRET=1``): triton reads the variable when it is
  imported, so the interpreted tests run in a child pytest with the variable set and skip in this
  process (as in ``test_kernel_moe_routing.py``). They cover M in {1, 3, 16}, N not a multiple of
  block_n and K not a multiple of block_k (and the unmasked even-tile path), split_k 1 / 3 / 4
  (3 is trimmed to the non-empty chunks), the ``tl.dot`` path and the GEMV (with and without the
  register prefetch, x broadcast both ways; M = 16 rejected), evict_first off, fp32 (a rigorous
  fp32-accumulation bound) and bf16 / fp16 (one output rounding on top); repeated calls (the
  split-K counters re-arm: same input -> bitwise equal, new input -> correct, and a counter left
  armed is detected); strided x / weight; the default config; availability.
* Offline sm_90 compile (no GPU; triton's CUDA backend and ptxas): the PTX the H200 would run has
  no shared memory / barrier in the GEMV loop and 16-byte evict_first weight loads, cp.async +
  wgmma on the dot path, and the acq_rel counter / .cg reads of split-K.
* On CUDA (skipped without one): the Laguna shapes with M in {1, 2, 4, 8, 16} (default config),
  explicit configs in bf16 / fp16 / fp32 (split-K included), bitwise reproducibility of split-K,
  and CUDA-graph capture + replay.
* Everywhere: input / config validation (ValueError naming the argument), empty shapes, the
  default-config table, importing without triton, and the benchmark script's CPU wiring check
  (``--device cpu --tiny`` under the interpreter, a few seconds).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from interpreter_child import (
    HAS_TRITON,
    INTERPRETED,
    interpreted,
    run_interpreted_child,
    run_interpreted_script,
)
from ptx_sm90 import can_compile_sm90, compile_sm90, loads_before_pdl_wait

from laguna_dflash.kernels import pdl
from laguna_dflash.kernels import skinny_gemm as sg
from laguna_dflash.kernels.skinny_gemm import SkinnyConfig, skinny_gemm

HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON) or INTERPRETED, reason="needs CUDA and triton")
REPO = Path(__file__).resolve().parent.parent

# unit roundoff of the output dtype (round to nearest: relative error <= u)
_U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _problem(m: int, n: int, k: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(device=device, dtype=dtype)
    return x, w


def _assert_close_to_exact(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """``y`` is ``x @ w^T`` accumulated in fp32 in SOME order, rounded once to y.dtype.

    Bound: any fp32 summation order of K exact products is within ``g * sum |x||w|`` of the exact
    sum, ``g = K u32 / (1 - K u32)``; rounding that to the output dtype adds ``u_out * |s|``.
    """
    assert y.dtype == x.dtype and y.shape == (x.shape[0], w.shape[0]) and y.is_contiguous()
    xd, wd = x.double(), w.double()  # on x's device (fp64 matmul)
    exact = xd @ wd.T
    absprod = xd.abs() @ wd.abs().T
    k = x.shape[1]
    g = k * 2.0**-24 / (1 - k * 2.0**-24)
    bound = g * absprod + _U[y.dtype] * (exact.abs() + g * absprod) + 1e-30
    err = (y.double() - exact).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {worst:.3g} x the fp32-accumulation bound"


# ---- Triton kernel (CPU interpreter) ----------------------------------------------------------------


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="triton not installed / already the child")
def test_kernel_under_triton_interpreter() -> None:
    run_interpreted_child(__file__)


# (block_n, block_k, split_k, num_stages, use_dot, x_bcast, evict_first) on N = 40, K = 100:
# ragged N and K tiles; GEMV with num_stages 1 (plain) and 2 (register prefetch)
_CONFIGS = [
    (16, 32, 1, 1, False, True, True),
    (8, 64, 3, 2, False, True, True),  # 3 splits of 64 -> 2 non-empty chunks (trimmed)
    (32, 16, 4, 2, False, False, False),
    (16, 32, 1, 2, True, True, True),
    (32, 16, 4, 3, True, True, True),
]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("bn,bk,split,stages,use_dot,x_bcast,evict", _CONFIGS)
def test_interpreted_matches_reference(bn, bk, split, stages, use_dot, x_bcast, evict, m, dtype) -> None:
    x, w = _problem(m, 40, 100, dtype, seed=m * 7 + bn)
    cfg = SkinnyConfig(bn, bk, split, num_warps=2, num_stages=stages, use_dot=use_dot,
                       evict_first=evict, x_bcast=x_bcast)
    if not use_dot and m > 4:
        with pytest.raises(ValueError, match="config.use_dot=False"):  # the GEMV has <= 4 rows
            skinny_gemm(x, w, cfg)
        return
    y = skinny_gemm(x, w, cfg)
    _assert_close_to_exact(y, x, w)
    ref = sg.skinny_gemm_reference(x, w)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2 * _U[dtype] + 1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("use_dot", [False, True], ids=["gemv", "dot"])
def test_interpreted_even_tiles_unmasked(use_dot) -> None:
    # N % block_n == 0 and K == split_k * chunk: the weight loads run unmasked
    x, w = _problem(4, 64, 256, torch.bfloat16, seed=11)
    for split in (1, 2):
        for stages in (1, 2):  # GEMV: without / with the register prefetch
            y = skinny_gemm(x, w, SkinnyConfig(16, 64, split, num_stages=stages, use_dot=use_dot))
            _assert_close_to_exact(y, x, w)


@interpreted
@pytest.mark.parametrize("use_dot", [False, True], ids=["gemv", "dot"])
def test_interpreted_repeat_calls_rearm_split_k(use_dot) -> None:
    cfg = SkinnyConfig(16, 16, 4, use_dot=use_dot)
    x, w = _problem(3, 40, 100, torch.bfloat16, seed=5)
    y1 = skinny_gemm(x, w, cfg)
    _, counters = sg._WORKSPACES[(x.device, 40, 4)]
    assert torch.count_nonzero(counters) == 0  # the last program re-armed every counter
    y2 = skinny_gemm(x, w, cfg)
    assert torch.equal(y1, y2)
    x2, _ = _problem(3, 40, 100, torch.bfloat16, seed=6)
    y3 = skinny_gemm(x2, w, cfg)  # stale partials must not leak into a new call
    _assert_close_to_exact(y3, x2, w)
    assert not torch.equal(y3, y1)
    # the counters really decide who finishes: one left at 1 makes the third arrival sum a stale
    # slab (x2's partial) into column tile 0
    counters[0] = 1
    y4 = skinny_gemm(x, w, cfg)
    counters.zero_()
    assert not torch.equal(y4[:, :16], y1[:, :16]) and torch.equal(y4[:, 16:], y1[:, 16:])


@interpreted
def test_interpreted_strided_inputs_fp16() -> None:
    g = torch.Generator().manual_seed(3)
    wide_w = torch.randn(40, 130, generator=g).to(torch.float16)
    w = wide_w[:, 10:110]  # row stride 130, unit column stride
    base = torch.randn(4, 150, generator=g).to(torch.float16)
    cases = [base[:, 20:120], torch.randn(100, 4, generator=g).to(torch.float16).t()]  # row / column strided
    for x in cases:
        for cfg in (SkinnyConfig(16, 32, 2, use_dot=False), SkinnyConfig(16, 32, 2, use_dot=False, x_bcast=False),
                    SkinnyConfig(16, 32, 2, use_dot=True)):
            _assert_close_to_exact(skinny_gemm(x, w, cfg), x, w)


@interpreted
@pytest.mark.parametrize("m", [1, 5])
def test_interpreted_default_config(m) -> None:
    x, w = _problem(m, 24, 2048, torch.bfloat16, seed=m)
    cfg = sg.default_config(m, 24, 2048)
    assert cfg.split_k > 1  # a 24-column weight fills no GPU without splitting K
    _assert_close_to_exact(skinny_gemm(x, w), x, w)


# Laguna-S-2.1's fused attention input projection: Q (72 heads) | K | V (8 heads each) | the
# per-head gate (72), over hidden 3072
S21_QKVG_N, S21_K = (72 + 8 + 8) * 128 + 72, 3072


@interpreted
@pytest.mark.parametrize("m", [1, 5], ids=["s21_gemv", "s21_dot"])
def test_interpreted_s21_qkvg_projection_tail(m) -> None:
    """K = 3072 with the config ``default_config`` picks for the full S-2.1 Q|K|V|gate shape
    (N = 11336: 11336 = 8 mod every block_n >= 16, so its last column tile is ragged), run on the
    last 200 rows of such a weight (200 = 11336 mod 64 + 3 * 64: the same ragged tail; the full N
    is 355 GEMV programs x 24 K steps, minutes under the interpreter; it runs in the CUDA test)."""
    cfg = sg.default_config(m, S21_QKVG_N, S21_K)
    assert S21_QKVG_N % cfg.block_n == 200 % cfg.block_n != 0
    full = sg._plan(m, S21_QKVG_N, S21_K, torch.bfloat16, cfg, True)
    tail = sg._plan(m, 200, S21_K, torch.bfloat16, cfg, True)
    assert full[2] == tail[2] and full[1] == tail[1]  # same constexprs (MASK_W on) and split
    x, w = _problem(m, 200, S21_K, torch.bfloat16, seed=m)
    _assert_close_to_exact(skinny_gemm(x, w, cfg), x, w)


@interpreted
def test_interpreted_is_available() -> None:
    assert sg.is_available("cpu")
    x, w = _problem(16, 8, 8, torch.float32, seed=0)
    assert sg.can_use(x, w)
    assert not sg.can_use(torch.zeros(17, 8), w)
    assert not sg.can_use(x, w.to(torch.bfloat16))
    assert not sg.can_use(x, torch.zeros(8, 16).t())


# ---- everywhere ---------------------------------------------------------------------------------------


def test_rejects_bad_inputs() -> None:
    x, w = torch.zeros(2, 16), torch.zeros(8, 16)
    bad_args = [
        ({"x": torch.zeros(16)}, "x must be a 2-D"),
        ({"x": torch.zeros(1, 2, 16)}, "x must be a 2-D"),
        ({"weight": torch.zeros(16)}, "weight must be a 2-D"),
        ({"x": torch.zeros(17, 16)}, "M=17"),
        ({"x": torch.zeros(2, 15)}, "disagree on K"),
        ({"x": torch.zeros(2, 16, dtype=torch.int32), "weight": torch.zeros(8, 16, dtype=torch.int32)}, "x must be"),
        ({"weight": torch.zeros(8, 16, dtype=torch.bfloat16)}, "weight dtype"),
        ({"weight": torch.zeros(16, 8).t()}, "unit column stride"),
    ]
    for override, match in bad_args:
        kwargs = {"x": x, "weight": w, **override}
        with pytest.raises(ValueError, match=match):
            skinny_gemm(**kwargs)
    bad_configs = [
        (SkinnyConfig(12, 32), "config.block_n"),
        (SkinnyConfig(4, 32), "config.block_n"),
        (SkinnyConfig(8, 32, use_dot=True), r"config.block_n .*tl.dot"),
        (SkinnyConfig(16, 8), "config.block_k"),
        (SkinnyConfig(16, 48), "config.block_k"),
        (SkinnyConfig(16, 32, split_k=0), "config.split_k"),
        (SkinnyConfig(16, 32, split_k=True), "config.split_k"),
        (SkinnyConfig(16, 32, num_warps=3), "config.num_warps"),
        (SkinnyConfig(16, 32, num_stages=0), "config.num_stages"),
        ((16, 32, 1, 4, 3), "config must be a SkinnyConfig"),
    ]
    for cfg, match in bad_configs:
        with pytest.raises(ValueError, match=match):
            skinny_gemm(x, w, cfg)
    with pytest.raises(ValueError, match="config.use_dot=False .* M <= 4"):
        skinny_gemm(torch.zeros(5, 16), w, SkinnyConfig(16, 32, use_dot=False))


def test_empty_shapes_need_no_launch() -> None:
    # no kernel runs for M = 0, N = 0 or K = 0 (so this works without triton / the interpreter)
    cfg = SkinnyConfig(16, 32)
    assert skinny_gemm(torch.zeros(0, 16), torch.zeros(8, 16), cfg).shape == (0, 8)
    assert skinny_gemm(torch.zeros(3, 16), torch.zeros(0, 16), cfg).shape == (3, 0)
    y = skinny_gemm(torch.zeros(3, 0, dtype=torch.bfloat16), torch.zeros(8, 0, dtype=torch.bfloat16), cfg)
    assert y.dtype == torch.bfloat16 and torch.equal(y, torch.zeros(3, 8, dtype=torch.bfloat16))


_SHAPES = [(10304, 2048), (8240, 2048), (2048, 8192), (2048, 6144), (256, 2048), (16384, 2048)]


def test_default_config_table(monkeypatch) -> None:
    for n, k in _SHAPES:
        for m in range(1, 17):
            cfg = sg.default_config(m, n, k)
            use_dot = cfg.use_dot if cfg.use_dot is not None else m > 4
            sg._check_config(cfg, use_dot, m)  # valid for the launch
            assert cfg.split_k * cfg.block_k <= k
            if not use_dot:  # the GEMV accumulator stays <= 64 fp32 registers a thread
                m_pad = 1 << (m - 1).bit_length()
                assert m_pad * cfg.block_n * cfg.block_k <= 64 * 32 * cfg.num_warps
    # measured entries: the smallest bucket >= next_pow2(M) of this (N, K) wins
    four = SkinnyConfig(32, 256, 2, 8, 4, use_dot=True)
    sixteen = SkinnyConfig(64, 128, 1, 4, 3, use_dot=True)
    monkeypatch.setattr(sg, "_MEASURED", {(4, 256, 2048): four, (16, 256, 2048): sixteen})
    sg._table_config.cache_clear()
    try:
        assert sg.default_config(3, 256, 2048) is four
        assert sg.default_config(1, 256, 2048) is four
        assert sg.default_config(5, 256, 2048) is sixteen
        assert sg.default_config(1, 256, 4096) == sg._heuristic_config(1, 256, 4096)
        # only measured shapes count as tuned (layers.linear keeps cuBLAS for the others)
        assert sg.is_tuned(1, 256, 2048) and sg.is_tuned(16, 256, 2048)
        assert not sg.is_tuned(17, 256, 2048) and not sg.is_tuned(1, 256, 4096)
    finally:
        monkeypatch.undo()
        sg._table_config.cache_clear()


def test_config_overrides_replace_fields_of_one_shape_bucket(monkeypatch) -> None:
    """``CONFIG_OVERRIDES`` (the in-graph sweep knob) replaces the named fields of its shape
    bucket's config and nothing else; an unknown field is an error naming the fields."""
    table = sg.default_config(4, 2048, 8192)
    monkeypatch.setattr(sg, "CONFIG_OVERRIDES", {"4,2048,8192": {"split_k": 8, "num_warps": 8}})
    got = sg.default_config(3, 2048, 8192)
    assert got == dataclasses.replace(table, split_k=8, num_warps=8) and got != table
    assert sg.default_config(1, 2048, 8192) == sg._table_config(1, 2048, 8192)  # bucket 1
    assert sg.default_config(16, 2048, 8192) == sg._table_config(16, 2048, 8192)
    monkeypatch.setattr(sg, "CONFIG_OVERRIDES", {"4,2048,8192": {"splitk": 8}})
    with pytest.raises(ValueError, match="CONFIG_OVERRIDES entry .*fields are .*split_k"):
        sg.default_config(4, 2048, 8192)


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="triton not installed / interpreter on")
def test_not_available_on_cpu_without_interpreter() -> None:
    assert not sg.is_available("cpu")
    assert not sg.can_use(torch.zeros(1, 8), torch.zeros(8, 8))


def test_imports_and_reports_unavailable_without_triton() -> None:
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\n"
            "from laguna_dflash.kernels import skinny_gemm as sg\n"
            "assert not sg.is_available('cpu') and not sg.can_use(torch.zeros(1, 8), torch.zeros(8, 8))\n"
            "print(sg.default_config(1, 2048, 8192))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SkinnyConfig(" in proc.stdout


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="triton not installed / already the child")
def test_benchmark_cpu_wiring_check() -> None:
    """``bench_skinny_gemm.py --device cpu --tiny`` runs under the interpreter and prints the
    table and a ``_MEASURED`` dict that evaluates to SkinnyConfigs keyed (m_bucket, N, K)."""
    proc = run_interpreted_script(REPO / "benchmarks" / "bench_skinny_gemm.py", "--device", "cpu",
                                  "--tiny", "--m", "1,3", cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "| shape |" in out and "cuBLAS" in out
    block = out[out.index("_MEASURED = {"):]
    block = block[: block.index("\n}") + 2]
    table = eval(block.split("=", 1)[1], {"SkinnyConfig": SkinnyConfig})  # noqa: S307 - our own output
    assert table and all(isinstance(c, SkinnyConfig) for c in table.values())
    assert {key[0] for key in table} == {1, 4}  # M = 1 and M = 3 (bucket 4)
    assert all(len(key) == 3 and key[1:] in {(40, 96), (24, 160)} for key in table)


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="triton not installed / already the child")
@pytest.mark.parametrize("flag", ["--fp8", "--int8"])
def test_benchmark_cpu_wiring_check_one_byte_weights(flag) -> None:
    """``--fp8`` / ``--int8``: the one-byte weights are checked against their own dequantized
    reference (no candidate reported wrong), the bf16 kernel is timed beside them, and the printed
    dict is the e4m3 table's (``_MEASURED_FP8``) or the int8 copy's (``_MEASURED_INT8``)."""
    proc = run_interpreted_script(REPO / "benchmarks" / "bench_skinny_gemm.py", "--device", "cpu",
                                  "--tiny", "--m", "1", flag, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    kind = flag[2:]
    assert f"{kind} weights ({'int8' if kind == 'int8' else 'e4m3'} rows, fp32 scales)" in out
    assert "candidates failed" not in out, out[-3000:]
    block = out[out.index("_MEASURED_INT8 = {" if kind == "int8" else "_MEASURED_FP8 = {"):]
    block = block[: block.index("\n}") + 2]
    table = eval(block.split("=", 1)[1], {"SkinnyConfig": SkinnyConfig})  # noqa: S307 - our own output
    assert set(table) == {(1, 40, 96), (1, 24, 160)}


# ---- offline sm_90 compile (no GPU needed) -------------------------------------------------------------


def _compile_sm90(m: int, n: int, k: int, cfg: SkinnyConfig, pdl: bool = False) -> str:
    """PTX of the kernel compiled for an H100/H200 (sm_90) with bf16 inputs, through ptxas (the
    launch's own constexprs from ``_plan``); no driver or GPU involved."""
    meta = dict(sg._plan(m, n, k, torch.bfloat16, cfg, False, pdl)[2])
    options = {"num_warps": meta.pop("num_warps"), "num_stages": meta.pop("num_stages")}
    if "launch_pdl" in meta:
        options["launch_pdl"] = meta.pop("launch_pdl")
    pointers = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32"}
    return compile_sm90(sg._kernels(False), pointers, {"stride_xk": 1, **meta}, options)


def _loop_bodies(ptx: str) -> list[str]:
    lines = ptx.splitlines()
    bodies = []
    for i, line in enumerate(lines):
        if "Loop Header" in line:
            label = line.split(":")[0].strip()
            end = next(j for j in range(i, len(lines)) if "bra" in lines[j] and label in lines[j])
            bodies.append("\n".join(lines[i:end + 1]))
    return bodies


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
def test_sm90_code_shape() -> None:
    """What the GPU will run, checked without a GPU: the GEMV K loop has no shared memory or
    barrier and streams the weight with 16-byte evict_first loads (also with the prefetch); the
    dot path pipelines through cp.async into wgmma; split-K syncs through an acq_rel atomic and
    L2 (.cg) reads. Catches layout regressions that the interpreter cannot see."""
    for m, cfg in ((1, SkinnyConfig(32, 128, 1, 4, 1, use_dot=False)),
                   (1, SkinnyConfig(32, 256, 1, 4, 2, use_dot=False)),
                   (4, SkinnyConfig(8, 128, 2, 4, 2, use_dot=False))):
        ptx = _compile_sm90(m, 2048, 2048, cfg)
        (body,) = _loop_bodies(ptx)
        assert "bar.sync" not in body and "st.shared" not in body, cfg
        assert "ld.global.L1::evict_first.L2::cache_hint.v4.b32" in body, cfg
    ptx = _compile_sm90(1, 2048, 2048, SkinnyConfig(32, 128, 1, 4, 1, use_dot=False, x_bcast=False))
    assert "st.shared" in _loop_bodies(ptx)[0]  # the documented alternative: x through smem
    ptx = _compile_sm90(16, 2048, 8192, SkinnyConfig(64, 128, 4, 4, 4, use_dot=True))
    assert any("cp.async" in b and "wgmma.mma_async" in b for b in _loop_bodies(ptx))
    assert "atom.global.gpu.acq_rel.add" in ptx and "ld.global.cg" in ptx
    assert "atom" not in _compile_sm90(8, 2048, 2048, SkinnyConfig(32, 64, 1, 4, 3, use_dot=True))


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
def test_sm90_programmatic_dependent_launch_code() -> None:
    """``pdl.USE_PDL``: the GEMV loads its first weight tile, then waits for the previous kernel
    (griddepcontrol.wait) before the loop, and signals its dependents after the loop; the dot
    path waits before any load; without PDL neither instruction is emitted."""
    gemv = SkinnyConfig(16, 256, 4, 4, 2, use_dot=False)
    assert "griddepcontrol" not in _compile_sm90(1, 2048, 8192, gemv)
    ptx = _compile_sm90(1, 2048, 8192, gemv, pdl=True)
    early = loads_before_pdl_wait(ptx)
    assert early and all("evict_first" in line for line in early)  # weights only, never x
    assert ptx.index("griddepcontrol.wait") < ptx.index("Loop Header")  # the K loop after it
    ptx = _compile_sm90(16, 2048, 8192, SkinnyConfig(64, 128, 4, 4, 4, use_dot=True), pdl=True)
    assert loads_before_pdl_wait(ptx) == []


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
def test_sm90_measured_dot_configs_fit_in_shared_memory_in_every_dtype() -> None:
    """Every measured dot-path config (tuned in bf16) builds for sm_90 within a program's 227 KiB
    of shared memory in bf16 and in fp32 too, where the 4-stage 64 x 256 tiles would need 240 KiB
    without the fp32 stage cap (a float32 engine at Laguna widths failed its graph capture)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    kernel = sg._kernels(False)
    checked = 0
    for (bucket, n, k), cfg in sg._MEASURED.items():
        if not sg._use_dot(cfg, bucket):
            continue
        for dtype, ptr in ((torch.bfloat16, "*bf16"), (torch.float32, "*fp32")):
            meta = dict(sg._plan(bucket, n, k, dtype, cfg, False, True)[2])
            options = {"num_warps": meta.pop("num_warps"), "num_stages": meta.pop("num_stages"),
                       "launch_pdl": meta.pop("launch_pdl")}
            types = {"x_ptr": ptr, "w_ptr": ptr, "y_ptr": ptr, "part_ptr": "*fp32", "count_ptr": "*i32"}
            signature = {a: types.get(a, "constexpr" if a in meta else "i32") for a in kernel.arg_names}
            built = compile(ASTSource(fn=kernel, signature=signature, constexprs=meta),
                            target=GPUTarget("cuda", 90, 32), options=options)
            assert built.metadata.shared <= 227 * 1024, (bucket, n, k, dtype, built.metadata.shared)
            checked += 1
    assert checked >= 20


def test_fp32_dot_stages_are_capped_and_bf16_kept() -> None:
    cfg = SkinnyConfig(64, 256, 1, 4, 4, use_dot=True)
    assert sg._dot_stages(cfg, torch.bfloat16) == 4
    assert sg._dot_stages(cfg, torch.float32) == 3  # 2 x 80 KiB in flight, not 3 x 80
    assert sg._dot_stages(SkinnyConfig(16, 256, 1, 4, 2, use_dot=True), torch.float32) == 2
    assert sg._plan(4, 2048, 6144, torch.float32, sg.default_config(4, 2048, 6144), False)[2]["num_stages"] == 3


def test_pdl_needs_a_compiled_sm90_gpu(monkeypatch) -> None:
    cfg = SkinnyConfig(16, 256, 4, 4, 2, use_dot=False)
    meta = sg._plan(1, 2048, 8192, torch.bfloat16, cfg, False)[2]
    assert meta["PDL"] is False and "launch_pdl" not in meta
    meta = sg._plan(1, 2048, 8192, torch.bfloat16, cfg, False, True)[2]
    assert meta["PDL"] is True and meta["launch_pdl"] is True
    assert pdl.USE_PDL is True  # on by default since the H200 A/B (docs/PERFORMANCE.md)
    assert not pdl.active(torch.device("cpu"), False)
    if HAS_CUDA:
        assert not pdl.active(torch.device("cuda"), True)  # never under the interpreter


# ---- CUDA -------------------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("n,k", _SHAPES)
def test_cuda_real_shapes(n, k, m) -> None:
    x, w = _problem(m, n, k, torch.bfloat16, seed=m + n, device="cuda")
    y = skinny_gemm(x, w)
    _assert_close_to_exact(y, x, w)
    ref = F.linear(x, w)  # cuBLAS: another fp32 summation order; at most ~1 bf16 ulp apart
    torch.testing.assert_close(y.float(), ref.float(), rtol=4 * _U[torch.bfloat16], atol=1e-3)


@cuda
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("n,k", [(S21_QKVG_N, S21_K), (3072, 9216), (256, S21_K)],
                         ids=["s21_qkvg", "s21_o_proj", "s21_router"])
def test_cuda_s21_shapes(n, k, m) -> None:
    for dtype in (torch.bfloat16, torch.float32):
        x, w = _problem(m, n, k, dtype, seed=m, device="cuda")
        _assert_close_to_exact(skinny_gemm(x, w), x, w)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("cfg", [
    SkinnyConfig(32, 128, 1, 4, 3, use_dot=False),
    SkinnyConfig(16, 256, 4, 4, 3, use_dot=False),
    SkinnyConfig(64, 128, 1, 4, 4, use_dot=True),
    SkinnyConfig(64, 128, 4, 4, 4, use_dot=True, evict_first=False),
    SkinnyConfig(128, 64, 2, 8, 3, use_dot=True),
], ids=str)
def test_cuda_explicit_configs(cfg, dtype) -> None:
    for m, n, k in ((1, 2048, 6144), (3, 2048 + 40, 2048 + 48), (16, 256, 2048)):
        if not cfg.use_dot and m > 4:
            continue  # the GEMV takes <= 4 rows
        x, w = _problem(m, n, k, dtype, seed=m, device="cuda")
        _assert_close_to_exact(skinny_gemm(x, w, cfg), x, w)


@cuda
def test_cuda_split_k_reproducible() -> None:
    # the split-order sum is bitwise stable over many calls (arrival order varies on the GPU)
    x, w = _problem(4, 2048, 8192, torch.bfloat16, seed=1, device="cuda")
    cfg = SkinnyConfig(16, 128, 8, use_dot=False)
    first = skinny_gemm(x, w, cfg)
    for _ in range(50):
        assert torch.equal(skinny_gemm(x, w, cfg), first)
    _assert_close_to_exact(first, x, w)


@cuda
@pytest.mark.parametrize("m", [1, 16])
def test_cuda_graph_capture(m) -> None:
    x, w = _problem(m, 2048, 8192, torch.bfloat16, seed=0, device="cuda")
    configs = [None, SkinnyConfig(64, 128, 4, use_dot=True)]
    if m <= 4:
        configs.append(SkinnyConfig(16, 256, 4, use_dot=False))
    for cfg in configs:  # compile and allocate the workspaces outside the capture
        skinny_gemm(x, w, cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [skinny_gemm(x, w, cfg) for cfg in configs]
    for seed in (1, 2):
        x.copy_(_problem(m, 2048, 8192, torch.bfloat16, seed=seed, device="cuda")[0])
        for _ in range(3):  # every replay leaves the counters re-armed
            graph.replay()
        torch.cuda.synchronize()
        for cfg, out in zip(configs, outs):
            assert torch.equal(out, skinny_gemm(x, w, cfg))
            _assert_close_to_exact(out, x, w)


@cuda
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability() < (9, 0), reason="needs sm90+")
def test_cuda_programmatic_dependent_launch_in_a_graph(monkeypatch) -> None:
    """With ``pdl.USE_PDL`` each GEMM may start while the kernel writing its x still runs: inside a
    captured chain (x written by the previous kernel, split-K and not) the results equal the
    non-PDL launches bitwise, over replays with new inputs."""
    configs = [SkinnyConfig(16, 256, 4, 4, 2, use_dot=False), SkinnyConfig(16, 256, 1, 4, 2, use_dot=False),
               SkinnyConfig(64, 128, 4, 4, 4, use_dot=True)]
    src, w = _problem(4, 2048, 8192, torch.bfloat16, seed=0, device="cuda")
    x = torch.empty_like(src)
    want = {}
    for cfg in configs:
        want[cfg] = skinny_gemm(src * 2, w, cfg)
    monkeypatch.setattr(pdl, "USE_PDL", True)
    for cfg in configs:  # compile outside the capture
        torch.mul(src, 2, out=x)
        assert torch.equal(skinny_gemm(x, w, cfg), want[cfg])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = []
        for cfg in configs:
            torch.mul(src, 2, out=x)  # the producer of x, right before the dependent launch
            outs.append(skinny_gemm(x, w, cfg))
    for seed in (1, 2, 3):
        src.copy_(_problem(4, 2048, 8192, torch.bfloat16, seed=seed, device="cuda")[0])
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setattr(pdl, "USE_PDL", False)
        for cfg, out in zip(configs, outs):
            assert torch.equal(out, skinny_gemm(src * 2, w, cfg)), cfg
        monkeypatch.setattr(pdl, "USE_PDL", True)


def test_bound_helper_can_fail() -> None:
    # the accuracy check rejects an off-by-one-ulp-of-bf16-scale error on an fp32 result
    x, w = _problem(2, 8, 64, torch.float32, seed=0)
    y = (x.double() @ w.double().T).float()
    _assert_close_to_exact(y, x, w)
    with pytest.raises(AssertionError, match="bound"):
        _assert_close_to_exact(y * (1 + 2.0**-9), x, w)


@cuda
def test_cuda_layers_linear_takes_the_kernel_only_while_a_graph_is_built_and_where_tuned(monkeypatch) -> None:
    """``models.layers.linear`` routes a tuned decode shape through the kernel while a CUDA
    graph is built (same values as F.linear up to accumulation order) and keeps cuBLAS eagerly
    (its launch costs less host time), for untuned shapes, biases and M > 16."""
    from laguna_dflash.models import layers

    calls = []
    original = sg.skinny_gemm
    monkeypatch.setattr(sg, "skinny_gemm", lambda x, w, cfg=None: (calls.append(x.shape[0]), original(x, w, cfg))[1])
    with torch.inference_mode():
        x, w = _problem(1, 2048, 8192, torch.bfloat16, seed=0, device="cuda")  # o_proj: tuned
        layers.linear(x, w)
        assert calls == []  # eager: cuBLAS
        with layers.building_cuda_graph():
            for m in (1, 4, 16):
                x, w = _problem(m, 2048, 8192, torch.bfloat16, seed=m, device="cuda")
                _assert_close_to_exact(layers.linear(x, w), x, w)
            assert calls == [1, 4, 16]
            x, w = _problem(17, 2048, 8192, torch.bfloat16, seed=0, device="cuda")
            layers.linear(x, w)
            x, w = _problem(1, 2048 + 40, 2048, torch.bfloat16, seed=0, device="cuda")  # untuned
            layers.linear(x, w)
            layers.linear(x, w, torch.zeros(w.shape[0], device="cuda", dtype=w.dtype))
        assert calls == [1, 4, 16]


@cuda
def test_cuda_lm_head_takes_the_kernel_eagerly_where_tuned(monkeypatch) -> None:
    """``layers.lm_head_linear`` runs the measured lm_head shape (V 100352 x H 2048) through the
    kernel eagerly at 1..4 rows (within the accumulation bound of the exact logits), also in grad
    mode when nothing requires grad (the engine's steps); keeps cuBLAS where autograd is in play,
    for untuned row counts and shapes and with ``use_skinny_lm_head`` off; and
    ``build_lm_head_ahead`` submits the builds of the tuned row counts."""
    from laguna_dflash.models import layers

    calls = []
    original = sg.skinny_gemm
    monkeypatch.setattr(sg, "skinny_gemm", lambda x, w, cfg=None, glu=False: (calls.append(x.shape[0]), original(x, w, cfg, glu))[1])
    _, w = _problem(1, 100352, 2048, torch.bfloat16, seed=0, device="cuda")
    assert sg.is_tuned(1, 100352, 2048) and sg.is_tuned(4, 100352, 2048)
    assert torch.is_grad_enabled()
    for m in (1, 3, 4):
        x = _problem(m, 8, 2048, torch.bfloat16, seed=m, device="cuda")[0]
        _assert_close_to_exact(layers.lm_head_linear(x, w), x, w)
    assert calls == [1, 3, 4]
    x.requires_grad_(True)
    layers.lm_head_linear(x, w).sum().backward()  # autograd: cuBLAS
    assert calls == [1, 3, 4] and x.grad is not None
    with torch.inference_mode():
        layers.lm_head_linear(_problem(5, 8, 2048, torch.bfloat16, seed=5, device="cuda")[0], w)  # untuned
        x = _problem(1, 8, 2048, torch.bfloat16, seed=1, device="cuda")[0]
        layers.lm_head_linear(x, w[:50000])  # another vocabulary: untuned
        monkeypatch.setattr(layers, "use_skinny_lm_head", False)
        assert torch.equal(layers.lm_head_linear(x, w), F.linear(x, w))
        assert calls == [1, 3, 4]
        monkeypatch.setattr(layers, "use_skinny_lm_head", True)
    assert layers.build_lm_head_ahead(w) >= 0  # built already above: possibly nothing to submit
    assert calls[3:] == [1, 2, 3, 4]  # the tuned row counts, launched as builds only


@cuda
@pytest.mark.parametrize("vocab, hidden", [(100352, 3072), (50176, 2048), (50176, 3072)],
                         ids=["s21", "xs21-tp2", "s21-tp2"])
def test_cuda_lm_heads_of_s21_and_the_two_rank_shards_take_the_kernel(monkeypatch, vocab, hidden) -> None:
    """The measured entries for S-2.1's lm_head and both sizes' two-rank vocabulary shards: at 1..4
    rows ``lm_head_linear`` launches the skinny GEMM with the table's config (a GEMV at one row, a
    dot tile at 2-4), within the fp32-accumulation bound of the exact logits."""
    from laguna_dflash.models import layers

    configs = []
    original = sg.skinny_gemm
    monkeypatch.setattr(sg, "skinny_gemm", lambda x, w, cfg=None, glu=False: (
        configs.append(sg.default_config(x.shape[0], w.shape[0], w.shape[1])), original(x, w, cfg, glu))[1])
    _, w = _problem(1, vocab, hidden, torch.bfloat16, seed=0, device="cuda")
    with torch.inference_mode():
        for m in (1, 2, 3, 4):
            x = _problem(m, 8, hidden, torch.bfloat16, seed=m, device="cuda")[0]
            _assert_close_to_exact(layers.lm_head_linear(x, w), x, w)
    assert [c.use_dot for c in configs] == [False, True, True, True]


def test_lm_head_off_cuda_is_f_linear() -> None:
    from laguna_dflash.models import layers

    x, w = _problem(2, 64, 32, torch.float32, seed=0)
    assert torch.equal(layers.lm_head_linear(x, w), F.linear(x, w))
    assert layers.build_lm_head_ahead(w) == 0
    from laguna_dflash.kernels.greedy_lm_head import quantize

    w16 = w.to(torch.bfloat16)
    assert layers.build_lm_head_ahead(w16, quantize(w16)) == 0  # the int8 copy's launches too: CUDA only


@pytest.mark.parametrize("vocab, hidden", [(100352, 2048), (100352, 3072), (50176, 2048), (50176, 3072)],
                         ids=["xs21", "s21", "xs21-tp2", "s21-tp2"])
def test_lm_heads_of_both_sizes_and_their_two_rank_shards_are_tuned_at_1_to_4_rows(vocab, hidden) -> None:
    """Every lm_head the engine runs at XS-2.1 and S-2.1 widths, whole or split over two ranks by
    vocabulary, has measured configs for 1-4 rows (the sizes of batch-1 decode, the K = 3 verify and
    the drafter's block): a GEMV for one row, a dot tile for 2-4; more rows stay on cuBLAS."""
    from laguna_dflash.models import layers

    weight = torch.empty(vocab, hidden, device="meta")
    for m in (1, 2, 3, 4):
        assert layers._skinny_lm_head(m, weight), m
        assert sg.default_config(m, vocab, hidden).use_dot == (m > 1)
    assert not layers._skinny_lm_head(5, weight)
    assert not layers._skinny_lm_head(1, torch.empty(vocab + 1, hidden, device="meta"))


def test_graph_build_scope_nests_and_unwinds() -> None:
    from laguna_dflash.models import layers

    assert layers._num_graph_builds == 0
    with pytest.raises(RuntimeError), layers.building_cuda_graph():
        with layers.building_cuda_graph():
            assert layers._num_graph_builds == 2
        raise RuntimeError("a failed capture")
    assert layers._num_graph_builds == 0
