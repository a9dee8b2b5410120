"""Row top-k values (``kernels/topk_values.py``) against ``torch.topk(x, k).values``: equal value
for value.

* Under Triton's CPU interpreter (child pytest, ``TRITON_INTERPRET=1``): rows shorter than a
  chunk, a chunk plus one, several chunks; k from 1 to 256 (chunks growing with k); ties of the
  k-th inside a chunk and across chunks, rows holding fewer finite entries than k (-inf), a
  row-strided slice; the sampler's filters give the same probabilities with the kernel and with
  ``torch.topk``.
* In this process: the chunk choice, and what the kernels do not take goes to ``torch.topk``.
* Offline sm_90 compile (no GPU): each chunk / k configuration the vocabulary of Laguna reaches
  builds without spills.
* On CUDA (skipped without one): random and crafted rows at the engine's shapes, and a CUDA-graph
  replay reading new rows.
"""

from __future__ import annotations

import pytest
import torch
from interpreter_child import HAS_TRITON, interpreted, run_interpreted_child
from ptx_sm90 import can_compile_sm90, compile_sm90_spills

from laguna_dflash.kernels import topk_values as tv

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and triton")
INF = float("inf")


def crafted_rows(v: int, k: int) -> torch.Tensor:
    """``[7, v]`` fp32 rows for ``k``: ties of the k-th inside and across chunks, fewer finite
    entries than k, all equal, the largest in the partial last chunk, all negative (the merge's
    padding must not show: 3 chunks leave it some); ``v > 2 * MIN_CHUNK + 2``."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(7, v, generator=g)
    c = tv.MIN_CHUNK
    x[0, : k + 5] = 4.0                                    # k + 5 tied at the top, one chunk
    x[1, [3, c + 1, 2 * c + 2, v - 1]] = 6.0               # ties across chunks
    x[2] = -INF
    x[2, [7, c + 9]] = 1.0                                 # two finite entries, the rest -inf
    x[3] = 0.5                                             # all equal
    x[4, v - 1] = 50.0                                     # the largest in the last chunk
    x[5] = (x[5] * 4).to(torch.bfloat16).float()           # bf16-rounded: ties all over
    x[6] = -x[6].abs() - 1.0
    return x


@pytest.fixture(autouse=True)
def kernel_on(monkeypatch):
    """The kernels are on by default (``USE_KERNEL``); set here so these tests hold whatever
    the default."""
    monkeypatch.setattr(tv, "USE_KERNEL", True)


def check(x: torch.Tensor, k: int) -> None:
    got = tv.topk_values(x, k)
    want = torch.topk(x, k, dim=-1).values
    assert got.dtype == torch.float32 and got.shape == want.shape and got.device == x.device
    assert torch.equal(got, want), (k, (got != want).nonzero()[:5])


def test_chunk_grows_with_k():
    # the Laguna vocabulary: 98 chunks of 1024 up to k 32, then fewer, larger ones; none past
    # what the merge holds (torch.topk then)
    v = 100352
    assert [tv.chunk_for(v, k) for k in (1, 20, 32, 33, 64, 128, 256, 257, 1024)] == [
        1024, 1024, 1024, 2048, 2048, 4096, 8192, None, None]
    assert tv.chunk_for(5000, 20) == 1024 and tv.chunk_for(600, 600) == 1024
    for k in (1, 20, 64, 256):
        chunk = tv.chunk_for(v, k)
        assert -(-v // chunk) * max(2, 1 << (k - 1).bit_length()) <= tv.MAX_MERGE


@interpreted
@pytest.mark.parametrize("k", [1, 20, 256])
def test_interpreted_crafted_rows(k):
    x = crafted_rows(2 * tv.MIN_CHUNK + 10, k)
    assert tv.can_use(x, k)
    check(x, k)


@interpreted
@pytest.mark.parametrize("v, k", [(1, 1), (7, 7), (100, 64), (tv.MIN_CHUNK + 1, 20), (5000, 50), (2049, 128)])
def test_interpreted_random_rows(v, k):
    g = torch.Generator().manual_seed(v + k)
    check(4 * torch.randn(3, v, generator=g), k)


@interpreted
def test_interpreted_row_strided_slice():
    wide = torch.randn(4, 4 * tv.MIN_CHUNK, generator=torch.Generator().manual_seed(2))
    x = wide[:, 100 : 100 + 2 * tv.MIN_CHUNK + 5]
    assert x.stride(0) != x.shape[1]
    check(x, 20)


@interpreted
def test_interpreted_sampler_filters_equal_with_torch_topk(monkeypatch):
    # the sampler's top-k (and top-p over it) with the kernel and with torch.topk: the same
    # probabilities, bitwise, for a batch mixing k and ties of the k-th
    from laguna_dflash.engine import sampler

    calls = []
    real = sampler.topk_values
    monkeypatch.setattr(sampler, "topk_values", lambda x, k: (calls.append(k), real(x, k))[1])
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(4)) * 3
    logits[1, 10:40] = logits[1].max()  # 30 tied most likely tokens
    args = ([0.8, 1.0, 0.7, 1.2], [20, 5, 50, 0], [0.9, 0.5, 1.0, 0.95], [0.0, 0.0, 0.1, 0.0])
    with_kernel = sampler.filtered_probs_rows(logits, *args)
    assert calls == [50] and tv.can_use(logits, 50)
    monkeypatch.setattr(tv, "USE_KERNEL", False)
    assert torch.equal(with_kernel, sampler.filtered_probs_rows(logits, *args))


def test_kernels_under_triton_interpreter():
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    run_interpreted_child(__file__)


def test_other_inputs_go_to_torch(monkeypatch):
    # without the interpreter a CPU tensor is torch's; so are 1-D, bf16, column-strided inputs, a k
    # past the merge, and everything with the switch off
    x = crafted_rows(2 * tv.MIN_CHUNK + 10, 20)
    wide = torch.randn(2, 100352)
    for bad, k in ((x[0], 20), (x.to(torch.bfloat16), 20), (x.t(), 3), (wide, 300)):
        assert not tv.can_use(bad, k)
        assert torch.equal(tv.topk_values(bad, k), torch.topk(bad, k, dim=-1).values)
    monkeypatch.setattr(tv, "USE_KERNEL", False)
    assert not tv.can_use(x, 20)
    check(x, 20)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("v, max_k", [(100352, 1024), (100352, 20), (200, 1024), (5000, 1024), (3, 1024)])
def test_build_ahead_ks_reach_every_variant(v, max_k):
    # every k the sampler can launch the kernels with (k <= max_k, a chunk exists) shares its
    # K_PAD and Triton's own specialisation of the integer k (the oracle: triton's
    # native_specialize_impl) with one of build_ahead_ks, and the list holds one k per pair
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    def variant(k: int) -> tuple:
        return max(2, tv._next_pow2(k)), native_specialize_impl(BaseBackend, k, False, True, True)

    ks = tv.build_ahead_ks(v, max_k)
    launched = [k for k in range(1, min(v, max_k) + 1) if tv.chunk_for(v, k) is not None]
    assert set(ks) <= set(launched)
    assert {variant(k) for k in launched} == {variant(k) for k in ks}
    assert len({variant(k) for k in ks}) == len(ks)
    if (v, max_k) == (100352, 1024):  # eight K_PAD buckets up to 256; k = 1 and the multiples of 16 apart
        assert ks == [1, 2, 3, 5, 9, 16, 17, 32, 33, 48, 65, 80, 129, 144]


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
@pytest.mark.parametrize("k_pad", [32, 64, 128, 256])
def test_sm90_builds_without_spills(k_pad):
    # the configurations of the Laguna vocabulary (100352 columns) at k up to 256, as launched
    chunk_kernel, merge_kernel = tv._kernels(False)
    chunk = tv.chunk_for(100352, k_pad)
    _, spills = compile_sm90_spills(chunk_kernel, {"x_ptr": "*fp32", "part_ptr": "*fp32"},
                                    {"CHUNK": chunk, "K_PAD": k_pad},
                                    {"num_warps": 4 if chunk <= 2048 else 8})
    assert spills == [0], (chunk, k_pad, spills)
    block = max(k_pad, 1 << ((-(-100352 // chunk) * k_pad) - 1).bit_length())
    _, spills = compile_sm90_spills(merge_kernel, {"part_ptr": "*fp32", "out_ptr": "*fp32"},
                                    {"K_PAD": k_pad, "BLOCK": block}, {"num_warps": 4})
    assert spills == [0], (block, k_pad, spills)


@needs_cuda
@pytest.mark.parametrize("k", [1, 20, 50, 64, 128, 256])
def test_cuda_crafted_and_random_rows(k):
    check(crafted_rows(2 * tv.MIN_CHUNK + 10, k).cuda(), k)
    g = torch.Generator().manual_seed(3)
    for n, v in ((1, 100352), (4, 100352), (64, 100352), (3, 151936), (2, 513)):
        if k <= v:
            check((4 * torch.randn(n, v, generator=g)).cuda(), k)
            check((4 * torch.randn(n, v, generator=g)).to(torch.bfloat16).float().cuda(), k)  # ties


@needs_cuda
def test_cuda_graph_replay_reads_new_rows():
    x = torch.randn(4, 100352, device="cuda")
    tv.topk_values(x, 20)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tv.topk_values(x, 20)
    for seed in range(5):
        x.copy_(torch.randn(4, 100352, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        assert torch.equal(out, torch.topk(x, 20, dim=-1).values)
