"""Fused MoE routing kernel (``kernels/moe_routing.py``) against ``fusion.moe_route.eager``.

* Under Triton's CPU interpreter (``TRITON_INTERPRET=1``): triton reads the variable when it is
  imported (its ``tl.sum`` &c. are decorated then), so the interpreted tests run in a child pytest
  with the variable set and skip in this process (as in ``test_kernel_context_kv.py``). They cover
  E = 256 / k = 8 (Laguna), E = 16 / k = 4, E = 40 / k = 6 (not a power of two), T in {1, 5, 33},
  sigmoid and sqrtsoftplus, softcap 0 and 30, norm_topk_prob on and off, scale 2.5, a random
  nonzero bias (the biased selection differs from the unbiased one), fp32 and bf16 logits; the
  shared column; ties (lower index first), ``-inf`` biases, NaN logits; strided logits.
* On CUDA (skipped without one): Laguna shapes and CUDA-graph capture.
* Everywhere: input validation, ``T == 0``, availability.
"""

from __future__ import annotations

import pytest
import torch
from interpreter_child import HAS_TRITON, INTERPRETED, interpreted, run_interpreted_child
from ptx_sm90 import can_compile_sm90, compile_sm90, loads_before_pdl_wait

from laguna_dflash.kernels import moe_routing
from laguna_dflash.kernels.moe_routing import fused_moe_route
from laguna_dflash.models import fusion

HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON) or INTERPRETED, reason="needs CUDA and triton")
# the interpreter evaluates both sides of the kernel's where()s in numpy: exp overflows and 0 / 0
# in discarded lanes warn
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

SCALE = 2.5
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-6},
       torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-3},  # the reference rounds twice (weights, x scale)
       torch.float16: {"rtol": 2e-3, "atol": 1e-4}}


