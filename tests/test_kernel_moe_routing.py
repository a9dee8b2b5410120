"""Fused MoE routing kernels (``kernels/moe_routing.py``) against ``fusion.moe_route.eager``:
``fused_moe_route`` (router logits -> weights, ids) and ``fused_router_route`` (the router GEMM
fused in front, one launch).

* Under Triton's CPU interpreter (``TRITON_INTERPRET=1``): triton reads the variable when it is
  imported (its ``tl.sum`` &c. are decorated then), so the interpreted tests run in a child pytest
  with the variable set and skip in this process (as in ``test_kernel_context_kv.py``). They cover
  E = 256 / k = 8 (Laguna), E = 16 / k = 4, E = 40 / k = 6 (not a power of two), T in {1, 5, 33},
  sigmoid and sqrtsoftplus, softcap 0 and 30, norm_topk_prob on and off, scale 2.5, a random
  nonzero bias (the biased selection differs from the unbiased one), fp32 and bf16 logits; the
  shared column; ties (lower index first), ``-inf`` biases, NaN logits; strided logits.
* ``fused_router_route`` under the interpreter: T in {1, 3, 16} x E in {256, 64, 40} x fp32 / bf16,
  the score functions, softcap, the shared column and norm_topk_prob spread over the cases, on
  inputs whose logits are exact in fp32 (so bitwise equal to ``fused_moe_route(F.linear(x, W))``
  whatever the summation order), and on Gaussian inputs (weights within 2 bf16 ulp); E = 1024;
  repeated calls (the arrival counter re-arms; an armed counter is caught); strided x; configs.
* Offline sm_90 compile (no GPU): both kernels' programmatic-dependent-launch order (only
  parameters loaded before ``griddepcontrol.wait``); ``fused_router_route`` builds without spills,
  its GEMM part reduces with warp shuffles, the semaphore is an acq_rel atomic with .cg reads.
* On CUDA (skipped without one): Laguna shapes and CUDA-graph capture, for both entry points
  (``fused_router_route`` against the two-kernel path: ids equal, weights within 1 ulp, since the
  norm_topk_prob sum follows the tile layout; its graph replayed twice).
* Everywhere: input validation, ``T == 0``, availability.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from interpreter_child import HAS_TRITON, INTERPRETED, interpreted, run_interpreted_child
from ptx_sm90 import can_compile_sm90, compile_sm90, compile_sm90_spills, loads_before_pdl_wait

from laguna_dflash.kernels import moe_routing
from laguna_dflash.kernels.moe_routing import SCORE_FUNCS, fused_moe_route, fused_router_route
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


# (E, top_k, T, num_shared): Laguna's, ragged E, top_k = E, one expert, top_k = 1 with the
# shared column (K_PAD = 2 next_pow2(top_k)), top_k without it (K_PAD = next_pow2(top_k))
_SELECTION_SHAPES = [(256, 8, 3, 1), (40, 6, 5, 0), (5, 5, 2, 0), (8, 8, 2, 1), (1, 1, 2, 0), (2, 1, 3, 1),
                     (12, 7, 4, 1)]


@interpreted
def test_interpreted_top_k_selections_agree(monkeypatch) -> None:
    """``TOPK_BITONIC``: the bitonic top-k and the max-reduction loop give the same ids and
    weights bit for bit (random keys, all-equal keys, -inf biases, a NaN logit), in the routing
    kernel and the fused router."""
    results = {}
    for m in (True, False):
        monkeypatch.setattr(moe_routing, "TOPK_BITONIC", m)
        out = []
        for e, k, t, shared in _SELECTION_SHAPES:
            for dtype in (torch.float32, torch.bfloat16):
                logits, bias = _problem(t, e, dtype, seed=e + k, device="cpu")
                out.append(fused_moe_route(logits, bias, k, 0.0, "sigmoid", True, scale=SCALE, num_shared=shared))
                out.append(fused_moe_route(torch.zeros(t, e, dtype=dtype), torch.zeros(e), k, 0.0, "sigmoid",
                                           True, num_shared=shared))
                inf_bias = bias.clone()
                inf_bias[::2] = float("-inf")
                logits[0, e // 2] = float("nan")
                out.append(fused_moe_route(logits, inf_bias, k, 30.0, "sqrtsoftplus", False, num_shared=shared))
            x, w, rb = _router_problem(t, e, 64, torch.bfloat16, seed=e)
            out.append(fused_router_route(x, w, rb, k, 0.0, "sigmoid", True, scale=SCALE, num_shared=shared))
        results[m] = out
    for got, want in zip(results[True], results[False]):
        assert torch.equal(got[1], want[1])
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0, equal_nan=True)


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
                          K_PAD=16, HAS_SOFTCAP=False, SQRT_SOFTPLUS=False, NORM=True, OUT_DTYPE=1, PDL=pdl,
                          BITONIC=moe_routing.TOPK_BITONIC, SEL_K=8)
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


# ---- fused_router_route: router GEMM + routing in one launch -------------------------------------


def _router_problem(t: int, e: int, h: int, dtype: torch.dtype, seed: int, device: str = "cpu",
                    exact: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H], router weight [E, H] (x.dtype), bias [E] fp32; logits of std ~4-8.

    exact: x and W are integers in [-8, 8] times powers of two, so every product and every partial
    sum is exact in fp32: the logits (one rounding to x.dtype) are F.linear's bit for bit whatever
    the order of the additions. Otherwise Gaussian (the summation order may move a bf16 logit by
    one ulp)."""
    g = torch.Generator().manual_seed(seed)
    if exact:
        w_shift = max(0, round(math.log2(24 * math.sqrt(h) / 6)) - 3)  # 24 = var of U{-8..8}
        x = torch.randint(-8, 9, (t, h), generator=g) / 8
        w = torch.randint(-8, 9, (e, h), generator=g) / 2.0**w_shift
    else:
        x = torch.randn(t, h, generator=g)
        w = 6 * torch.randn(e, h, generator=g) / math.sqrt(h)
    bias = torch.rand(e, generator=g) - 0.5
    return x.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype), bias.to(device)


