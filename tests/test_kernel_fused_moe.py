"""Fused MoE experts (kernels/fused_moe.py): torch reference, Triton kernel, MoE.forward hook.

* ``moe_experts_reference`` equals ``MoE.experts_forward`` bit for bit (fp32 and bf16).
* On the CPU, ``MoE.forward`` never takes the fused path (bit-identical with it switched off).
* The Triton kernels equal the reference under ``TRITON_INTERPRET=1`` on the CPU: T in {1, 3, 16},
  top_k in {1, 2, 8}, E in {4, 64}, fp32 and bf16, plus shapes with several column blocks and
  K-loop steps and a run longer than one row tile (every token on the same experts). The
  interpreter runs in ONE subprocess (the variable must be set before triton is imported and must
  not leak into other tests); each case is reported as its own test.
* On CUDA (skipped without one): Laguna-XS-2.1 shapes (H 2048, I 512, E 256, k 8) vs the
  reference, ``MoE.forward`` fused vs torch, and CUDA-graph capture.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from interpreter_child import interpreter_script_json
from ptx_sm90 import can_compile_sm90, compile_sm90, loads_before_pdl_wait

from laguna_dflash.kernels.fused_moe import (
    HAS_TRITON,
    fused_moe_experts,
    is_available,
    moe_experts_reference,
)
from laguna_dflash.models.layers import MoE

# relative tolerances on max|ours - ref| / max|ref| against an fp32 reference
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def _problem(
    t: int, k: int, e: int, hidden: int, inter: int, dtype: torch.dtype, seed: int,
    same_experts: bool = False, device: str = "cpu",
) -> tuple[torch.Tensor, ...]:
    """x [T, H], ids [T, k] (distinct per token), weights [T, k], gate_up [E, 2I, H], down [E, H, I]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g)
    gate_up = torch.randn(e, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(e, hidden, inter, generator=g) / inter**0.5
    if same_experts:
        ids = torch.arange(k).repeat(t, 1)
    else:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    weights = weights / weights.sum(-1, keepdim=True)
    return tuple(
        a.to(device=device, dtype=dtype if a.is_floating_point() else a.dtype)
        for a in (x, ids, weights, gate_up, down)
    )


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item()


def _fp32_reference(x, ids, weights, gate_up, down) -> torch.Tensor:
    return moe_experts_reference(x.float(), ids, weights.float(), gate_up.float(), down.float())


def _moe(e: int, k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(hidden, e, k, inter, inter, routed_scaling_factor=2.5)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, hidden**-0.5)
        moe.e_score_correction_bias.uniform_(-0.1, 0.1)
    return moe.to(dtype).eval()


# ----------------------------------------------------------------------------- torch reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,k,e", [(1, 8, 64), (3, 2, 4), (16, 8, 64), (16, 4, 4), (5, 1, 4)])
def test_reference_equals_moe_experts_forward(t: int, k: int, e: int, dtype: torch.dtype) -> None:
    moe = _moe(e, k, 32, 16, dtype)
    x = torch.randn(t, 32).to(dtype)
    weights, ids = moe.route(x)
    ours = moe_experts_reference(x, ids, weights, moe.experts_gate_up, moe.experts_down)
    assert torch.equal(ours, moe.experts_forward(x, weights, ids))


def test_cpu_forward_never_takes_the_fused_path() -> None:
    moe = _moe(8, 2, 32, 16, torch.float32)
    x = torch.randn(4, 32)
    moe.use_fused_moe = True
    with torch.no_grad():
        fused_on = moe(x)
        moe.use_fused_moe = False
        fused_off = moe(x)
    assert torch.equal(fused_on, fused_off)
    assert not is_available("cpu")


# ----------------------------------------------------------------------------- interpreter

_CASES: list[dict] = [
    {"t": t, "k": k, "e": e, "hidden": 48, "inter": 24, "dtype": dt, "same": False}
    for t in (1, 3, 16) for k in (1, 2, 8) for e in (4, 64) for dt in ("float32", "bfloat16")
    if k <= e
] + [
    # two column blocks in gate_up, three in down, two K-loop steps in gate_up, ragged edges
    {"t": 3, "k": 2, "e": 4, "hidden": 160, "inter": 40, "dtype": dt, "same": False}
    for dt in ("float32", "bfloat16")
] + [
    # every token on experts 0..k-1: runs of 80 pairs span two 64-row tiles
    {"t": 80, "k": 2, "e": 4, "hidden": 32, "inter": 16, "dtype": "float32", "same": True},
    {"t": 16, "k": 8, "e": 64, "hidden": 32, "inter": 16, "dtype": "bfloat16", "same": True},
]


def _case_id(c: dict) -> str:
    return f"T{c['t']}-k{c['k']}-E{c['e']}-H{c['hidden']}-I{c['inter']}-{c['dtype']}" + (
        "-same" if c["same"] else ""
    )


def _run_interpreter_cases() -> dict[str, float]:
    """Runs in the subprocess (TRITON_INTERPRET=1): relative error of every case."""
    torch.set_num_threads(1)
    errors = {}
    for i, c in enumerate(_CASES):
        args = _problem(c["t"], c["k"], c["e"], c["hidden"], c["inter"], getattr(torch, c["dtype"]),
                        seed=i, same_experts=c["same"])
        out = fused_moe_experts(*args)
        assert out.dtype == args[0].dtype and out.shape == args[0].shape
        errors[_case_id(c)] = _rel_err(out, _fp32_reference(*args))
    return errors


@pytest.fixture(scope="module")
def interpreter_errors() -> dict[str, float]:
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    return interpreter_script_json(__file__, timeout=300)


@pytest.mark.parametrize("case", _CASES, ids=_case_id)
def test_triton_interpreter_matches_reference(case: dict, interpreter_errors: dict[str, float]) -> None:
    err = interpreter_errors[_case_id(case)]
    assert err <= TOL[case["dtype"]], f"{_case_id(case)}: relative error {err:.3g}"


def test_interpreter_does_not_leak() -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


# ----------------------------------------------------------------------------- CUDA

cuda = pytest.mark.skipif(not is_available("cuda"), reason="needs a CUDA GPU (sm80+) and triton")
XS = {"e": 256, "k": 8, "hidden": 2048, "inter": 512}


@cuda
@pytest.mark.parametrize("t", [1, 2, 4, 16, 32])
def test_cuda_xs21_shapes_match_reference(t: int) -> None:
    args = _problem(t, XS["k"], XS["e"], XS["hidden"], XS["inter"], torch.bfloat16, seed=t,
                    device="cuda")
    ref = _fp32_reference(*args)
    ours = fused_moe_experts(*args)
    torch_path = moe_experts_reference(*args)  # the bf16 torch path, for scale
    assert _rel_err(ours, ref) <= max(TOL["bfloat16"], 2 * _rel_err(torch_path, ref))
    args32 = tuple(a.float() if a.is_floating_point() else a for a in args)
    assert _rel_err(fused_moe_experts(*args32), _fp32_reference(*args32)) <= 1e-5


@cuda
def test_cuda_moe_forward_fused_vs_torch_and_graph_capture() -> None:
    moe = _moe(XS["e"], XS["k"], XS["hidden"], XS["inter"], torch.bfloat16).cuda()
    x = torch.randn(16, XS["hidden"], device="cuda", dtype=torch.bfloat16)
    moe.use_fused_moe = True
    with torch.no_grad():
        fused = moe(x)
        moe.use_fused_moe = False
        plain = moe(x)
        moe.use_fused_moe = True
        assert _rel_err(fused, plain) <= 3e-2  # routed (x2.5) + shared, bf16 both ways
        # static shapes, no host sync: capture once, replay on new inputs
        static_x = x.clone()
        moe(static_x)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = moe(static_x)
        static_x.copy_(torch.randn_like(static_x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, moe(static_x))  # deterministic: no atomics


def test_grouped_path_matches_reference_loop_on_cpu() -> None:
    """The sorted grouped-GEMM path (torch._grouped_mm) equals the per-expert loop."""
    moe = _moe(8, 2, 32, 16, torch.bfloat16)
    x = torch.randn(37, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        weights, ids = moe.route(x)
        grouped = moe.experts_forward_grouped(x, weights, ids)
        loop = moe.experts_forward(x, weights, ids)
    assert _rel_err(grouped, loop) <= 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_grouped_path_large_batch_and_graph_capture() -> None:
    """Above the fused kernel's pair limit the forward takes the sync-free grouped path: it
    matches the loop and captures in a CUDA graph."""
    moe = _moe(XS["e"], XS["k"], XS["hidden"], XS["inter"], torch.bfloat16).cuda()
    x = torch.randn(256, XS["hidden"], device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        weights, ids = moe.route(x)
        assert _rel_err(moe.experts_forward_grouped(x, weights, ids),
                        moe.experts_forward(x, weights, ids)) <= 2e-2
        out = moe(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = moe(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, out)


if __name__ == "__main__" and sys.argv[1:] == ["--interpreter-cases"]:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print(json.dumps(_run_interpreter_cases()))


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
def test_sm90_programmatic_dependent_launch_order() -> None:
    """With ``kernels.pdl.USE_PDL`` both kernels wait for their inputs before any global load and
    signal their dependents after the wait; off: no griddepcontrol (kernels/pdl.py)."""
    from laguna_dflash.kernels import fused_moe

    for kernel, types, constexprs in (
        (fused_moe._gate_up_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "ids_ptr": "*i64", "h_ptr": "*bf16"},
         dict(K_TOP=9, H=2048, INTER=512)),
        (fused_moe._down_kernel, {"h_ptr": "*bf16", "w_ptr": "*bf16", "ids_ptr": "*i64", "rw_ptr": "*bf16",
                                  "out_ptr": "*bf16"}, dict(H=2048, INTER=512)),
    ):
        common = dict(P_PAD=64, M_TILES=1, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, IEEE=False)
        for pdl in (False, True):
            ptx = compile_sm90(kernel, types, {**constexprs, **common, "PDL": pdl},
                               {"num_warps": 4, "num_stages": 4, "launch_pdl": pdl})
            if not pdl:
                assert "griddepcontrol" not in ptx
                continue
            assert loads_before_pdl_wait(ptx) == []
