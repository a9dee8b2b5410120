"""``benchmarks/bench_read_roofline.py``: its streaming-read kernel reads every byte once (the
sum it returns is checked per program) at several tile and program counts, under the CPU
interpreter; the timing itself needs a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from interpreter_child import HAS_TRITON, INTERPRETED, interpreted, run_interpreted_child

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


@interpreted
@pytest.mark.parametrize("programs,loads,num_warps", [(4, 1, 1), (3, 2, 1), (2, 4, 2)])
def test_interpreted_read_kernel_sums_each_programs_chunk(programs: int, loads: int, num_warps: int) -> None:
    import bench_read_roofline as rr

    tile = num_warps * 32 * loads * 8
    per_prog = 3 * tile
    src = torch.arange(programs * per_prog, dtype=torch.float32).remainder(7).to(torch.bfloat16)
    out = torch.empty(programs, dtype=torch.float32)
    rr.read_all(src, out, programs, loads, num_warps)
    want = src.float().view(programs, per_prog).sum(dim=1)
    torch.testing.assert_close(out, want, rtol=0, atol=0)  # small integers: exact in fp32


@interpreted
def test_interpreted_cell_reports_the_bytes_it_read() -> None:
    import bench_read_roofline as rr

    nbytes, us = rr.cell(1 << 16, 4, 1, 1, "cpu")
    assert nbytes == 4 * 8192 * 2 and us != us  # no timing on the CPU (NaN)


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs triton (runs its own interpreter child)")
def test_read_kernel_under_the_interpreter() -> None:
    run_interpreted_child(__file__)
