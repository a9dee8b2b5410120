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
"""

from __future__ import annotations

import pytest
import torch
from interpreter_child import HAS_TRITON, INTERPRETED, interpreted, run_interpreted_child
from ptx_sm90 import can_compile_sm90, compile_sm90, loads_before_pdl_wait
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
    """``[T, k, H]``: each pair through the reference alone (fp32 math), weighted."""
    t, k = ids.shape
    out = torch.empty(t, k, x.shape[1])
    for i in range(t):
        for j in range(k):
            one = moe_experts_reference(x[i : i + 1].float(), ids[i : i + 1, j : j + 1],
                                        weights[i : i + 1, j : j + 1].float(),
                                        gate_up.float(), down.float())
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


def _compile_sm90(which: int, pdl: bool) -> str:
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
    constexprs.update(BLOCK_N=bn, BLOCK_K=bk, OUT_DTYPE=1, PDL=pdl)
    return compile_sm90(kernel, pointers, constexprs, {"num_warps": nw, "launch_pdl": pdl})


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
def test_sm90_programmatic_dependent_launch_order() -> None:
    """With ``kernels.pdl.USE_PDL`` (rules in kernels/pdl.py): gate_up waits before any global
    load; down reads only its expert id (through L2) and weight tiles before it waits for h;
    both signal their dependents after the wait; without PDL no griddepcontrol at all."""
    for which in (0, 1):
        assert "griddepcontrol" not in _compile_sm90(which, False)
        early = loads_before_pdl_wait(_compile_sm90(which, True))
        if which == 0:
            assert early == []
        else:
            assert any(".cg" in line for line in early)  # the expert id, from L2
            assert all(".cg" in line or "evict_first" in line for line in early), early
            assert any("evict_first" in line for line in early)  # the first weight tile
