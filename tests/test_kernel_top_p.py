"""Top-p by bisection (``kernels/top_p.py``) against the sorted definition.

* In this process: the sort-based reference against a float64 brute force (the kept set: the
  token crossing the bound kept, every tie of the boundary token kept), bounds ``>= 1`` untouched,
  a column of mixed bounds.
* Under Triton's CPU interpreter (child pytest, ``TRITON_INTERPRET=1``): the kernel keeps the
  reference's set and its values within float32 rounding, for peaked, flat, sparse (top-k'd) and
  tied rows, widths from 1 to 3000 (one chunk to 47); a row's bits are the same alone and batched.
* On CUDA (skipped without one): the same, and a CUDA-graph replay on new rows.
"""

from __future__ import annotations

import pytest
import torch
from interpreter_child import HAS_TRITON, interpreted, run_interpreted_child

from laguna_dflash.kernels import top_p as tp

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and triton")


def brute_force_mask(probs: torch.Tensor, bound: float) -> tuple[torch.Tensor, float]:
    """``probs [V]`` -> (kept mask, margin): the sorted definition in float64; the margin is how
    far the boundary's prefix masses sit from the bound (a float32 sum can only move the boundary
    where it is below rounding)."""
    p = probs.double()
    sorted_p = p.sort(descending=True).values
    before = torch.cat([p.new_zeros(1), sorted_p.cumsum(0)[:-1]])
    count = int((before < bound).sum().clamp(min=1))
    tau = sorted_p[count - 1]
    margin = min(abs(float(before[count - 1]) - bound),
                 abs(float(before[count]) - bound) if count < p.numel() else 1.0)
    return p >= tau, margin


