"""Per-pair GEMV MoE experts (``kernels/moe_gemv.py``) against ``moe_experts_reference``.

* Under Triton's CPU interpreter (a child pytest with ``TRITON_INTERPRET=1``; skipped in this
  process): one token with nine pairs (Laguna decode with the folded shared expert), several
  tokens sharing experts, ragged tiles on both N and K (H, I not multiples of the blocks),
  fp32 (tight) and bf16; the weighted pairs, unsummed, as ``fused_moe_experts(reduce=False)``.
* Offline sm_90 compile (no GPU): the order of the programmatic-dependent-launch instructions.
* On CUDA (skipped without one): Laguna-XS-2.1 shapes against the reference and the
  ``fused_moe`` kernels, ``MoE.forward`` with ``use_moe_gemv`` (the default) against it off, and
  CUDA-graph capture.
* Everywhere: input validation.
* Skipped pairs (``has_skipped_pairs``: id ``-1``, an expert on another rank): interpreted and on
  CUDA (with a CUDA-graph capture), a rank's call against the global call on poisoned weights
  (``test_kernel_fused_moe.ep_problem`` / ``check_skipped_pairs``); the flag with no ``-1`` changes
  no bit; the skip build keeps the PDL order.
"""

from __future__ import annotations

import pytest
import torch
from interpreter_child import HAS_TRITON, INTERPRETED, interpreted, run_interpreted_child
from ptx_sm90 import can_compile_sm90, compile_sm90, loads_before_pdl_wait
from test_kernel_fused_moe import (
    S21,
    check_skipped_pairs,
    eager_then_graphed,
    ep_problem,
    s21_interpreter_tiles,
    s21_shared_ids,
)
from test_kernel_fused_moe import _problem as fused_moe_problem

from laguna_dflash.kernels.fused_moe import moe_experts_reference
from laguna_dflash.kernels.moe_gemv import moe_gemv_experts

HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON) or INTERPRETED, reason="needs CUDA and triton")


def _problem(t, k, e, hidden, inter, dtype, seed, device="cpu", share=False):
    """x, ids, weights, gate_up, down as in the fused-MoE tests (``share``: every token on the
    same experts)."""
    return fused_moe_problem(t, k, e, hidden, inter, dtype, seed, same_experts=share, device=device)


def _pairs_reference(x, ids, weights, gate_up, down) -> torch.Tensor:
    """``[T, k, H]``: each pair through the reference alone (fp32 math), weighted. Only the
    pair's expert is widened to fp32 (as expert 0 of a one-expert stack): widening the whole
    stack per pair took minutes at S-2.1 widths (257 experts, 4.8 GB of bf16 a call)."""
    t, k = ids.shape
    out = torch.empty(t, k, x.shape[1])
    for i in range(t):
        for j in range(k):
            e = int(ids[i, j])
            one = moe_experts_reference(x[i : i + 1].float(), torch.zeros_like(ids[i : i + 1, j : j + 1]),
                                        weights[i : i + 1, j : j + 1].float(),
                                        gate_up[e : e + 1].float(), down[e : e + 1].float())
            out[i, j] = one[0]
    return out


def _check(t, k, e, hidden, inter, dtype, seed, device="cpu", share=False, tol=None):
    args = _problem(t, k, e, hidden, inter, dtype, seed, device, share)
    got = moe_gemv_experts(*args)
    assert got.shape == (t, k, hidden) and got.dtype == dtype
    want = _pairs_reference(*(a.cpu() for a in args))
    err = ((got.float().cpu() - want).abs().max() / want.abs().max()).item()
    assert err < (tol or (1e-5 if dtype == torch.float32 else 2e-2)), err
    return got


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,k,e,hidden,inter,share", [
    (1, 9, 12, 80, 40, False),   # one token, nine pairs; ragged N and K tiles on both kernels
    (3, 2, 4, 64, 24, True),     # tokens sharing experts (correct, read once per pair)
    (2, 3, 5, 272, 16, False),   # H > BLOCK_K: two K steps in gate_up (prefetch across steps)
])
def test_interpreted_matches_reference(t, k, e, hidden, inter, share, dtype) -> None:
    _check(t, k, e, hidden, inter, dtype, seed=t + k, share=share)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,k,e_total,lo,hi,hidden,inter", [
    (5, 3, 12, 3, 8, 80, 40),     # mixed tokens; ragged N and K tiles
    (3, 9, 30, 4, 14, 272, 16),   # nine pairs a token; two K steps in gate_up
])
def test_interpreted_skipped_pairs(t, k, e_total, lo, hi, hidden, inter, dtype) -> None:
    from laguna_dflash.kernels import moe_gemv

    full, rank, skipped = ep_problem(t, k, e_total, lo, hi, hidden, inter, dtype, seed=t * k)
    check_skipped_pairs(moe_gemv_experts, full, rank, skipped, module=moe_gemv)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interpreted_skip_flag_without_skipped_pairs(dtype) -> None:
    args = _problem(3, 9, 12, 80, 40, dtype, seed=1)
    assert torch.equal(moe_gemv_experts(*args, has_skipped_pairs=True), moe_gemv_experts(*args))