def _problem(t: int, e: int, dtype: torch.dtype, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [T, E] wide enough to reach both tanh branches at softcap 30, bias [E] fp32 of the
    size of the score spread (so it changes the selection)."""
    g = torch.Generator().manual_seed(seed)
    logits = (8 * torch.randn(t, e, generator=g)).to(device=device, dtype=dtype)
    bias = (torch.rand(e, generator=g) - 0.5).to(device)
    return logits, bias


def _reference(logits, bias, top_k, softcap, score_func, norm, scale=SCALE):
    weights, ids = fusion.moe_route.eager(logits, bias, top_k, softcap, score_func, norm)
    return weights.float() * scale, ids


def _assert_matches_reference(logits, bias, top_k, softcap, score_func, norm) -> None:
    weights, ids = fused_moe_route(logits, bias, top_k, softcap, score_func, norm, scale=SCALE)
    ref_w, ref_ids = _reference(logits, bias, top_k, softcap, score_func, norm)
    assert weights.dtype == logits.dtype and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (logits.shape[0], top_k)
    assert weights.is_contiguous() and ids.is_contiguous()
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights.float(), ref_w, **TOL[logits.dtype])


# ---- Triton kernel (CPU interpreter) == reference ---------------------------------------------------


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="triton not installed / already the child")
def test_kernel_under_triton_interpreter() -> None:
    run_interpreted_child(__file__)


# (E, top_k, T, softcap, norm_topk_prob): Laguna's shape with every flag combination, the others
# with two combinations each; every case runs for both score functions and both dtypes
_CASES = [(256, 8, 5, cap, norm) for cap in (0.0, 30.0) for norm in (True, False)] + [
    (e, k, t, cap, norm)
    for e, k, t in ((256, 8, 1), (16, 4, 33), (40, 6, 5))
    for cap, norm in ((0.0, False), (30.0, True))
]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("score_func", ["sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("e,k,t,softcap,norm", _CASES)
def test_interpreted_matches_reference(e, k, t, softcap, norm, score_func, dtype) -> None:
    logits, bias = _problem(t, e, dtype, seed=e * 100 + t, device="cpu")
    _assert_matches_reference(logits, bias, k, softcap, score_func, norm)
    # the bias matters: the unbiased top-k picks other experts
    _, unbiased = fusion.moe_route.eager(logits, torch.zeros_like(bias), k, softcap, score_func, norm)
    _, ids = fused_moe_route(logits, bias, k, softcap, score_func, norm)
    assert not torch.equal(ids.sort(-1).values, unbiased.sort(-1).values)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interpreted_shared_column(dtype) -> None:
    e, k = 40, 6
    logits, bias = _problem(5, e, dtype, seed=3, device="cpu")
    w0, ids0 = fused_moe_route(logits, bias, k, 30.0, "sigmoid", True, scale=SCALE)
    w1, ids1 = fused_moe_route(logits, bias, k, 30.0, "sigmoid", True, scale=SCALE, num_shared=1)
    assert w1.shape == ids1.shape == (5, k + 1) and w1.dtype == dtype and ids1.dtype == torch.int64
    assert w1.is_contiguous() and ids1.is_contiguous()
    assert torch.equal(ids1[:, :k], ids0) and torch.equal(w1[:, :k], w0)
    assert torch.all(ids1[:, k] == e) and torch.all(w1[:, k] == 1.0)


@interpreted
def test_interpreted_ties_inf_bias_and_nan() -> None:
    # all keys equal: the lowest indices, in order (also with top_k == E)
    for e, k in ((40, 6), (16, 16)):
        w, ids = fused_moe_route(torch.zeros(3, e), torch.zeros(e), k, 0.0, "sigmoid", True, scale=SCALE)
        assert torch.equal(ids, torch.arange(k).expand(3, k))
        torch.testing.assert_close(w, torch.full((3, k), SCALE / k))
    # -inf biases: the finite experts first (by key), then the -inf ones by index (not padding)
    e, k = 12, 9
    logits, _ = _problem(4, e, torch.float32, seed=5, device="cpu")
    bias = torch.zeros(e)
    bias[::2] = float("-inf")
    _, ids = fused_moe_route(logits, bias, k, 0.0, "sqrtsoftplus", False)
    _, ref_ids = fusion.moe_route.eager(logits, bias, 6, 0.0, "sqrtsoftplus", False)
    assert torch.equal(ids[:, :6], ref_ids)
    assert torch.equal(ids[:, 6:], torch.tensor([0, 2, 4]).expand(4, 3))
    # a NaN logit ranks first (as in torch.topk); its weight is NaN
    logits[1, 7] = float("nan")
    w, ids = fused_moe_route(logits, torch.zeros(e), 3, 0.0, "sigmoid", False)
    assert ids[1, 0] == 7 and torch.isnan(w[1, 0])
    assert torch.equal(ids[[0, 2, 3]], fusion.moe_route.eager(logits, torch.zeros(e), 3, 0.0, "sigmoid", False)[1][[0, 2, 3]])


@interpreted
def test_interpreted_strided_inputs_and_dtypes() -> None:
    e, k, t = 40, 6, 5
    g = torch.Generator().manual_seed(7)
    wide = 8 * torch.randn(t, e + 24, generator=g)
    bias = torch.rand(e, generator=g) - 0.5
    cases = [
        (wide[:, 3:3 + e], bias),  # row stride E + 24, offset
        ((8 * torch.randn(e, t, generator=g)).t(), bias.to(torch.bfloat16)),  # column stride T
        (wide[:, :e].to(torch.float16), bias[::1]),
        (wide[:, :e], torch.stack([bias, bias], 1)[:, 1]),  # strided bias
    ]
    for logits, b in cases:
        _assert_matches_reference(logits, b, k, 30.0, "sqrtsoftplus", True)


@interpreted
def test_interpreted_is_available() -> None:
    assert moe_routing.is_available("cpu")


# ---- everywhere ---------------------------------------------------------------------------------------


def test_rejects_bad_inputs() -> None:
    logits, bias = torch.zeros(2, 16), torch.zeros(16)
    bad = [
        ({"score_func": "softmax"}, "score_func"),
        ({"bias": torch.zeros(15)}, "bias"),
        ({"bias": torch.zeros(1, 16)}, "bias"),
        ({"bias": torch.zeros(16, dtype=torch.int64)}, "bias"),
        ({"logits": torch.zeros(16)}, "logits"),
        ({"logits": torch.zeros(2, 16, dtype=torch.int32)}, "logits"),
        ({"logits": torch.zeros(2, 1025), "bias": torch.zeros(1025)}, "E=1025"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": 17}, "top_k"),
        ({"softcap": -1.0}, "softcap"),
        ({"num_shared": 2}, "num_shared"),
    ]
    for override, match in bad:
        kwargs = {"logits": logits, "bias": bias, "top_k": 4, "softcap": 0.0,
                  "score_func": "sigmoid", "norm_topk_prob": True, **override}
        with pytest.raises(ValueError, match=match):
            fused_moe_route(**kwargs)


@pytest.mark.parametrize("num_shared", [0, 1])
def test_empty_batch(num_shared) -> None:
    w, ids = fused_moe_route(torch.zeros(0, 16, dtype=torch.bfloat16), torch.zeros(16), 4, 0.0,
                             "sigmoid", True, num_shared=num_shared)
    assert w.shape == ids.shape == (0, 4 + num_shared)
    assert w.dtype == torch.bfloat16 and ids.dtype == torch.int64


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="triton not installed / interpreter on")
def test_is_available_without_interpreter() -> None:
    assert not moe_routing.is_available("cpu")


# ---- CUDA -----------------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("score_func", ["sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("e,k,t", [(256, 8, 1), (256, 8, 64), (40, 6, 33), (1024, 8, 5)])
def test_cuda_matches_reference(e, k, t, softcap, score_func, dtype) -> None:
    logits, bias = _problem(t, e, dtype, seed=t, device="cuda")
    for norm in (True, False):
        _assert_matches_reference(logits, bias, k, softcap, score_func, norm)


@cuda
def test_cuda_graph_capture() -> None:
    logits, bias = _problem(16, 256, torch.bfloat16, seed=0, device="cuda")
    args = (bias, 8, 0.0, "sigmoid", True)
    fused_moe_route(logits, *args, scale=SCALE, num_shared=1)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w, ids = fused_moe_route(logits, *args, scale=SCALE, num_shared=1)
    logits.copy_(_problem(16, 256, torch.bfloat16, seed=1, device="cuda")[0])
    graph.replay()
    torch.cuda.synchronize()
    w_ref, ids_ref = fused_moe_route(logits, *args, scale=SCALE, num_shared=1)
    assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref)
    assert torch.equal(ids[:, :8], _reference(logits, *args)[1])


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
def test_sm90_programmatic_dependent_launch_order() -> None:
    """With ``kernels.pdl.USE_PDL``: only the bias (a parameter) is loaded before the wait for
    the router GEMM's logits; the dependents are signalled after the wait; off: no griddepcontrol."""
    types = {"logits_ptr": "*bf16", "bias_ptr": "*fp32", "weights_ptr": "*bf16", "ids_ptr": "*i64",
             "softcap": "fp32", "scale": "fp32"}

    def ptx_of(pdl: bool) -> str:
        constexprs = dict(stride_le=1, stride_b=1, NUM_EXPERTS=256, BLOCK_E=256, TOP_K=8, NUM_SHARED=1,
                          K_PAD=16, HAS_SOFTCAP=False, SQRT_SOFTPLUS=False, NORM=True, OUT_BF16=True, PDL=pdl)
        return compile_sm90(moe_routing._moe_route_kernel, types, constexprs,
                            {"num_warps": 1, "launch_pdl": pdl})

    assert "griddepcontrol" not in ptx_of(False)
    ptx = ptx_of(True)
    early = loads_before_pdl_wait(ptx)
    late = [line for line in ptx[ptx.index("griddepcontrol.wait"):].splitlines() if "ld.global" in line]
    # one warp, 256 experts: the fp32 bias is 8 values a thread, two 16-byte loads; the bf16
    # logits (one more 16-byte load, then the chosen experts' re-read) come after the wait
    assert len(early) == 2 and all("v4.b32" in line for line in early), early
    assert late
