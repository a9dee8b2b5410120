"""``benchmarks/bench_persistent_moe.py``: the persistent MoE-half kernel computes the engine's five
steps (its phases, one launch each, under the interpreter, against the torch reference) and its
sm_90 build is what the docstring says (three grid barriers of one acq_rel arrival and acquire
spins, one PDL wait with only o_proj's weight loaded before it, the known weights loaded before
the barriers, no spills)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from interpreter_child import HAS_TRITON, INTERPRETED, interpreted, run_interpreted_child
from ptx_sm90 import can_compile_sm90, compile_sm90, loads_before_pdl_wait, ptxas_spills

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_persistent_moe as bench  # noqa: E402

SMALL = bench.Shapes(a=512, h=128, e=32, inter=64, top_k=4)


def test_interpreter_child() -> None:
    if INTERPRETED or not HAS_TRITON:
        pytest.skip("this is the parent: needs triton, and not already interpreted")
    run_interpreted_child(__file__)


@interpreted
@pytest.mark.parametrize("programs", [4, 12])
def test_interpreted_phases_equal_the_reference(programs: int) -> None:
    # 4 programs: every phase walks several items a program; 12 > I / GU_BN = 8: programs whose
    # first gate_up item is a routed expert's (not the shared one loaded before the barrier)
    w = bench.Weights(SMALL, "cpu", seed=1)
    tiles = bench.Tiles(g=programs, o_bn=16, o_bk=128, gu_bn=8, d_bn=16, num_warps=4)
    res, pairs = bench.PersistentMoEHalf(w, tiles, split=True, pdl=False)()
    want_res, want_pairs, want_ids = bench.reference(w)
    assert want_ids[-1] == SMALL.e and len(set(want_ids.tolist())) == SMALL.top_k + 1
    assert torch.equal(res, want_res)
    ulp = want_pairs.float().abs().clamp_min(2.0**-20) * 2.0**-7
    assert ((pairs.float() - want_pairs.float()).abs() / ulp).max() <= 1.0
    assert pairs.abs().amin(dim=1).gt(0).any() and torch.isfinite(pairs.float()).all()


def _build(phase: int) -> str:
    meta = bench.launch_meta(bench.Shapes(), bench.Tiles(), pdl=True)
    num_warps = meta.pop("num_warps")
    types = {name: "*bf16" for name in ("xa_ptr", "res_ptr", "wo_ptr", "nw_ptr", "wr_ptr", "wgu_ptr",
                                         "wd_ptr", "o_ptr", "act_ptr", "res_out_ptr", "pairs_ptr")}
    types.update(bias_ptr="*fp32", logit_ptr="*fp32", count_ptr="*i32", err_ptr="*i32", eps="fp32",
                 scale="fp32")
    return compile_sm90(bench._kernel(), types, dict(meta, PHASE=phase),
                        {"num_warps": num_warps, "launch_pdl": True})


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
def test_sm90_persistent_build() -> None:
    ptx = _build(-1)
    assert ptxas_spills(ptx) == [0]
    # before the PDL wait: only o_proj's first weight tile (8 loads of 16 bytes a thread)
    before = loads_before_pdl_wait(ptx)
    assert len(before) == 8 and all("evict_first" in line for line in before), before
    arrivals = [m.start() for m in re.finditer(r"atom\.global\.gpu\.acq_rel\.add", ptx)]
    assert len(arrivals) == 3 and ptx.count("ld.global.gpu.acquire") == 3
    # the dependents launch after the last barrier, while down streams
    assert arrivals[-1] < ptx.index("griddepcontrol.launch_dependents")
    # weights known early are loaded before the barrier that precedes their use: the router rows
    # and the shared expert's gate_up block before the first, the first down tile before the last
    first = ptx[ptx.index("griddepcontrol.wait"):arrivals[0]]
    num_weight_loads = sum("ld.global" in line and "evict_first" in line for line in first.splitlines())
    assert num_weight_loads == 8 + 2 + 8, num_weight_loads  # o_proj's next tile, router, shared
    last = ptx[arrivals[1]:arrivals[2]]
    weight_loads = sum("ld.global" in line and "evict_first" in line for line in last.splitlines())
    assert weight_loads == 8 + 4, weight_loads  # gate_up's next item (the loop), one down tile


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
@pytest.mark.parametrize("phase", [0, 1, 2, 3])
def test_sm90_split_phases_are_pdl_launches(phase: int) -> None:
    ptx = _build(phase)
    loads_before_pdl_wait(ptx)  # one wait, the dependents launched after it
    assert "atom" not in ptx and "globaltimer" not in ptx