def _two_kernel_path(x, w, bias, *args, **kwargs):
    return fused_moe_route(F.linear(x, w), bias, *args, **kwargs)


def _ulps_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of b's bf16 ulp."""
    ulp = torch.finfo(torch.bfloat16).eps * b.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    ulp = 2.0 ** torch.floor(torch.log2(ulp))  # exponent of b, times 2^-7
    return (a.float() - b.float()).abs() / ulp


# (T, E, H, top_k): every T with every E; H = 2048 is Laguna's, 200 is not a multiple of any tile
_ROUTER_SHAPES = [(t, e, h, k) for t in (1, 3, 16) for e, h, k in ((256, 2048, 8), (64, 512, 6), (40, 200, 6))]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", range(len(_ROUTER_SHAPES)))
def test_interpreted_router_route_equals_two_kernel_path(case, dtype) -> None:
    t, e, h, k = _ROUTER_SHAPES[case]
    # the flags cycle through the cases (each value meets both dtypes, every T and every E)
    i = case + (dtype == torch.bfloat16)
    score_func = SCORE_FUNCS[i % 2]
    softcap = 30.0 if (i // 2) % 2 else 0.0
    num_shared = case % 2
    norm = (case // 2) % 2 == 0
    x, w, bias = _router_problem(t, e, h, dtype, seed=case)
    args = (k, softcap, score_func, norm)
    weights, ids = fused_router_route(x, w, bias, *args, scale=SCALE, num_shared=num_shared)
    assert weights.shape == ids.shape == (t, k + num_shared)
    assert weights.dtype == dtype and ids.dtype == torch.int64
    assert weights.is_contiguous() and ids.is_contiguous()
    want_w, want_ids = _two_kernel_path(x, w, bias, *args, scale=SCALE, num_shared=num_shared)
    assert torch.equal(ids, want_ids)
    assert torch.equal(weights, want_w)
    # and the torch reference
    ref_w, ref_ids = _reference(F.linear(x, w), bias, *args)
    assert torch.equal(ids[:, :k], ref_ids)
    torch.testing.assert_close(weights[:, :k].float(), ref_w, **TOL[dtype])


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_interpreted_packed_logits_equal_the_re_read(monkeypatch, dtype) -> None:
    """``PACK_LOGITS``: the chosen 16-bit logits taken from the top-k key give bitwise the
    weights and ids of re-reading them, for both kernels; with negative, tied and softcapped
    logits (ties: the lower index first, whatever the logit bits below it)."""
    logits, bias = _problem(4, 64, dtype, seed=21, device="cpu")
    tied = [3, 10, 11, 12, 13]
    logits[0, tied] = 30.0  # sigmoid(30) == 1 in fp32: five equal top keys, the index decides
    bias[tied] = 1.0  # above every other bias (< 0.5)
    logits[1] = -logits[1].abs()  # negative logits: the sign bit of the packed low half
    x, w, rbias = _router_problem(1, 64, 512, dtype, seed=4)  # decode: one token a routing tile
    calls = [
        lambda: fused_moe_route(logits, bias, 6, 0.0, "sigmoid", True, scale=SCALE, num_shared=1),
        lambda: fused_moe_route(logits, bias, 6, 30.0, "sqrtsoftplus", False, scale=SCALE),
        lambda: fused_router_route(x, w, rbias, 6, 0.0, "sigmoid", True, scale=SCALE, num_shared=1),
    ]
    for call in calls:
        monkeypatch.setattr(moe_routing, "PACK_LOGITS", True)
        packed_w, packed_ids = call()
        monkeypatch.setattr(moe_routing, "PACK_LOGITS", False)
        read_w, read_ids = call()
        assert torch.equal(packed_ids, read_ids) and torch.equal(packed_w, read_w)
    ref_w, ref_ids = _reference(logits, bias, 6, 0.0, "sigmoid", True)
    monkeypatch.setattr(moe_routing, "PACK_LOGITS", True)
    got_w, got_ids = fused_moe_route(logits, bias, 6, 0.0, "sigmoid", True, scale=SCALE)
    # row 0: the kernel's tie order (lower index first; torch.topk's order among ties is not
    # specified, and on the CPU it is another one); the other rows equal torch's
    assert got_ids[0, :5].tolist() == tied and sorted(ref_ids[0, :5].tolist()) == tied
    assert torch.equal(got_ids[0, 5:], ref_ids[0, 5:]) and torch.equal(got_ids[1:], ref_ids[1:])
    torch.testing.assert_close(got_w.float(), ref_w, **TOL[dtype])


def test_pack_dtype_codes(monkeypatch) -> None:
    # the fused router packs only where its routing tile holds one token (decode)
    cfg = moe_routing.default_router_config(1)
    assert moe_routing._router_plan(1, 256, 2048, torch.bfloat16, cfg, False)[1]["ROUTE_ROWS"] == 1
    cfg = moe_routing.default_router_config(4)
    assert moe_routing._router_plan(4, 256, 2048, torch.bfloat16, cfg, False)[1]["ROUTE_ROWS"] > 1
    monkeypatch.setattr(moe_routing, "PACK_LOGITS", True)
    assert [moe_routing._pack_dtype(d) for d in (torch.float32, torch.bfloat16, torch.float16)] == [0, 1, 2]
    monkeypatch.setattr(moe_routing, "PACK_LOGITS", False)
    assert moe_routing._pack_dtype(torch.bfloat16) == 0


@interpreted
def test_interpreted_router_route_many_experts() -> None:
    """E = 1024 (the most): 4 tokens per routing pass (two passes for T = 6)."""
    t, e, h, k = 6, 1024, 64, 8
    x, w, bias = _router_problem(t, e, h, torch.bfloat16, seed=9)
    assert moe_routing._router_plan(t, e, h, torch.bfloat16, moe_routing.default_router_config(t),
                                    False)[1]["ROUTE_ROWS"] == 4
    args = (k, 30.0, "sqrtsoftplus", True)
    got = fused_router_route(x, w, bias, *args, scale=SCALE, num_shared=1)
    want = _two_kernel_path(x, w, bias, *args, scale=SCALE, num_shared=1)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interpreted_router_route_gaussian_inputs(dtype) -> None:
    """Logits not exact in fp32: the fused sum (another order) may round a bf16 logit the other
    way, so the weights agree within 2 bf16 ulp (fp32: tightly); the ids agree here (seeded; no
    chosen expert this close to the cut)."""
    x, w, bias = _router_problem(16, 256, 2048, dtype, seed=11, exact=False)
    args = (8, 0.0, "sigmoid", True)
    weights, ids = fused_router_route(x, w, bias, *args, scale=SCALE, num_shared=1)
    want_w, want_ids = _two_kernel_path(x, w, bias, *args, scale=SCALE, num_shared=1)
    assert torch.equal(ids, want_ids)
    if dtype == torch.bfloat16:
        assert _ulps_bf16(weights, want_w).max() <= 2
    else:
        torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-7)


@interpreted
def test_interpreted_router_route_repeated_calls_rearm_the_counter() -> None:
    """The last program resets the arrival counter: three calls with one input are bitwise equal,
    a call with another input in between is right, the counter is 0 after each. A counter left
    armed would let the second-to-last program route from a stale partial (checked)."""
    t, e, h, k = 3, 40, 200, 6
    x, w, bias = _router_problem(t, e, h, torch.bfloat16, seed=1)
    x2, _, _ = _router_problem(t, e, h, torch.bfloat16, seed=2)
    args = (k, 30.0, "sqrtsoftplus", True)
    grid, meta = moe_routing._router_plan(t, e, h, torch.bfloat16, moe_routing.default_router_config(t), False)
    assert grid[0] * grid[1] > 1
    _, counter = moe_routing._router_workspace(torch.device("cpu"), e, meta["SPLIT_K"])
    first = fused_router_route(x, w, bias, *args, scale=SCALE)
    for inp in (x, x2, x):
        got = fused_router_route(inp, w, bias, *args, scale=SCALE)
        want = _two_kernel_path(inp, w, bias, *args, scale=SCALE)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert counter.item() == 0
    assert torch.equal(got[0], first[0]) and torch.equal(got[1], first[1])
    # armed counter: the program before the last one routes while the last slab still holds x's
    # partials (the call's input is x2), so the result is x's, not x2's
    counter.fill_(1)
    try:
        stale = fused_router_route(x2, w, bias, *args, scale=SCALE)
        assert not torch.equal(stale[0], _two_kernel_path(x2, w, bias, *args, scale=SCALE)[0])
    finally:
        counter.zero_()


@interpreted
def test_interpreted_router_route_strided_x_and_config() -> None:
    t, e, h, k = 3, 64, 512, 6
    x, w, bias = _router_problem(t, e, h, torch.float32, seed=4)
    wide = torch.zeros(t, h + 40)
    wide[:, 8:8 + h] = x
    args = (k, 0.0, "sigmoid", False)
    want = _two_kernel_path(x, w, bias, *args, scale=SCALE, num_shared=1)
    for xs, cfg in ((wide[:, 8:8 + h], None),  # row stride H + 40, offset
                    (x, moe_routing.RouterConfig(block_n=4, num_warps=4, programs=64, max_k_steps=2)),
                    (x, moe_routing.RouterConfig(block_n=16, num_warps=2, programs=8, max_k_steps=1,
                                                 x_elems=8))):
        got = fused_router_route(xs, w, bias, *args, scale=SCALE, num_shared=1, config=cfg)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # a strided bias in another float dtype
    b2 = torch.stack([bias, bias], 1)[:, 1].to(torch.bfloat16)
    got = fused_router_route(x, w, b2, *args, scale=SCALE)
    want = _two_kernel_path(x, w, b2, *args, scale=SCALE)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_router_plan_grid() -> None:
    """Laguna's router (E = 256, H = 2048, bf16): 32 expert tiles x 4 K splits = 128 programs,
    each 8 experts x 512 of K (two 256-wide steps: 16 bytes a lane per step); 4 warps up to 2
    tokens, 8 above."""
    cfg = moe_routing.default_router_config(1)
    assert moe_routing.default_router_config(2) == cfg
    grid, meta = moe_routing._router_plan(1, 256, 2048, torch.bfloat16, cfg, False)
    assert grid == (32, 4)
    assert (meta["BLOCK_N"], meta["BLOCK_K"], meta["K_STEPS"], meta["SPLIT_K"]) == (8, 256, 2, 4)
    assert not meta["MASK_N"] and not meta["MASK_K"] and meta["num_warps"] == 4
    assert meta["M_PAD"] == 1 and meta["ROUTE_ROWS"] == 1 and meta["X_GROUP"] == 1
    cfg16 = moe_routing.default_router_config(16)
    assert cfg16 == moe_routing.default_router_config(3) and cfg16.num_warps == 8
    grid, meta16 = moe_routing._router_plan(16, 256, 2048, torch.bfloat16, cfg16, False)
    assert grid == (32, 4) and meta16["M_PAD"] == 16 and meta16["ROUTE_ROWS"] == 16
    assert meta16["X_GROUP"] == 16  # 16 rows x 2 steps x 8 bf16 = 256 elements a thread
    assert moe_routing._router_plan(16, 256, 2048, torch.bfloat16, cfg, False)[1]["X_GROUP"] == 8
    # E = 1024: the routing tile stays at 4096 elements (4 tokens a pass)
    assert moe_routing._router_plan(16, 1024, 2048, torch.bfloat16, cfg16, False)[1]["ROUTE_ROWS"] == 4
    # ragged: E = 40 (5 tiles), H = 200 (one masked step)
    grid, meta = moe_routing._router_plan(3, 40, 200, torch.float32, cfg, False)
    assert grid == (5, 2) and meta["MASK_K"] and not meta["MASK_N"]


@pytest.mark.parametrize("num_shared", [0, 1])
def test_router_route_empty_batch(num_shared) -> None:
    x, w, bias = torch.zeros(0, 32), torch.zeros(16, 32), torch.zeros(16)
    weights, ids = fused_router_route(x, w, bias, 4, 0.0, "sigmoid", True, num_shared=num_shared)
    assert weights.shape == ids.shape == (0, 4 + num_shared)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64


def test_router_route_rejects_bad_inputs() -> None:
    x, w, bias = torch.zeros(2, 32), torch.zeros(16, 32), torch.zeros(16)
    bad = [
        ({"x": torch.zeros(32)}, "x must be a 2-D"),
        ({"x": torch.zeros(17, 32)}, "T=17"),
        ({"x": torch.zeros(2, 31)}, "disagree on H"),
        ({"x": torch.zeros(2, 32, dtype=torch.int32), "router_weight": torch.zeros(16, 32, dtype=torch.int32)},
         "x must be float32"),
        ({"router_weight": torch.zeros(16, 32, dtype=torch.bfloat16)}, "dtype"),
        ({"router_weight": torch.zeros(16)}, "router_weight must be a 2-D"),
        ({"router_weight": torch.zeros(32, 16).t()}, "contiguous"),
        ({"x": torch.zeros(32, 2).t()}, "unit column stride"),
        ({"router_weight": torch.zeros(16, 32, device="meta")}, "router_weight is on"),
        ({"router_weight": torch.zeros(1025, 32), "bias": torch.zeros(1025)}, "E=1025"),
        ({"bias": torch.zeros(16, device="meta")}, "bias is on"),
        ({"bias": torch.zeros(15)}, "bias"),
        ({"score_func": "softmax"}, "score_func"),
        ({"top_k": 17}, "top_k"),
        ({"softcap": float("nan")}, "softcap"),
        ({"num_shared": 2}, "num_shared"),
        ({"config": moe_routing.RouterConfig(block_n=12)}, "block_n"),
        ({"config": moe_routing.RouterConfig(num_warps=3)}, "num_warps"),
        ({"config": moe_routing.RouterConfig(programs=0)}, "programs"),
        ({"config": moe_routing.RouterConfig(max_k_steps=3)}, "max_k_steps"),
        ({"config": moe_routing.RouterConfig(x_elems=96)}, "x_elems"),
    ]
    for override, match in bad:
        kwargs = {"x": x, "router_weight": w, "bias": bias, "top_k": 4, "softcap": 0.0,
                  "score_func": "sigmoid", "norm_topk_prob": True, **override}
        with pytest.raises(ValueError, match=match):
            fused_router_route(**kwargs)


def test_can_fuse_router() -> None:
    x, w = torch.zeros(2, 32), torch.zeros(16, 32)
    # not under the interpreter in this process: a CPU tensor cannot run the kernel
    assert moe_routing.can_fuse_router(x, w) == moe_routing.is_available("cpu")
    assert not moe_routing.can_fuse_router(torch.zeros(17, 32), w)
    assert not moe_routing.can_fuse_router(x, w.to(torch.bfloat16))
    assert not moe_routing.can_fuse_router(x, torch.zeros(32, 16).t())


@interpreted
def test_interpreted_can_fuse_router() -> None:
    assert moe_routing.can_fuse_router(torch.zeros(16, 32), torch.zeros(16, 32))
    assert not moe_routing.can_fuse_router(torch.zeros(0, 32), torch.zeros(16, 32))


def _router_ptx(t: int, e: int, h: int, pdl: bool, prefetch_lanes: int = 0,
                prefetch_at: int = 0) -> tuple[str, list[int]]:
    """sm_90 PTX of the fused router kernel as ``fused_router_route`` launches it for bf16 x
    (constexprs from ``_router_plan``; ``prefetch_lanes`` > 0: with an L2 prefetch), and
    ptxas's spill-store bytes."""
    meta = dict(moe_routing._router_plan(t, e, h, torch.bfloat16, moe_routing.default_router_config(t), pdl)[1])
    options = {"num_warps": meta.pop("num_warps"), "num_stages": meta.pop("num_stages")}
    if "launch_pdl" in meta:
        options["launch_pdl"] = meta.pop("launch_pdl")
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*fp32", "weights_ptr": "*bf16",
             "ids_ptr": "*i64", "part_ptr": "*fp32", "count_ptr": "*i32", "softcap": "fp32", "scale": "fp32",
             "pf_ptr": "*bf16"}
    constexprs = dict(stride_b=1, NUM_EXPERTS=e, BLOCK_E=moe_routing._next_pow2(e), TOP_K=8,
                      NUM_SHARED=1, K_PAD=16, HAS_SOFTCAP=True, SQRT_SOFTPLUS=False, NORM=True,
                      OUT_DTYPE=1, BITONIC=moe_routing.TOPK_BITONIC, SEL_K=8,
                      PF_BLOCK=32 * options["num_warps"], PF_LANES=prefetch_lanes, PF_AT=prefetch_at, **meta)
    return compile_sm90_spills(moe_routing._router_route_kernel, types, constexprs, options)


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
@pytest.mark.parametrize("t,e", [(1, 256), (4, 256), (16, 256), (16, 1024)])
def test_sm90_router_route_code(t, e) -> None:
    """What the H200 runs, checked without a GPU: no spills; with PDL only the weight tile
    (16-byte evict_first loads) before the one griddepcontrol.wait, launch_dependents after it; the
    GEMM part (wait .. launch_dependents) reduces K with warp shuffles, one CTA barrier (the
    partials' store) whatever T; the semaphore is an acq_rel atomic, the partials read back .cg,
    the counter reset by a relaxed exchange. Without PDL no griddepcontrol."""
    ptx, spills = _router_ptx(t, e, 2048, pdl=False)
    assert "griddepcontrol" not in ptx and spills and max(spills) == 0, spills
    ptx, spills = _router_ptx(t, e, 2048, pdl=True)
    assert spills and max(spills) == 0, spills
    early = loads_before_pdl_wait(ptx)
    meta = moe_routing._router_plan(t, e, 2048, torch.bfloat16, moe_routing.default_router_config(t), True)[1]
    # a warp per expert row, 16 bytes a lane per K step (rows_per_warp when fewer warps)
    rows_per_warp = meta["BLOCK_N"] // min(meta["BLOCK_N"], meta["num_warps"])
    assert len(early) == meta["K_STEPS"] * rows_per_warp, early
    assert all("evict_first" in line and ".v4." in line for line in early), early
    gemm = ptx[ptx.index("griddepcontrol.wait"):ptx.index("griddepcontrol.launch_dependents")]
    groups = meta["M_PAD"] // meta["X_GROUP"]
    # x: a 16-byte load per K step, row of x and expert row; a group's loads before its FMAs
    per_row = meta["K_STEPS"] * rows_per_warp
    assert gemm.count("ld.global.v4") == meta["M_PAD"] * per_row
    first_fma = gemm.index("fma.rn.f32")
    assert gemm[:first_fma].count("ld.global.v4") == meta["X_GROUP"] * per_row
    assert "shfl.sync.bfly" in gemm and gemm.count("bar.sync") <= 2 * groups - 1
    assert "atom.global.gpu.acq_rel.add" in ptx and "ld.global.cg" in ptx
    assert "atom.global.gpu.relaxed.exch" in ptx
    assert "prefetch" not in ptx


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
@pytest.mark.parametrize("lanes", [moe_routing.PREFETCH_LANES, 81])  # a contiguous region; XS-2.1's rows
@pytest.mark.parametrize("t", [1, 4])
def test_sm90_router_prefetch_is_issued_before_the_pdl_wait(t, lanes) -> None:
    """With a region to prefetch (``MoE.prefetch_next_bytes``) the router issues TMA bulk L2
    prefetches, predicated per lane, before its one PDL wait, next to its weight tile's loads
    (the same loads as without); nothing after the wait changes and nothing spills."""
    plain, _ = _router_ptx(t, 256, 2048, pdl=True)
    ptx, spills = _router_ptx(t, 256, 2048, pdl=True, prefetch_lanes=lanes)
    assert spills and max(spills) == 0, spills
    before_wait = loads_before_pdl_wait(ptx)
    prefetches = [line for line in before_wait if "cp.async.bulk.prefetch.L2.global" in line]
    assert prefetches and ptx.count("cp.async.bulk.prefetch.L2.global") == len(prefetches)
    weight_loads = [line for line in before_wait if line not in prefetches]
    assert len(weight_loads) == len(loads_before_pdl_wait(plain))
    assert all("evict_first" in line and ".v4." in line for line in weight_loads), weight_loads
    assert ptx.count("griddepcontrol.wait") == 1
    after = ptx[ptx.index("griddepcontrol.wait"):]
    assert after.count("ld.global") == plain[plain.index("griddepcontrol.wait"):].count("ld.global")


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
def test_sm90_router_prefetch_placements() -> None:
    """``PREFETCH_AT`` 1: the prefetches right after the PDL wait, before the x loads; 2: after
    the semaphore's atomic (the programs that do not route). No spills either way."""
    for at in (1, 2):
        ptx, spills = _router_ptx(1, 256, 2048, pdl=True, prefetch_lanes=2, prefetch_at=at)
        assert spills and max(spills) == 0, (at, spills)
        first = ptx.index("cp.async.bulk.prefetch.L2.global")
        assert ptx.index("griddepcontrol.wait") < first
        if at == 1:
            assert first < ptx.index("ld.global", ptx.index("griddepcontrol.wait"))
        else:
            assert ptx.index("atom.global.gpu.acq_rel.add") < first


