"""Token embedding gather (``kernels/embedding.py``) against ``F.embedding``: bitwise (a copy).

* Under Triton's CPU interpreter (child pytest, ``TRITON_INTERPRET=1``): fp32, bf16 and fp16,
  widths below, at and past the program's block, int32 and int64 ids, strided ids (a column of
  the graph runner's request rows), repeated ids.
* In this process: operands the kernel does not take are refused by ``can_run`` and raise a
  ValueError naming the argument and the fallback; T == 0 returns an empty tensor; the
  embedding module takes torch's gather off CUDA.
* Offline sm_90 PTX: with PDL a program loads nothing before its wait, then signals.
* On CUDA (skipped without one): decode, verify and prefill shapes, CUDA-graph capture, and the
  dispatch of ``fusion.embedding`` to the kernel (and away from it when off).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from interpreter_child import HAS_TRITON, INTERPRETED, interpreted, run_interpreted_child
from ptx_sm90 import can_compile_sm90, compile_sm90, loads_before_pdl_wait

from laguna_dflash.kernels import embedding as emb
from laguna_dflash.models import fusion


def table(vocab: int, hidden: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(vocab + hidden)
    return torch.randn(vocab, hidden, generator=g).to(dtype).to(device)


def check(ids: torch.Tensor, weight: torch.Tensor) -> None:
    out = emb.embedding(ids, weight)
    want = F.embedding(ids.long(), weight)
    assert out.dtype == weight.dtype and out.is_contiguous() and out.shape == want.shape
    assert torch.equal(out, want)


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="triton not installed / already the child")
def test_kernel_under_triton_interpreter():
    run_interpreted_child(__file__)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("hidden", [96, emb.BLOCK, 3072])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_interpreted_equals_torch(hidden, dtype, id_dtype):
    weight = table(50, hidden, dtype)
    check(torch.tensor([3, 49, 0, 3, 17, 25, 8], dtype=id_dtype), weight)


@interpreted
def test_interpreted_strided_ids():
    """The ids of a graphed forward: a column range of the request rows (row stride 11)."""
    rows = torch.arange(4 * 11).view(4, 11) % 37
    check(rows[:, 5], table(37, 128, torch.bfloat16))


# ---- host side (no launch) ----------------------------------------------------------------------------


def test_empty_batch_returns_empty_tensor_without_launch():
    out = emb.embedding(torch.zeros(0, dtype=torch.long), table(5, 64, torch.bfloat16))
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("change", ["2d_ids", "float_ids", "int8_weight", "inner_stride"])
def test_refuses_what_it_cannot_take(change):
    ids, weight = torch.tensor([1, 2]), table(8, 64, torch.float32)
    if change == "2d_ids":
        ids = ids.view(1, 2)
    elif change == "float_ids":
        ids = ids.float()
    elif change == "int8_weight":
        weight = weight.to(torch.int8)
    else:
        weight = table(8, 128, torch.float32)[:, ::2]
    assert not emb.can_run(ids, weight)
    with pytest.raises(ValueError, match=r"embedding: (ids|weight) must .*fusion.embedding"):
        emb.embedding(ids, weight)


def test_module_takes_torchs_gather_off_cuda():
    from laguna_dflash.models.layers import VocabParallelEmbedding

    module = VocabParallelEmbedding(40, 32)
    ids = torch.tensor([0, 39, 5, 5])
    with torch.inference_mode():
        assert torch.equal(module(ids), F.embedding(ids, module.weight))


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
def test_sm90_programmatic_dependent_launch_order():
    """With ``kernels.pdl.USE_PDL`` a program waits before its first global load (the ids are
    written ahead of the forward) and signals its dependents right after; without PDL no
    griddepcontrol is emitted."""
    types = {"ids_ptr": "*i64", "w_ptr": "*bf16", "out_ptr": "*bf16", "stride_ids": "i32",
             "stride_w": "i32", "stride_o": "i32"}

    def ptx_of(pdl: bool) -> str:
        constexprs = dict(HIDDEN=2048, BLOCK=emb.BLOCK, PDL=pdl)
        return compile_sm90(emb._kernel(False), types, constexprs, {"num_warps": 4, "launch_pdl": pdl})

    assert "griddepcontrol" not in ptx_of(False)
    ptx = ptx_of(True)
    assert not loads_before_pdl_wait(ptx)
    after = ptx[ptx.index("griddepcontrol.wait"):]
    assert after.index("griddepcontrol.launch_dependents") < after.index("ld.global")


# ---- CUDA -------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(INTERPRETED or not (HAS_TRITON and torch.cuda.is_available()),
                          reason="needs a CUDA GPU and triton")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t", [1, 4, 16, 2048])
def test_cuda_equals_torch(t, dtype):
    weight = table(100352, 2048, dtype, device="cuda")
    ids = torch.randint(0, 100352, (t,), generator=torch.Generator().manual_seed(t)).cuda()
    check(ids, weight)
    check(ids.int(), weight)


@cuda
def test_cuda_graph_capture():
    weight = table(1000, 2048, torch.bfloat16, device="cuda")
    ids = torch.tensor([5, 7, 999, 0], device="cuda")
    emb.embedding(ids, weight)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = emb.embedding(ids, weight)
    ids.copy_(torch.tensor([1, 2, 3, 998]))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, F.embedding(ids, weight))


@cuda
def test_cuda_fusion_dispatches_to_the_kernel(monkeypatch):
    """In CUDA inference ``fusion.embedding`` runs this kernel, and ``use_embedding_kernel =
    False`` (or autograd on) takes it back to torch's gather."""
    weight = table(1000, 2048, torch.bfloat16, device="cuda")
    ids = torch.tensor([5, 7, 999], device="cuda")
    calls = []
    real = emb.embedding
    monkeypatch.setattr(emb, "embedding", lambda *a: calls.append(a) or real(*a))
    with torch.inference_mode():
        got = fusion.embedding(ids, weight)
        assert len(calls) == 1
        monkeypatch.setattr(fusion, "use_embedding_kernel", False)
        fusion.embedding(ids, weight)
        assert len(calls) == 1
    monkeypatch.setattr(fusion, "use_embedding_kernel", True)
    fusion.embedding(ids, weight)  # autograd on: not the kernel
    assert len(calls) == 1
    assert torch.equal(got, F.embedding(ids, weight))
