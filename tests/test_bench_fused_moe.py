"""``benchmarks/bench_fused_moe.py``'s tile sweeps, without a GPU: the timings are faked.

``gpu_check.sh pass67`` feeds the sweep's "best" line to ``profile_decode_xs.py`` as module
switches, so that line must name the fastest pair, in the switch syntax the profile parses, and
the sweep must leave the module's configs as it found them.
"""

from __future__ import annotations

import sys
from pathlib import Path

from laguna_dflash.kernels import moe_gemv

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def test_gemv_sweep_prints_the_fastest_pair_as_switches(monkeypatch, capsys):
    import bench_fused_moe as bench
    from bench_gpu_xs import parse_switch

    def fake_time(calls, reps):  # a unique minimum at gate_up (4, 512, 4), down (8, 512, 4)
        gate_up, down = moe_gemv.GATE_UP_CONFIG, moe_gemv.DOWN_CONFIG
        return 10.0 + abs(gate_up[0] - 4) + abs(down[0] - 8) + (down[1] != 512)

    monkeypatch.setattr(bench, "time_per_call", fake_time)
    monkeypatch.setattr(bench, "graphed", lambda f: f)
    before = (moe_gemv.GATE_UP_CONFIG, moe_gemv.DOWN_CONFIG)
    bench.sweep_gemv({"T": 4, "floor": 9.0}, [lambda: None], reps=1)
    assert (moe_gemv.GATE_UP_CONFIG, moe_gemv.DOWN_CONFIG) == before
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("T=4 gemv sweep") and "best 6 of 64" in lines[0]
    best = lines[1].removeprefix("T=4 gemv best: ").split()
    parsed = {name: value for _, name, value in map(parse_switch, best)}
    assert parsed == {"GATE_UP_CONFIG": [4, 512, 4], "DOWN_CONFIG": [8, 512, 4]}