def make_rows(v: int, seed: int) -> torch.Tensor:
    """``[6, v]`` float32 probability rows: peaked, flat, sparse (most entries 0, as after top-k),
    ties at every level (bf16 logits), a single entry mass, uniform."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, v, generator=g)
    logits[0] *= 6.0                                   # peaked
    logits[1] *= 0.3                                   # flat
    if v > 8:
        logits[2, torch.randperm(v, generator=g)[: v - v // 8]] = float("-inf")  # sparse
    logits[3] = (logits[3] * 2).bfloat16().float()     # many exact ties
    logits[4] = -30.0
    logits[4, v // 2] = 30.0                           # one token holds ~all the mass
    logits[5] = 0.0                                    # uniform: the boundary is a tie of all
    return torch.softmax(logits, dim=-1)


def assert_keeps_brute_force_set(out: torch.Tensor, probs: torch.Tensor, bounds: list[float]) -> None:
    for row, bound in enumerate(bounds):
        want, margin = brute_force_mask(probs[row], bound)
        got = out[row] > 0
        if margin > 1e-5:
            assert torch.equal(got, want & (probs[row] > 0)), (row, bound, int(got.sum()), int(want.sum()))
        torch.testing.assert_close(out[row].sum(), torch.tensor(1.0), atol=1e-5, rtol=0)


@pytest.mark.parametrize("v", [1, 9, 1000, 4099])
@pytest.mark.parametrize("bound", [0.05, 0.5, 0.9, 0.999])
def test_reference_keeps_the_sorted_set_with_ties(v, bound):
    probs = make_rows(v, seed=v)
    out = tp.top_p_filter_reference(probs, bound)
    assert_keeps_brute_force_set(out, probs, [bound] * probs.shape[0])
    # the uniform row is one tie: all of it is kept whatever the bound
    assert bool((out[5] > 0).all())


def test_reference_leaves_rows_without_top_p_bitwise():
    probs = make_rows(300, seed=3)
    assert tp.top_p_filter_reference(probs, 1.0) is probs
    bounds = torch.tensor([[0.5], [float("inf")], [0.9], [1.0], [0.2], [float("inf")]])
    out = tp.top_p_filter_reference(probs, bounds)
    for row in (1, 3, 5):
        assert torch.equal(out[row], probs[row])
    assert_keeps_brute_force_set(out[[0, 2, 4]], probs[[0, 2, 4]], [0.5, 0.9, 0.2])


def test_filter_falls_back_to_the_reference_without_the_kernel(monkeypatch):
    monkeypatch.setattr(tp, "USE_KERNEL", False)
    probs = make_rows(64, seed=4)
    assert not tp.can_use(probs)
    torch.testing.assert_close(tp.top_p_filter_(probs.clone(), 0.7), tp.top_p_filter_reference(probs, 0.7),
                               rtol=0, atol=0)


def check_kernel(probs: torch.Tensor, bounds: list[float]) -> None:
    """The kernel in place against the reference: the same set, values within rounding."""
    assert tp.can_use(probs)
    column = torch.tensor(bounds, dtype=torch.float32, device=probs.device).view(-1, 1)
    want = tp.top_p_filter_reference(probs, column)
    got = probs.clone()
    assert tp.top_p_filter_(got, column) is got
    assert_keeps_brute_force_set(got.cpu(), probs.cpu(), [min(b, 1.0) for b in bounds])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    for row, bound in enumerate(bounds):
        if bound >= 1.0:
            assert torch.equal(got[row], probs[row])


def row_independence(probs: torch.Tensor) -> None:
    bounds = [0.3, 0.95, 1.0, 0.6, 0.8, 0.99]
    column = torch.tensor(bounds, device=probs.device).view(-1, 1)
    batched = tp.top_p_filter_(probs.clone(), column)
    for row, bound in enumerate(bounds):
        alone = tp.top_p_filter_(probs[row : row + 1].clone(), bound)
        assert torch.equal(alone[0], batched[row]), row


@interpreted
@pytest.mark.parametrize("v", [1, 9, tp.CHUNK, tp.CHUNK + 1, 3000])
def test_interpreted_kernel_matches_reference(v):
    check_kernel(make_rows(v, seed=v + 1), [0.9, 0.5, 0.95, 0.3, 0.999, 0.7])
    check_kernel(make_rows(v, seed=v + 2), [0.05, 1.0, float("inf"), 0.9, 0.5, 0.9])


@interpreted
def test_interpreted_kernel_over_many_chunks(monkeypatch):
    # 47 chunks: the select kernel adds the partials over two C_BLOCK (32) iterations
    monkeypatch.setattr(tp, "CHUNK", 64)
    check_kernel(make_rows(3000, seed=7), [0.95, 0.8, 0.5, 0.9, 0.99, 0.3])


@interpreted
def test_interpreted_rows_do_not_depend_on_batch_mates():
    row_independence(make_rows(2500, seed=8))


@interpreted
def test_interpreted_scalar_bound_and_row_stride():
    wide = make_rows(3000, seed=9)
    probs = wide[:, :2000]  # a row-strided view: filtered in place through the view
    assert probs.stride(0) == 3000
    want = tp.top_p_filter_reference(probs, 0.8)
    tp.top_p_filter_(probs, 0.8)
    torch.testing.assert_close(probs, want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(wide[:, 2000:], make_rows(3000, seed=9)[:, 2000:], rtol=0, atol=0)


def test_kernels_under_triton_interpreter():
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    run_interpreted_child(__file__)


@needs_cuda
@pytest.mark.parametrize("v", [9, 4099, 100352])
def test_cuda_kernel_matches_reference(v):
    probs = make_rows(v, seed=v).cuda()
    check_kernel(probs, [0.9, 0.5, 0.95, 0.3, 0.999, 1.0])
    row_independence(probs)


@needs_cuda
def test_cuda_graph_replay_filters_new_rows():
    probs = make_rows(100352, seed=11).cuda()
    column = torch.tensor([[0.9], [0.5], [0.95], [0.3], [0.999], [0.7]], device="cuda")
    static = probs.clone()
    tp.top_p_filter_(static.clone(), column)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tp.top_p_filter_(static, column)
    fresh = make_rows(100352, seed=12).cuda()
    static.copy_(fresh)
    graph.replay()
    torch.testing.assert_close(static, tp.top_p_filter_reference(fresh, column), rtol=1e-5, atol=1e-7)
