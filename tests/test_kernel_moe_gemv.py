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
from ptx_sm90 import can_compile_sm90, compile_sm90, compile_sm90_spills, loads_before_pdl_wait
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


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,k,e,hidden,inter", [(1, 9, 12, 80, 40), (4, 3, 5, 272, 16)])
def test_interpreted_shared_expert_early_is_the_same(t, k, e, hidden, inter, dtype) -> None:
    """``shared_expert_early``: the gate_up kernel computes every token's last pair as expert
    E - 1 in its early branch: bitwise the per-pair result. That the branch ran: with another id
    in that column (which only the down kernel then reads) the result differs from the plain
    path's on the same ids."""
    x, ids, w, gu, dn = _problem(t, k, e, hidden, inter, dtype, seed=t)
    ids[:, -1] = e - 1
    want = moe_gemv_experts(x, ids, w, gu, dn)
    assert torch.equal(moe_gemv_experts(x, ids, w, gu, dn, shared_expert_early=True), want)
    ids[:, -1] = 0
    early = moe_gemv_experts(x, ids, w, gu, dn, shared_expert_early=True)
    plain = moe_gemv_experts(x, ids, w, gu, dn)
    assert torch.equal(early[:, :-1], plain[:, :-1]) and not torch.equal(early[:, -1], plain[:, -1])


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("early", [False, True], ids=["once", "once_early"])
@pytest.mark.parametrize("t,k,e,hidden,inter", [(2, 9, 12, 80, 40), (3, 3, 5, 272, 16), (4, 4, 6, 64, 24)])
def test_interpreted_shared_expert_once_is_the_same(t, k, e, hidden, inter, early, dtype) -> None:
    """``shared_expert_once``: the shared expert's programs take every token's row (the 3-token
    case pads to 4): bitwise the per-pair result. That both kernels took it as expert E - 1 for
    all tokens at once: with another id in that column the result is still the right one."""
    x, ids, w, gu, dn = _problem(t, k, e, hidden, inter, dtype, seed=t)
    ids[:, -1] = e - 1
    want = moe_gemv_experts(x, ids, w, gu, dn)
    flags = dict(shared_expert_once=True, shared_expert_early=early)
    assert torch.equal(moe_gemv_experts(x, ids, w, gu, dn, **flags), want)
    ids[:, -1] = 0
    assert torch.equal(moe_gemv_experts(x, ids, w, gu, dn, **flags), want)
    assert not torch.equal(moe_gemv_experts(x, ids, w, gu, dn), want)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("early", [False, True], ids=["one_launch", "one_launch_early"])
@pytest.mark.parametrize("t,k,e,hidden,inter", [(1, 9, 12, 80, 40), (3, 3, 5, 272, 16), (4, 4, 6, 64, 24)])
def test_interpreted_one_launch_is_the_same(t, k, e, hidden, inter, early, dtype) -> None:
    """``one_launch`` (kernels/moe_one_launch.py): bitwise the two kernels' pairs, three calls in a
    row (the last program re-arms the ticket and the counters: a stale ticket would give other
    tiles). With the shared expert early both of its phases take it as expert E - 1: another id
    in its column changes nothing; without, the column is read."""
    x, ids, w, gu, dn = _problem(t, k, e, hidden, inter, dtype, seed=t)
    ids[:, -1] = e - 1
    want = moe_gemv_experts(x, ids, w, gu, dn)
    for _ in range(3):
        assert torch.equal(moe_gemv_experts(x, ids, w, gu, dn, one_launch=True, shared_expert_early=early), want)
    ids[:, -1] = 0
    got = moe_gemv_experts(x, ids, w, gu, dn, one_launch=True, shared_expert_early=early)
    assert torch.equal(got, want) == early
    assert torch.equal(got, moe_gemv_experts(x, ids, w, gu, dn, shared_expert_early=early)) != early


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
    for flag in ("shared_expert_early", "shared_expert_once"):
        with pytest.raises(ValueError, match="need k >= 2"):
            moe_gemv_experts(x, ids[:, :1], w[:, :1], gu, dn, **{flag: True})


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