@interpreted
def test_interpreted_s21_eleven_pairs_width_1024(monkeypatch) -> None:
    """The decode path at S-2.1: one token, 11 pairs (top-10 + the folded shared expert: token
    p // 11 of each pair), expert width 1024, fp32 against each pair's reference. Hidden and the
    expert count are shrunk (80: ragged; 12); hidden 3072 runs in test_kernel_fused_moe's S-2.1
    test and the CUDA one here."""
    s21_interpreter_tiles(monkeypatch)
    x, _, w, gate_up, down = _problem(1, S21["k"], 12, 80, S21["inter"], torch.float32, seed=21)
    args = (x, s21_shared_ids(1, 12, seed=21), w, gate_up, down)
    got = moe_gemv_experts(*args)
    want = _pairs_reference(*args)
    assert got.shape == (1, S21["k"], 80)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


def test_interpreter_child() -> None:
    if INTERPRETED or not HAS_TRITON:
        pytest.skip("this is the parent: needs triton, and not already interpreted")
    run_interpreted_child(__file__)


def test_validation() -> None:
    x, ids, w, gu, dn = _problem(1, 2, 3, 8, 4, torch.float32, 0)
    with pytest.raises(ValueError, match="shapes disagree"):
        moe_gemv_experts(x[:, :4], ids, w, gu, dn)
    with pytest.raises(ValueError, match="share one of"):
        moe_gemv_experts(x.double(), ids, w, gu.double(), dn)
    with pytest.raises(ValueError, match="contiguous"):
        moe_gemv_experts(x, ids, w, gu.transpose(1, 2).contiguous().transpose(1, 2), dn)


@cuda
def test_cuda_xs21_shapes_match_reference_and_fused_moe() -> None:
    from laguna_dflash.kernels.fused_moe import fused_moe_experts

    for t in (1, 4):  # batch-1 decode, batch-1 verify of K = 3
        got = _check(t, 9, 257, 2048, 512, torch.bfloat16, seed=3, device="cuda")
        args = _problem(t, 9, 257, 2048, 512, torch.bfloat16, seed=3, device="cuda")
        fused = fused_moe_experts(*args, reduce=False)
        assert ((got.float() - fused.float()).abs().max() / fused.float().abs().max()).item() < 2e-2


@cuda
@pytest.mark.parametrize("inter", [1024, 512], ids=["width1024", "tp2-width512"])
def test_cuda_s21_shapes_match_reference_and_fused_moe(inter) -> None:
    """S-2.1 on the default tiles: 11 pairs a token (top-10 + the folded shared expert), hidden
    3072, expert width 1024 (512 a rank under 2-way TP); decode and a 4-token verify."""
    from laguna_dflash.kernels.fused_moe import fused_moe_experts

    for t in (1, 4):
        x, _, w, gate_up, down = _problem(t, S21["k"], S21["e"], S21["hidden"], inter, torch.bfloat16, seed=t,
                                          device="cuda")
        args = (x, s21_shared_ids(t, S21["e"], seed=t).cuda(), w, gate_up, down)
        got = moe_gemv_experts(*args)
        want = _pairs_reference(*(a.cpu() for a in args))
        assert ((got.float().cpu() - want).abs().max() / want.abs().max()).item() < 2e-2
        fused = fused_moe_experts(*args, reduce=False)
        assert ((got.float() - fused.float()).abs().max() / fused.float().abs().max()).item() < 2e-2