# ---- fused_router_route on CUDA ---------------------------------------------------------------------


def _assert_same_weights(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal logits, so equal weights up to the order of norm_topk_prob's sum, which follows each
    kernel's tile layout on the GPU: 1 ulp (bf16 after the rounding: mostly bitwise)."""
    if got.dtype == torch.bfloat16:
        assert _ulps_bf16(got, want).max() <= 1
    else:
        torch.testing.assert_close(got, want, rtol=5e-7, atol=0)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,e,h,k", [(1, 256, 2048, 8), (4, 256, 2048, 8), (16, 256, 2048, 8),
                                     (3, 40, 200, 6), (16, 1024, 2048, 8)])
def test_cuda_router_route_equals_two_kernel_path(t, e, h, k, dtype) -> None:
    x, w, bias = _router_problem(t, e, h, dtype, seed=t + e, device="cuda")
    for i, (softcap, score_func, norm, shared) in enumerate(
            ((0.0, "sigmoid", True, 1), (30.0, "sqrtsoftplus", False, 0))):
        args = (k, softcap, score_func, norm)
        got = fused_router_route(x, w, bias, *args, scale=SCALE, num_shared=shared)
        want = _two_kernel_path(x, w, bias, *args, scale=SCALE, num_shared=shared)
        assert torch.equal(got[1], want[1]), i
        _assert_same_weights(got[0], want[0])
        ref_w, ref_ids = _reference(F.linear(x, w), bias, *args)
        assert torch.equal(got[1][:, :k], ref_ids)
        torch.testing.assert_close(got[0][:, :k].float(), ref_w, **TOL[dtype])
    # Gaussian inputs (the GEMM sums in another order): weights within 2 bf16 ulp
    x, w, bias = _router_problem(t, e, h, dtype, seed=t, device="cuda", exact=False)
    got = fused_router_route(x, w, bias, k, 0.0, "sigmoid", True, scale=SCALE)
    want = _two_kernel_path(x, w, bias, k, 0.0, "sigmoid", True, scale=SCALE)
    same = (got[1] == want[1]).all(-1)  # tokens whose choice did not flip
    assert same.float().mean() >= 0.9
    if dtype == torch.bfloat16:
        assert _ulps_bf16(got[0][same], want[0][same]).max() <= 2
    else:
        torch.testing.assert_close(got[0][same], want[0][same], rtol=1e-5, atol=1e-7)


