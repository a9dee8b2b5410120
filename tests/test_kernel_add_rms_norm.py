"""Residual add + RMSNorm kernel (``kernels/add_rms_norm.py``) against ``fusion``'s eager bodies.

* Under Triton's CPU interpreter (child pytest, ``TRITON_INTERPRET=1``): the three forms (plain
  RMSNorm, ``[T, H]`` delta, MoE pairs ``[T, P, H]``; and the add alone) equal
  ``fusion.rms_norm.eager`` / ``add_rms_norm.eager`` / ``add.eager``: the residual bit for bit,
  the normed rows within one ulp (fp32) and bit for bit in nearly all bf16 elements; H = 256 and
  a padded H = 96; ``h`` a row-strided slice of a wider tensor; T in {1, 7}.
* In this process: operands the kernel does not take are refused by ``can_run`` and raise a
  ValueError naming the fallback; T == 0 returns empty tensors without a launch.
* Offline sm_90 PTX: with PDL every program waits before its first global load, then signals.
* On CUDA (skipped without one): larger shapes, CUDA-graph capture, and the dispatch of
  ``fusion.add_rms_norm`` / ``rms_norm`` / ``add`` to the kernel (and away from it when off).
"""

from __future__ import annotations

import pytest
import torch
from interpreter_child import HAS_TRITON, INTERPRETED, interpreted, run_interpreted_child
from ptx_sm90 import can_compile_sm90, compile_sm90, loads_before_pdl_wait

from laguna_dflash.kernels import add_rms_norm as arn
from laguna_dflash.models import fusion

EPS = 1e-6
# fraction of normed elements allowed to differ at all from eager (the mean(s^2) summation order)
STRICT = {torch.float32: 1.0, torch.bfloat16: 0.01}
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 2e-2}}


