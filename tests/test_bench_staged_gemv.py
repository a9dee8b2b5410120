"""``benchmarks/bench_staged_gemv.py`` and ``benchmarks/carveout.py``: what can be checked without a GPU.

The busy kernel that emulates the latency-bound window compiles for sm_90 with the PDL order the
script's docstring gives (wait for the previous launch, signal the next one, spin on the global
timer, then write x), every staged config the script times fits the shapes it times, and the
carveout tool refuses a percentage outside [0, 100] before touching the driver.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from interpreter_child import HAS_TRITON, INTERPRETED
from ptx_sm90 import can_compile_sm90, compile_sm90

from laguna_dflash.kernels import staged_gemv as stg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


@pytest.mark.skipif(not can_compile_sm90() or INTERPRETED, reason="needs triton's nvidia backend")
def test_busy_kernel_signals_then_spins_then_writes_x():
    import bench_staged_gemv as bench

    ptx = compile_sm90(bench._busy_kernel(), {"x_ptr": "*bf16", "K": "i32", "ns": "i32"}, {"BLOCK": 1024},
                       {"num_warps": 4, "launch_pdl": True})
    wait, signal = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
    timer = ptx.index("globaltimer")
    assert wait < signal < timer < ptx.index("st.global")


@pytest.mark.skipif(not HAS_TRITON, reason="the script imports triton")
@pytest.mark.parametrize("k", [8192, 6144])
def test_every_timed_config_fits_the_timed_shapes(k):
    import bench_staged_gemv as bench

    for c in bench.CONFIGS:
        cfg = stg.StagedConfig(*c)
        assert k % cfg.stage_k == 0 and 2048 % cfg.block_n == 0
        assert bench.config_label(c).startswith("staged ")
        assert cfg.smem_bytes(k) <= stg._MAX_SMEM, (cfg, cfg.smem_bytes(k))


@pytest.mark.skipif(not HAS_TRITON, reason="the tool imports triton")
@pytest.mark.parametrize("percent", [-1, 101])
def test_carveout_refuses_a_bad_percentage(percent):
    import carveout

    with pytest.raises(ValueError, match="--carveout"):
        carveout.install(percent)