@cuda
def test_cuda_router_route_graph_replays() -> None:
    """Captured once, replayed twice with new inputs in between (the counter re-arms inside
    the graph); three eager calls in a row are bitwise equal."""
    t, e, h, k = 16, 256, 2048, 8
    x, w, bias = _router_problem(t, e, h, torch.bfloat16, seed=0, device="cuda")
    args = (bias, k, 0.0, "sigmoid", True)
    first = fused_router_route(x, w, *args, scale=SCALE, num_shared=1)  # compile outside the capture
    for _ in range(2):
        again = fused_router_route(x, w, *args, scale=SCALE, num_shared=1)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gw, gids = fused_router_route(x, w, *args, scale=SCALE, num_shared=1)
    for seed in (1, 2):
        x.copy_(_router_problem(t, e, h, torch.bfloat16, seed=seed, device="cuda")[0])
        graph.replay()
        torch.cuda.synchronize()
        eager = fused_router_route(x, w, *args, scale=SCALE, num_shared=1)
        assert torch.equal(gids, eager[1]) and torch.equal(gw, eager[0])
        want = _two_kernel_path(x, w, *args, scale=SCALE, num_shared=1)
        assert torch.equal(gids, want[1])
        _assert_same_weights(gw, want[0])


@cuda
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability() < (9, 0), reason="needs sm90+")
@pytest.mark.parametrize("at", [0, 1, 2])
@pytest.mark.parametrize("t", [1, 4])
def test_cuda_router_prefetch_changes_no_value(t, at, monkeypatch) -> None:
    """An L2 prefetch from the router programs (``MoE.prefetch_next_bytes``: a region of the next
    layer's Q|K|V|gate weight, or the end of each of its rows) leaves the routes bitwise equal and the weight untouched, eagerly
    and in a CUDA graph."""
    from laguna_dflash.kernels import l2_prefetch

    monkeypatch.setattr(moe_routing, "PREFETCH_AT", at)
    e, h, k = 256, 2048, 8
    x, w, bias = _router_problem(t, e, h, torch.bfloat16, seed=t, device="cuda")
    args = (bias, k, 0.0, "sigmoid", True)
    nxt = torch.randn(10304, 2048, device="cuda").to(torch.bfloat16)  # XS-2.1's Q|K|V|gate
    before = nxt.clone()
    want = fused_router_route(x, w, *args, scale=SCALE, num_shared=1)
    regions = [l2_prefetch.region(nxt, nbytes, from_end)
               for nbytes, from_end in ((16 << 20, True), (8 << 20, False), (nxt.numel() * 2, True))]
    regions += [l2_prefetch.row_suffixes(nxt, 16 << 20), l2_prefetch.row_suffixes(nxt, nxt.numel() * 2)]
    for region in regions:
        spread = region if isinstance(region, l2_prefetch.Spread) else l2_prefetch.contiguous_spread(region, 256)
        assert l2_prefetch.can_run(spread)  # the prefetch really runs here
        got = fused_router_route(x, w, *args, scale=SCALE, num_shared=1, prefetch=region)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gw, gids = fused_router_route(x, w, *args, scale=SCALE, num_shared=1, prefetch=region)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(gw, want[0]) and torch.equal(gids, want[1])
    assert torch.equal(nxt, before)


