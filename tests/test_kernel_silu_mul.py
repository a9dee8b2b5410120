"""SwiGLU kernel (``kernels/silu_mul.py``) against ``fusion.silu_mul``'s eager body.

* Under Triton's CPU interpreter (child pytest, ``TRITON_INTERPRET=1``): fp32, bf16 and fp16,
  a width that is not a multiple of the program's block and one of two blocks, T in {1, 7},
  ``gate_up`` a row-strided slice of a wider tensor: within an ulp of eager (``exp``'s last bit),
  and equal in nearly every element.
* In this process: operands the kernel does not take are refused by ``can_run`` and raise a
  ValueError naming the argument and the fallback; T == 0 returns an empty tensor without a launch.
* Offline sm_90 PTX: with PDL a program loads nothing before its wait, then signals.
* On CUDA (skipped without one): decode and prefill shapes, CUDA-graph capture, and the dispatch
  of ``fusion.silu_mul`` to the kernel (and away from it when off).
"""

from __future__ import annotations

import pytest
import torch
from interpreter_child import HAS_TRITON, INTERPRETED, interpreted, run_interpreted_child
from ptx_sm90 import can_compile_sm90, compile_sm90, loads_before_pdl_wait

from laguna_dflash.kernels import silu_mul as sm
from laguna_dflash.models import fusion

# fraction of elements allowed to differ at all from eager (exp's last fp32 bit, which bf16 and
# fp16 rounding hides nearly always)
STRICT = {torch.float32: 0.2, torch.bfloat16: 0.01, torch.float16: 0.01}
TOL = {torch.float32: {"rtol": 1e-6, "atol": 1e-6}, torch.bfloat16: {"rtol": 8e-3, "atol": 1e-5},
       torch.float16: {"rtol": 1e-3, "atol": 1e-5}}


def gate_up_of(t: int, inter: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    """``[T, 2I]``, a row-strided slice of a wider tensor; values over silu's curved range."""
    g = torch.Generator().manual_seed(seed)
    wide = 4 * torch.randn(t, 2 * inter + 24, generator=g)
    return wide.to(dtype).to(device)[:, 8 : 8 + 2 * inter]


def check(gate_up: torch.Tensor) -> None:
    dtype = gate_up.dtype
    out = sm.silu_mul(gate_up)
    want = fusion.silu_mul.eager(gate_up)
    assert out.dtype == dtype and out.is_contiguous() and out.shape == want.shape
    torch.testing.assert_close(out, want, **TOL[dtype])
    differ = int((out != want).sum())
    assert differ <= STRICT[dtype] * out.numel(), differ


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="triton not installed / already the child")
def test_kernel_under_triton_interpreter():
    run_interpreted_child(__file__)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("inter", [96, 2 * sm.BLOCK])
@pytest.mark.parametrize("t", [1, 7])
def test_interpreted_equals_eager(t, inter, dtype):
    assert sm.is_available("cpu")
    check(gate_up_of(t, inter, dtype, seed=t + inter))


@interpreted
def test_interpreted_uses_each_rows_own_halves():
    """Gate from the first half, up from the second, row by row: rows and halves that differ
    in scale give distinct outputs (a swapped half or a shared row would not match)."""
    gate_up = torch.cat([torch.linspace(-6, 6, 2 * 130).view(2, 130), torch.full((2, 130), 3.0)], 1)
    gate_up[1, 130:] = -0.5
    check(gate_up)


# ---- host side (no launch) ----------------------------------------------------------------------------


def test_empty_batch_returns_empty_tensor_without_launch():
    out = sm.silu_mul(torch.zeros(0, 64, dtype=torch.bfloat16))  # a CPU launch fails uninterpreted
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("change", ["3d", "odd_width", "inner_stride", "int"])
def test_refuses_what_it_cannot_take(change):
    gate_up = {"3d": torch.zeros(2, 3, 64), "odd_width": torch.zeros(3, 65),
               "inner_stride": torch.zeros(3, 128)[:, ::2], "int": torch.zeros(3, 64, dtype=torch.int32)}[change]
    assert not sm.can_run(gate_up)
    with pytest.raises(ValueError, match=r"silu_mul: gate_up must .*fusion.silu_mul"):
        sm.silu_mul(gate_up)


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="triton not installed / interpreter on")
def test_not_available_on_a_cpu_without_the_interpreter():
    gate_up = torch.zeros(2, 64)
    assert not sm.is_available("cpu") and not sm.can_run(gate_up)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        sm.silu_mul(gate_up)


def test_fusion_takes_the_eager_body_off_cuda():
    gate_up = gate_up_of(3, 64, torch.float32)
    with torch.inference_mode():
        assert torch.equal(fusion.silu_mul(gate_up), fusion.silu_mul.eager(gate_up))


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
def test_sm90_programmatic_dependent_launch_order():
    """With ``kernels.pdl.USE_PDL`` a program waits before its first global load (both operands
    are the gate|up GEMM's output) and signals its dependents right after; without PDL no
    griddepcontrol is emitted."""
    types = {"x_ptr": "*bf16", "out_ptr": "*bf16", "stride_xt": "i32", "stride_ot": "i32"}

    def ptx_of(pdl: bool) -> str:
        constexprs = dict(INTER=8192, BLOCK=sm.BLOCK, DTYPE=1, PDL=pdl, LIBDEVICE_EXP=True)
        return compile_sm90(sm._kernels(False), types, constexprs,
                            {"num_warps": 4, "enable_fp_fusion": False, "launch_pdl": pdl})

    assert "griddepcontrol" not in ptx_of(False)
    ptx = ptx_of(True)
    assert not loads_before_pdl_wait(ptx)
    after = ptx[ptx.index("griddepcontrol.wait"):]
    assert after.index("griddepcontrol.launch_dependents") < after.index("ld.global")


# ---- CUDA -------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(INTERPRETED or not sm.is_available("cuda"), reason="needs a CUDA GPU (sm80+) and triton")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,inter", [(1, 8192), (4, 8192), (16, 8192), (300, 8192), (5, 12288), (3, 96)])
def test_cuda_equals_eager(t, inter, dtype):
    check(gate_up_of(t, inter, dtype, device="cuda", seed=t))


@cuda
def test_cuda_graph_capture():
    gate_up = gate_up_of(4, 8192, torch.bfloat16, device="cuda", seed=1)
    sm.silu_mul(gate_up)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sm.silu_mul(gate_up)
    gate_up.copy_(gate_up_of(4, 8192, torch.bfloat16, device="cuda", seed=2))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, fusion.silu_mul.eager(gate_up), **TOL[torch.bfloat16])


@cuda
def test_cuda_fusion_dispatches_to_the_kernel(monkeypatch):
    """In CUDA inference ``fusion.silu_mul`` runs this kernel, and ``use_silu_kernel = False``
    (or autograd on) takes it back to torch.compile / eager."""
    gate_up = gate_up_of(5, 8192, torch.bfloat16, device="cuda")
    calls = []
    real = sm.silu_mul
    monkeypatch.setattr(sm, "silu_mul", lambda *a: calls.append(a) or real(*a))
    with torch.inference_mode():
        fusion.silu_mul(gate_up)
        assert len(calls) == 1
        monkeypatch.setattr(fusion, "use_silu_kernel", False)
        got = fusion.silu_mul(gate_up)
        assert len(calls) == 1
    monkeypatch.setattr(fusion, "use_silu_kernel", True)
    fusion.silu_mul(gate_up)  # autograd on: not the kernel
    assert len(calls) == 1
    torch.testing.assert_close(got, fusion.silu_mul.eager(gate_up), **TOL[torch.bfloat16])