def operands(t: int, hidden: int, dtype: torch.dtype, num_pairs: int | None, *,
             device: str = "cpu", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(h, delta, weight)``; ``h`` a row-strided slice of a wider tensor; ``num_pairs`` None:
    no delta, 0: ``[T, H]``, P: ``[T, P, H]``."""
    g = torch.Generator().manual_seed(seed)
    h = (3 * torch.randn(t, hidden + 40, generator=g)).to(dtype).to(device)[:, 8 : 8 + hidden]
    if num_pairs is None:
        delta = None
    elif num_pairs == 0:
        delta = torch.randn(t, hidden, generator=g).to(dtype)
    else:
        delta = (0.5 * torch.randn(t, num_pairs, hidden, generator=g)).to(dtype)
    weight = (1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype)
    return h, None if delta is None else delta.to(device), weight.to(device)


def check(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
          max_mismatch: float) -> None:
    dtype = h.dtype
    res, out = arn.add_rms_norm(h, delta, weight, EPS)
    if delta is None:
        assert res is None
        want = fusion.rms_norm.eager(h, weight, EPS)
    else:
        want_res, want = fusion.add_rms_norm.eager(h, delta, weight, EPS)
        assert torch.equal(res, want_res)  # the add rounds exactly where eager's does
        alone, none = arn.add_rms_norm(h, delta, None, 0.0)
        assert none is None and torch.equal(alone, fusion.add.eager(h, delta))
    assert out.dtype == dtype and out.is_contiguous() and out.shape == h.shape
    torch.testing.assert_close(out, want, **TOL[dtype])
    differ = int((out != want).sum())
    assert differ <= max_mismatch * out.numel(), differ


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="triton not installed / already the child")
def test_kernel_under_triton_interpreter():
    run_interpreted_child(__file__)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_pairs", [None, 0, 3], ids=["norm", "add-norm", "pairs"])
@pytest.mark.parametrize("hidden", [256, 96])
@pytest.mark.parametrize("t", [1, 7])
def test_interpreted_equals_eager(t, hidden, num_pairs, dtype):
    assert arn.is_available("cpu")
    check(*operands(t, hidden, dtype, num_pairs, seed=t + hidden), max_mismatch=STRICT[dtype])


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t", [2, 7])
def test_interpreted_grouped_weight_equals_eager(t, dtype):
    """``weight [G, H]``: row ``r`` normed with weight row ``r % G``, i.e. taps ``[N, G * H]``
    viewed as ``[N * G, H]`` give ``fusion.rms_norm_interleaved.eager``."""
    groups, hidden = 3, 96
    h, _, _ = operands(t * groups, hidden, dtype, None, seed=t)
    h = h.contiguous()
    g = torch.Generator().manual_seed(1)
    weight = (1 + 0.5 * torch.randn(groups, hidden, generator=g)).to(dtype)
    res, out = arn.add_rms_norm(h, None, weight, EPS)
    assert res is None
    want = fusion.rms_norm_interleaved.eager(h.view(t, groups * hidden), weight, EPS).view_as(h)
    torch.testing.assert_close(out, want, **TOL[dtype])
    assert int((out != want).sum()) <= STRICT[dtype] * out.numel()
    # each group's own row: the same rows against one weight row differ where the weights do
    assert not torch.equal(out[1::groups], arn.add_rms_norm(h, None, weight[0], EPS)[1][1::groups])


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interpreted_unit_weight_equals_rms_normalize(dtype):
    h, _, _ = operands(5, 256, dtype, None, seed=3)
    res, out = arn.add_rms_norm(h, None, None, EPS, unit_weight=True)
    want = fusion.rms_norm_unweighted.eager(h, EPS)
    assert res is None
    torch.testing.assert_close(out, want, **TOL[dtype])
    assert int((out != want).sum()) <= STRICT[dtype] * out.numel()


# ---- host side (no launch) ----------------------------------------------------------------------------


def test_empty_batch_returns_empty_tensors_without_launch():
    h, delta, w = operands(0, 64, torch.bfloat16, 2)
    res, out = arn.add_rms_norm(h, delta, w, EPS)  # a launch on a CPU tensor fails uninterpreted
    assert res.shape == out.shape == (0, 64) and out.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "change",
    ["h_3d", "h_inner_stride", "h_int", "delta_dtype", "delta_rows", "delta_width",
     "weight_dtype", "weight_shape", "too_wide"],
)
def test_refuses_what_it_cannot_take(change):
    h, delta, w = operands(3, 64, torch.float32, 0)
    if change == "h_3d":
        h = h[None]
    elif change == "h_inner_stride":
        h = torch.zeros(3, 128)[:, ::2]
    elif change == "h_int":
        h = torch.zeros(3, 64, dtype=torch.int32)
    elif change == "delta_dtype":
        delta = delta.to(torch.bfloat16)
    elif change == "delta_rows":
        delta = delta[:2]
    elif change == "delta_width":
        delta = torch.zeros(3, 2, 32)
    elif change == "weight_dtype":
        w = w.to(torch.bfloat16)  # torch would promote the product to fp32: not the kernel's math
    elif change == "weight_shape":
        w = w[:32]
    elif change == "too_wide":
        h, delta, w = torch.zeros(3, arn.MAX_HIDDEN + 1), None, torch.ones(arn.MAX_HIDDEN + 1)
    assert not arn.can_run(h, delta, w)
    name = change.split("_")[0] if change != "too_wide" else "h"
    with pytest.raises(ValueError, match=rf"add_rms_norm: {name} must .*fusion.add_rms_norm"):
        arn.add_rms_norm(h, delta, w, EPS)


def test_needs_a_delta_or_a_weight():
    with pytest.raises(ValueError, match="delta, a weight"):
        arn.add_rms_norm(torch.zeros(2, 64), None, None, EPS)
    with pytest.raises(ValueError, match="a weight or unit_weight=True, not both"):
        arn.add_rms_norm(torch.zeros(2, 64), None, torch.ones(64), EPS, unit_weight=True)


def test_grouped_weight_must_match_the_rows_width():
    h = torch.zeros(6, 64)
    assert not arn.can_run(h, None, torch.ones(3, 32))
    assert not arn.can_run(h, None, torch.ones(64, 3).t())  # not contiguous
    with pytest.raises(ValueError, match=r"weight must be None, \[H=64\] or grouped \[G, H=64\]"):
        arn.add_rms_norm(h, None, torch.ones(3, 32), EPS)


def test_interleaved_norm_eager_equals_the_grouped_norm_over_transposed_taps():
    """The drafter's per-tap norms as written before (``rms_norm_grouped`` over the taps
    transposed to ``[G, N, H]``, then back) and as ``rms_norm_interleaved`` reads them in place:
    the same values bit for bit."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        taps = (3 * torch.randn(4, 5 * 64, generator=g)).to(dtype)
        weight = (1 + 0.3 * torch.randn(5, 64, generator=g)).to(dtype)
        old = fusion.rms_norm_grouped.eager(taps.view(4, 5, 64).transpose(0, 1), weight, EPS)
        assert torch.equal(fusion.rms_norm_interleaved.eager(taps, weight, EPS),
                           old.transpose(0, 1).reshape(4, -1))
        with torch.inference_mode():  # off CUDA: the eager body
            assert torch.equal(fusion.rms_norm_interleaved(taps, weight, EPS),
                               old.transpose(0, 1).reshape(4, -1))


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="triton not installed / interpreter on")
def test_not_available_on_a_cpu_without_the_interpreter():
    h, delta, w = operands(2, 64, torch.float32, 0)
    assert not arn.is_available("cpu") and not arn.can_run(h, delta, w)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        arn.add_rms_norm(h, delta, w, EPS)


@pytest.mark.parametrize("warps,block,want", [(None, 2048, 4), (None, 128, 1), (None, 16384, 8), (16, 2048, 16),
                                               (2, 2048, 2)])
def test_warp_count(warps, block, want, monkeypatch):
    monkeypatch.setattr(arn, "NUM_WARPS", warps)
    assert arn._num_warps(block) == want


