"""``benchmarks/bench_parked_gemv.py``: what can be checked without a GPU.

The persistent parked GEMV covers every weight row exactly once, fits a program's shared memory,
and its sm_90 build issues the parked items' loads (plus four ahead) before the acquire spin on
the flag, the rest after, with no spills; the main-stream kernel writes x before it releases the
flag.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from interpreter_child import HAS_TRITON, INTERPRETED
from ptx_sm90 import can_compile_sm90, compile_gluon_sm90, compile_sm90, ptxas_spills

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

_TYPES = {"w_ptr": "*bf16", "x_ptr": "*bf16", "y_ptr": "*bf16", "flag_ptr": "*i32", "epoch_ptr": "*i32",
          "err_ptr": "*i32", "n": "i32", "timeout_ns": "i64"}


@pytest.mark.skipif(not HAS_TRITON, reason="the script imports triton")
@pytest.mark.parametrize("n,k,sms", [(10304, 2048, 132), (7680, 2048, 132), (1000, 1024, 7), (64, 512, 132)])
def test_every_row_block_is_covered_once_and_fits(n, k, sms):
    import bench_parked_gemv as bench

    for cfg in bench.CONFIGS:
        plan = bench.parked_plan(n, k, cfg, sms)
        row_blocks = [p + (i // plan["NUM_K"]) * plan["GRID"]
                      for p in range(plan["GRID"]) for i in range(0, plan["ITEMS"], plan["NUM_K"])]
        real = [rb for rb in row_blocks if rb * cfg[0] < n]
        assert sorted(real) == list(range(-(-n // cfg[0])))
        assert plan["GRID"] <= sms and 1 <= plan["PARK"] <= plan["ITEMS"]
        smem = (plan["PARK"] * cfg[0] + plan["X_ROWS"]) * cfg[1] * 2
        assert smem <= bench._SMEM_BUDGET or plan["PARK"] == 1


@pytest.mark.skipif(not can_compile_sm90() or INTERPRETED, reason="needs triton's nvidia backend")
def test_parked_loads_come_before_the_spin_and_nothing_spills():
    import bench_parked_gemv as bench

    plan = bench.parked_plan(10304, 2048, bench.CONFIGS[0], 132)
    ptx = compile_gluon_sm90(bench.parked_kernel(), _TYPES, plan, {"num_warps": plan["num_warps"]})
    lines = ptx.splitlines()
    spin = [i for i, line in enumerate(lines) if "atom.global.gpu.acq" in line]
    loads = [i for i, line in enumerate(lines) if "evict_first" in line and "ld.global" in line]
    assert spin and loads
    per_item = len(loads) // plan["ITEMS"]
    assert per_item * plan["ITEMS"] == len(loads)
    assert sum(i < spin[0] for i in loads) == (plan["PARK"] + 4) * per_item
    assert ptxas_spills(ptx) == [0]


@pytest.mark.skipif(not can_compile_sm90() or INTERPRETED, reason="needs triton's nvidia backend")
def test_chain_kernel_writes_x_then_releases_the_flag():
    import bench_parked_gemv as bench

    kernel = bench._chain_kernels()[1]
    types = {"x_ptr": "*bf16", "src_ptr": "*bf16", "K": "i32", "ns": "i32", "flag_ptr": "*i32", "epoch_ptr": "*i32"}
    ptx = compile_sm90(kernel, types, {"BLOCK": 1024}, {"num_warps": 4, "launch_pdl": True})
    assert ptx.index("griddepcontrol.launch_dependents") < ptx.index("globaltimer") < ptx.index("st.global")
    release = ptx.index("atom.global.gpu.release.exch")
    assert ptx.rindex("st.global") < release
    assert ptx.rindex("bar.sync") < release