# ---- Laguna-S-2.1: top-10 routing plus the shared expert (11 pairs a token, K_PAD = SEL_K = 16)

S21_E, S21_TOP_K, S21_HIDDEN = 256, 10, 3072


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interpreted_s21_top10_shared_every_selection_path(monkeypatch, dtype) -> None:
    """S-2.1 routing (E = 256, top_k = 10, the shared column: [T, 11]) equals the reference for
    every selection path (bitonic top-k of SEL_K = 16 keys, whose K_PAD = 16 needs no repeat,
    and the max-reduction loop) with packed and re-read logits, bit for bit between paths; ties
    that straddle the 10th place keep the lower indices."""
    t = 3
    logits, bias = _problem(t, S21_E, dtype, seed=21, device="cpu")
    tied = [5, 17, 40, 41, 99, 100, 101, 128, 200, 201, 202, 255]  # 12 equal keys for 10 places
    logits[2] = -20.0
    logits[2, tied] = 30.0  # sigmoid(30) == 1 in fp32
    bias[tied] = 1.0  # above every other bias (< 0.5)
    ref_w, ref_ids = _reference(logits, bias, S21_TOP_K, 0.0, "sigmoid", True)
    results = []
    for bitonic in (True, False):
        for pack in ((True, False) if dtype != torch.float32 else (True,)):  # fp32 is never packed
            monkeypatch.setattr(moe_routing, "TOPK_BITONIC", bitonic)
            monkeypatch.setattr(moe_routing, "PACK_LOGITS", pack)
            w, ids = fused_moe_route(logits, bias, S21_TOP_K, 0.0, "sigmoid", True, scale=SCALE, num_shared=1)
            assert w.shape == ids.shape == (t, S21_TOP_K + 1) and w.dtype == dtype
            assert torch.all(ids[:, -1] == S21_E) and torch.all(w[:, -1] == 1.0)
            assert torch.equal(ids[:2, :-1], ref_ids[:2])
            assert ids[2, :-1].tolist() == tied[:S21_TOP_K]  # the lower indices of the tie, in order
            torch.testing.assert_close(w[:, :-1].float(), ref_w, **TOL[dtype])
            results.append((w, ids))
    for w, ids in results[1:]:
        assert torch.equal(w, results[0][0]) and torch.equal(ids, results[0][1])