@pytest.mark.parametrize("warps", [3, 32, True])
def test_bad_warp_count_names_the_knob(warps, monkeypatch):
    monkeypatch.setattr(arn, "NUM_WARPS", warps)
    with pytest.raises(ValueError, match="NUM_WARPS must be None or 1, 2, 4, 8 or 16"):
        arn._num_warps(2048)


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
@pytest.mark.parametrize("num_pairs", [-1, 0, 10])
def test_sm90_programmatic_dependent_launch_order(num_pairs):
    """With ``kernels.pdl.USE_PDL`` a program loads only the weight (``evict_last``) before it
    waits for its predecessor, h and delta after; then it signals. Without PDL no
    griddepcontrol is emitted."""
    types = {n: "*bf16" for n in ("h_ptr", "d_ptr", "w_ptr", "res_ptr", "out_ptr")}
    types["eps"] = "fp32"

    def ptx_of(pdl: bool) -> str:
        constexprs = dict(HIDDEN=2048, BLOCK=2048, NUM_PAIRS=num_pairs, WRITE_RESIDUAL=num_pairs >= 0,
                          WRITE_NORM=True, DTYPE=1, PDL=pdl, NUM_WEIGHT_ROWS=1)
        return compile_sm90(arn._kernels(False), types, constexprs,
                            {"num_warps": 4, "enable_fp_fusion": False, "launch_pdl": pdl})

    assert "griddepcontrol" not in ptx_of(False)
    ptx = ptx_of(True)
    early = loads_before_pdl_wait(ptx)
    assert early and all("L2::cache_hint" in line for line in early), early  # the weight only
    after = ptx[ptx.index("griddepcontrol.wait"):].splitlines()
    assert any("ld.global" in line and "cache_hint" not in line for line in after)  # h, delta


# ---- CUDA -------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(INTERPRETED or not arn.is_available("cuda"),
                          reason="needs a CUDA GPU (sm80+) and triton")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_pairs", [None, 0, 10], ids=["norm", "add-norm", "pairs"])
@pytest.mark.parametrize("t,hidden", [(1, 2048), (16, 2048), (300, 2048), (5, 3072), (3, 96)])
def test_cuda_equals_eager(t, hidden, num_pairs, dtype):
    check(*operands(t, hidden, dtype, num_pairs, device="cuda", seed=t), max_mismatch=STRICT[dtype])


@cuda
@pytest.mark.parametrize("warps", [2, 8, 16])
def test_cuda_other_warp_counts_equal_eager(warps, monkeypatch):
    """``NUM_WARPS`` (the A/B knob): the same values up to the statistic's summation order."""
    monkeypatch.setattr(arn, "NUM_WARPS", warps)
    for t, num_pairs in ((1, 10), (4, 10), (2, 0)):
        check(*operands(t, 2048, torch.bfloat16, num_pairs, device="cuda", seed=t),
              max_mismatch=STRICT[torch.bfloat16])


@cuda
def test_cuda_graph_capture():
    h, delta, w = operands(4, 2048, torch.bfloat16, 10, device="cuda", seed=1)
    arn.add_rms_norm(h, delta, w, EPS)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res, out = arn.add_rms_norm(h, delta, w, EPS)
    h2, delta2, _ = operands(4, 2048, torch.bfloat16, 10, device="cuda", seed=2)
    h.copy_(h2)
    delta.copy_(delta2)
    graph.replay()
    torch.cuda.synchronize()
    want_res, want = fusion.add_rms_norm.eager(h, delta, w, EPS)
    assert torch.equal(res, want_res)
    torch.testing.assert_close(out, want, **TOL[torch.bfloat16])


@cuda
def test_cuda_fusion_dispatches_to_the_kernel(monkeypatch):
    """In CUDA inference ``fusion``'s five norm chains run this kernel (once each), and
    ``use_norm_kernel = False`` (or autograd on) takes them back to torch.compile / eager."""
    h, delta, w = operands(5, 2048, torch.bfloat16, 0, device="cuda")
    calls = []
    real = arn.add_rms_norm
    monkeypatch.setattr(arn, "add_rms_norm", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    with torch.inference_mode():
        fusion.rms_norm(h, w, EPS)
        fusion.add_rms_norm(h, delta, w, EPS)
        fusion.add(h, delta)
        assert len(calls) == 3
        fusion.rms_norm_unweighted(h, EPS)
        taps, weights = h.contiguous().view(5, 4, 512).reshape(5, 2048), w.view(4, 512)
        got = fusion.rms_norm_interleaved(taps, weights, EPS)
        assert len(calls) == 5
        torch.testing.assert_close(got, fusion.rms_norm_interleaved.eager(taps, weights, EPS),
                                   **TOL[torch.bfloat16])
        monkeypatch.setattr(fusion, "use_norm_kernel", False)
        got = fusion.add_rms_norm(h, delta, w, EPS)
        fusion.rms_norm_unweighted(h, EPS)
        fusion.rms_norm_interleaved(taps, weights, EPS)
        assert len(calls) == 5
    torch.testing.assert_close(got[1], fusion.add_rms_norm.eager(h, delta, w, EPS)[1],
                               **TOL[torch.bfloat16])
