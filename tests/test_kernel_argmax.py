"""Row argmax kernels (``kernels/argmax.py``) against ``torch.argmax``: equal index for index.

* Under Triton's CPU interpreter (child pytest, ``TRITON_INTERPRET=1``): fp32 / bf16 / fp16 rows
  of 1 to 100352 entries (one chunk, a chunk plus one, the Laguna vocabulary), ties inside a
  chunk and across chunks (the first wins), rows of -inf, +inf, NaN (the first NaN wins, also
  over +inf), a row-strided slice.
* In this process: what the kernels do not take goes to ``torch.argmax``; the switch turns them off.
* On CUDA (skipped without one): the same cases, random rows at the engine's shapes, and a
  CUDA-graph replay reading new logits.
"""

from __future__ import annotations

import pytest
import torch
from interpreter_child import HAS_TRITON, interpreted, run_interpreted_child

from laguna_dflash.kernels import argmax as am

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and triton")
NAN, INF = float("nan"), float("inf")


def crafted_rows(v: int) -> torch.Tensor:
    """``[9, v]`` fp32 rows whose argmax takes each rule: ties in and across chunks, infinities,
    NaNs (v >= 3 * CHUNK + 10 for every case to be distinct)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, v, generator=g)
    c = am.CHUNK
    x[0, [5, c + 7, 2 * c + 1]] = 9.0          # a tie across chunks: 5
    x[1, [c + 3, c + 9]] = 9.0                  # a tie inside the second chunk: c + 3
    x[2] = -INF                                 # all -inf: 0
    x[3, [c + 1, 3 * c]] = INF                  # +inf twice: c + 1
    x[4, [2 * c + 4, c + 2]] = NAN              # NaNs in two chunks: the first, c + 2
    x[5, 7] = INF
    x[5, 3 * c + 2] = NAN                       # a NaN beats an earlier +inf
    x[6] = 1.5                                  # all equal: 0
    x[7, v - 1] = 50.0                          # the last entry (in the partial last chunk)
    x[8, :] = -INF
    x[8, v - 2] = -1e30                         # one finite entry among -inf
    return x


def check(x: torch.Tensor) -> None:
    got = am.argmax_rows(x)
    want = torch.argmax(x, dim=-1)
    assert got.dtype == torch.int64 and got.shape == want.shape and got.device == x.device
    assert torch.equal(got, want), (got, want)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_interpreted_crafted_rows(dtype):
    x = crafted_rows(3 * am.CHUNK + 10).to(dtype)
    assert am.can_use(x)
    check(x)


@interpreted
@pytest.mark.parametrize("v", [1, 7, am.CHUNK, am.CHUNK + 1, 5000, 100352])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_random_rows(v, dtype):
    # bf16 rows of 100k entries hold ties of the maximum now and then: the first must win
    g = torch.Generator().manual_seed(v)
    check((4 * torch.randn(3, v, generator=g)).to(dtype))


@interpreted
def test_interpreted_row_strided_slice():
    wide = torch.randn(4, 3 * am.CHUNK, generator=torch.Generator().manual_seed(2))
    x = wide[:, 100 : 100 + 2 * am.CHUNK + 5]
    assert x.stride(0) != x.shape[1]
    check(x)


def test_kernels_under_triton_interpreter():
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    run_interpreted_child(__file__)


def test_other_inputs_go_to_torch(monkeypatch):
    # without the interpreter a CPU tensor is torch's; so are 1-D, 3-D, int and column-strided
    # inputs anywhere, and everything with the switch off
    x = crafted_rows(3 * am.CHUNK + 10)
    for bad in (x[0], x.view(3, 3, -1), x.to(torch.int32), x.t()):
        assert not am.can_use(bad)
        assert torch.equal(am.argmax_rows(bad), torch.argmax(bad, dim=-1))
    monkeypatch.setattr(am, "USE_KERNEL", False)
    assert not am.can_use(x)
    check(x)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_crafted_and_random_rows(dtype):
    check(crafted_rows(3 * am.CHUNK + 10).to("cuda", dtype))
    g = torch.Generator().manual_seed(3)
    for n, v in ((1, 100352), (4, 100352), (64, 100352), (3, 151936), (2, 513)):
        check((4 * torch.randn(n, v, generator=g)).to("cuda", dtype))


@needs_cuda
def test_cuda_graph_replay_reads_new_logits():
    x = torch.randn(4, 100352, device="cuda")
    am.argmax_rows(x)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = am.argmax_rows(x)
    for seed in range(5):
        x.copy_(torch.randn(4, 100352, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        assert torch.equal(out, torch.argmax(x, dim=-1))