@cuda
def test_cuda_moe_forward_with_gemv_and_graph_capture(monkeypatch) -> None:
    from laguna_dflash.models.layers import MoE

    torch.manual_seed(0)
    moe = MoE(2048, 64, 8, 512, 512).to("cuda", torch.bfloat16).eval()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    moe.fold_shared_expert()
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        monkeypatch.setattr(MoE, "use_moe_gemv", False)  # the grouped fused kernels
        want = moe(x)
        monkeypatch.setattr(MoE, "use_moe_gemv", True)  # the default since it was measured
        got = moe(x)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)
        graph = torch.cuda.CUDAGraph()
        moe(x)
        with torch.cuda.graph(graph):
            out = moe(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, moe(x), rtol=0, atol=0)


@cuda
def test_cuda_skipped_pairs_xs21_and_graph_capture() -> None:
    """XS-2.1 widths (9 pairs a token, 20 of 40 experts on this rank), bf16 and fp32: the rank's
    pairs are the global call's bits, the skipped ones zeros; a captured graph replays another
    skip pattern as eager computes it, with no host sync."""
    from laguna_dflash.kernels import moe_gemv

    for dtype in (torch.bfloat16, torch.float32):
        for t in (1, 4):
            full, rank, skipped = ep_problem(t, 9, 40, 10, 30, 2048, 512, dtype, seed=t, device="cuda")
            check_skipped_pairs(moe_gemv_experts, full, rank, skipped, module=moe_gemv)
    full, rank, skipped = ep_problem(4, 9, 40, 10, 30, 2048, 512, torch.bfloat16, seed=7, device="cuda")
    x, local, w, gate_up, down = (a.clone() if a.dim() < 3 else a for a in rank)
    local[2:] = local[1:2]  # tokens 1..3 keep every pair
    w = torch.nan_to_num(w, nan=0.25)  # routing weights for the pairs kept from here on
    eager, static_out, graph = eager_then_graphed(
        lambda: moe_gemv_experts(x, local, w, gate_up, down, has_skipped_pairs=True))
    assert torch.equal(static_out, eager) and torch.all(static_out[0] == 0)
    local[1] = -1  # now token 1 is all skipped, token 0 on token 3's experts
    local[0] = local[3]
    graph.replay()
    torch.cuda.synchronize()
    assert torch.all(static_out[1] == 0) and static_out[0].abs().sum() > 0
    assert torch.equal(static_out[2:], eager[2:])
    assert torch.equal(static_out, moe_gemv_experts(x, local, w, gate_up, down, has_skipped_pairs=True))


def _compile_sm90(which: int, pdl: bool, skip: bool = False) -> str:
    """PTX of the gate_up (0) or down (1) kernel at XS-2.1 shapes, bf16, for sm_90 (offline)."""
    from laguna_dflash.kernels import moe_gemv

    kernel = moe_gemv._kernels(False)[which]
    bn, bk, nw = (moe_gemv.GATE_UP_CONFIG, moe_gemv.DOWN_CONFIG)[which]
    h, inter = 2048, 512
    if which == 0:
        pointers = {"x_ptr": "*bf16", "w_ptr": "*bf16", "ids_ptr": "*i64", "h_ptr": "*bf16"}
        constexprs = dict(K_TOP=9, H=h, INTER=inter, K_ITERS=-(-h // bk))
    else:
        pointers = {"h_ptr": "*bf16", "w_ptr": "*bf16", "ids_ptr": "*i64", "rw_ptr": "*bf16", "out_ptr": "*bf16"}
        constexprs = dict(H=h, INTER=inter, K_ITERS=-(-inter // bk))
    constexprs.update(BLOCK_N=bn, BLOCK_K=bk, OUT_DTYPE=1, PDL=pdl, SKIP_NEGATIVE=skip)
    return compile_sm90(kernel, pointers, constexprs, {"num_warps": nw, "launch_pdl": pdl})


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
def test_sm90_programmatic_dependent_launch_order() -> None:
    """With ``kernels.pdl.USE_PDL`` (rules in kernels/pdl.py): gate_up waits before any global
    load; down reads only its expert id (through L2) and weight tiles before it waits for h;
    both signal their dependents after the wait; without PDL no griddepcontrol at all. The same
    in the skipped-pairs build (one wait, which a skipped pair's down program passes too)."""
    for which, skip in ((0, False), (1, False), (0, True), (1, True)):
        assert "griddepcontrol" not in _compile_sm90(which, False, skip)
        early = loads_before_pdl_wait(_compile_sm90(which, True, skip))
        if which == 0:
            assert early == []
        else:
            assert any(".cg" in line for line in early)  # the expert id, from L2
            assert all(".cg" in line or "evict_first" in line for line in early), early
            assert any("evict_first" in line for line in early)  # the first weight tile