def _compile_sm90(which: int, pdl: bool, shared_id: int = -1, early: bool = False, t_rows: int = 0,
                  once_rows: int = 0, spills: bool = False):
    """PTX of the gate_up (0) or down (1) kernel at XS-2.1 shapes, bf16, for sm_90 (offline);
    ``shared_id`` / ``early`` / ``t_rows`` / ``once_rows``: the shared-expert constexprs
    (moe_gemv_experts' shared_expert_early / shared_expert_once); ``spills``: (PTX, ptxas's
    spill-store bytes) instead."""
    from laguna_dflash.kernels import moe_gemv

    kernel = moe_gemv._kernels(False)[which]
    bn, bk, nw = (moe_gemv.GATE_UP_CONFIG, moe_gemv.DOWN_CONFIG)[which]
    h, inter = 2048, 512
    if which == 0:
        pointers = {"x_ptr": "*bf16", "w_ptr": "*bf16", "ids_ptr": "*i64", "h_ptr": "*bf16"}
        constexprs = dict(H=h, INTER=inter, K_ITERS=-(-h // bk), EARLY=early)
    else:
        pointers = {"h_ptr": "*bf16", "w_ptr": "*bf16", "ids_ptr": "*i64", "rw_ptr": "*bf16", "out_ptr": "*bf16"}
        constexprs = dict(H=h, INTER=inter, K_ITERS=-(-inter // bk))
    constexprs.update(BLOCK_N=bn, BLOCK_K=bk, OUT_DTYPE=1, PDL=pdl, K_TOP=9, SHARED_ID=shared_id,
                      T_ROWS=t_rows, ONCE_ROWS=once_rows)
    compile_fn = compile_sm90_spills if spills else compile_sm90
    return compile_fn(kernel, pointers, constexprs, {"num_warps": nw, "launch_pdl": pdl})


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


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
def test_sm90_shared_expert_early_order() -> None:
    """With SHARED_ID (kernels/pdl.py rules): two waits in the code, one on each branch (each
    program executes one); the early branch's x loads go through L2 (.cg); the launch of the
    dependents after both; the default build keeps one wait (test above)."""
    ptx = _compile_sm90(0, True, shared_id=256, early=True)
    assert ptx.count("griddepcontrol.wait") == 2
    assert ptx.count("griddepcontrol.launch_dependents") == 1
    last_wait = ptx.rindex("griddepcontrol.wait")
    assert ptx.index("griddepcontrol.launch_dependents") > last_wait
    first_wait = ptx.index("griddepcontrol.wait")
    assert "ld.global.cg" in ptx  # the early branch's x
    # the ids are read on the routed branch only, after its wait
    loads = [line for line in ptx.splitlines() if "ld.global" in line and ".b64" in line]
    assert loads and all(ptx.index(line) > first_wait for line in loads), loads


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
@pytest.mark.parametrize("t_rows,once_rows", [(2, 2), (3, 4), (4, 4)])
def test_sm90_shared_expert_once_builds(t_rows, once_rows) -> None:
    """The once builds of both kernels at XS-2.1 shapes: no spills, one wait each, gate_up reads
    nothing before it (down: its expert id through L2 and weight tiles, as the default)."""
    for which in (0, 1):
        ptx, spills = _compile_sm90(which, True, shared_id=256, t_rows=t_rows, once_rows=once_rows,
                                    spills=True)
        assert spills and max(spills) == 0, spills
        early = loads_before_pdl_wait(ptx)
        if which == 0:
            assert early == []
        else:
            assert all(".cg" in line or "evict_first" in line for line in early), early


@cuda
@pytest.mark.parametrize("switch", ["shared_expert_before_routing", "shared_expert_once",
                                    "moe_gemv_one_launch", "moe_gemv_one_launch+shared_expert_before_routing"])
def test_cuda_shared_expert_switches_are_the_same(switch, monkeypatch) -> None:
    """``MoE.shared_expert_before_routing`` / ``MoE.shared_expert_once`` in a PDL-chained CUDA
    graph (the fused router then the GEMV experts): bitwise the default's output over 20 replays
    with new inputs at 1 and 4 tokens, eager too."""
    from laguna_dflash.models.layers import MoE

    torch.manual_seed(0)
    moe = MoE(2048, 256, 8, 512, 512).to("cuda", torch.bfloat16).eval()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    moe.fold_shared_expert()
    for t in (1, 4):
        x = torch.randn(t, 2048, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            graphs = {}
            for on in (False, True):
                for name in switch.split("+"):
                    monkeypatch.setattr(MoE, name, on)
                moe(x)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    # the input's producer inside the graph too, right before the router
                    out = moe(x * 1.0)
                graphs[on] = (graph, out)
            for _ in range(20):
                x.copy_(torch.randn_like(x))
                for on in (False, True):
                    graphs[on][0].replay()
                torch.cuda.synchronize()
                assert torch.equal(graphs[True][1], graphs[False][1])
            for name in switch.split("+"):
                monkeypatch.setattr(MoE, name, True)
            assert torch.equal(moe(x), graphs[False][1])


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("num_warps", [4, 8])
def test_sm90_one_launch_builds(t, early, num_warps) -> None:
    """kernels/moe_one_launch.py at XS-2.1 shapes for sm_90: no spills; the gate_up tiles
    release their pair's counter and the down tiles acquire it (gpu scope), read h through L2;
    with PDL a wait on every path (one shared by both branches without the early shared
    expert, three with it), none without."""
    from laguna_dflash.kernels import moe_gemv, moe_one_launch

    (bn1, bk1, _), (bn2, bk2, _) = moe_gemv.GATE_UP_CONFIG, moe_gemv.DOWN_CONFIG
    types = {n: "*bf16" for n in ("x_ptr", "gu_ptr", "dn_ptr", "rw_ptr", "h_ptr", "out_ptr")}
    types.update(ids_ptr="*i64", sync_ptr="*i32")
    for pdl in (False, True):
        constexprs = dict(T=t, K_TOP=9, H=2048, INTER=512, BN1=bn1, BK1=bk1, KI1=2048 // bk1, BN2=bn2,
                          BK2=bk2, KI2=512 // bk2, OUT_DTYPE=1, PDL=pdl, SHARED_ID=256 if early else -1,
                          PAIRS_PAD=16 if t == 1 else 64)
        ptx, spills = compile_sm90_spills(moe_one_launch._kernel(False), types, constexprs,
                                          {"num_warps": num_warps, "launch_pdl": pdl})
        assert spills and max(spills) == 0, spills
        # the spin's atomic_add(0, acquire) compiles to a load-acquire (no atomic traffic)
        assert "atom.global.gpu.release.add" in ptx and "ld.global.gpu.acquire" in ptx
        assert "ld.global.cg" in ptx
        assert ptx.count("griddepcontrol.wait") == ((3 if early else 1) if pdl else 0)


@cuda
@pytest.mark.parametrize("num_warps", [4, 8])
def test_cuda_one_launch_equals_the_two_kernels(num_warps, monkeypatch) -> None:
    """kernels/moe_one_launch.py at XS-2.1 shapes (1 and 4 tokens, the shared expert early or
    not, 4 or 8 warps): bitwise the two kernels, five calls in a row."""
    from laguna_dflash.kernels import moe_one_launch

    monkeypatch.setattr(moe_one_launch, "NUM_WARPS", num_warps)
    for t in (1, 4):
        x, ids, w, gu, dn = _problem(t, 9, 257, 2048, 512, torch.bfloat16, seed=5, device="cuda")
        ids[:, -1] = 256
        want = moe_gemv_experts(x, ids, w, gu, dn)
        for early in (False, True):
            for _ in range(5):
                got = moe_gemv_experts(x, ids, w, gu, dn, one_launch=True, shared_expert_early=early)
                assert torch.equal(got, want), (t, early)