@interpreted
@pytest.mark.parametrize("t", [1, 3], ids=["decode", "verify"])
def test_interpreted_s21_router_hidden_3072(t) -> None:
    """The fused router at S-2.1's H = 3072 (not a power of two: 3 K splits of 4 bf16 steps)
    and top-10 + shared, bf16: bitwise the two-kernel path (exact logits), the ids the
    reference's; T = 1 routes from the packed key, T = 3 a 3-row tile re-reading the logits (the
    fp32 route's path; fp32 itself, 6 splits, runs in the CUDA test: 2x the interpreter's time)."""
    dtype = torch.bfloat16
    x, w, bias = _router_problem(t, S21_E, S21_HIDDEN, dtype, seed=t)
    cfg = moe_routing.default_router_config(t)
    meta = moe_routing._router_plan(t, S21_E, S21_HIDDEN, dtype, cfg, False)[1]
    assert meta["SPLIT_K"] == 3 and meta["K_STEPS"] == 4 and not meta["MASK_K"]
    assert (meta["ROUTE_ROWS"] == 1) == (t == 1)
    assert moe_routing._router_plan(t, S21_E, S21_HIDDEN, torch.float32, cfg, False)[1]["SPLIT_K"] == 6
    args = (S21_TOP_K, 0.0, "sigmoid", True)
    got = fused_router_route(x, w, bias, *args, scale=SCALE, num_shared=1)
    want = _two_kernel_path(x, w, bias, *args, scale=SCALE, num_shared=1)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    ref_w, ref_ids = _reference(F.linear(x, w), bias, *args)
    assert torch.equal(got[1][:, :S21_TOP_K], ref_ids)
    torch.testing.assert_close(got[0][:, :S21_TOP_K].float(), ref_w, **TOL[dtype])


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t", [1, 4, 16, 64])
def test_cuda_s21_top10_shared(t, dtype) -> None:
    """S-2.1 routing on the GPU: fused_moe_route (every T) and the fused router at H = 3072
    (T <= 16) with top-10 + shared, against the reference and the two-kernel path."""
    logits, bias = _problem(t, S21_E, dtype, seed=t, device="cuda")
    for softcap, score_func in ((0.0, "sigmoid"), (30.0, "sqrtsoftplus")):
        _assert_matches_reference(logits, bias, S21_TOP_K, softcap, score_func, True)
    w, ids = fused_moe_route(logits, bias, S21_TOP_K, 0.0, "sigmoid", True, scale=SCALE, num_shared=1)
    assert torch.all(ids[:, -1] == S21_E) and torch.all(w[:, -1] == 1.0)
    if t > moe_routing.MAX_ROUTER_TOKENS:
        return
    x, rw, rbias = _router_problem(t, S21_E, S21_HIDDEN, dtype, seed=t, device="cuda")
    args = (S21_TOP_K, 0.0, "sigmoid", True)
    got = fused_router_route(x, rw, rbias, *args, scale=SCALE, num_shared=1)
    want = _two_kernel_path(x, rw, rbias, *args, scale=SCALE, num_shared=1)
    assert torch.equal(got[1], want[1])
    _assert_same_weights(got[0], want[0])
