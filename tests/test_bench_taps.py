"""benchmarks/bench_taps.py: the rebuilt previous ``run_layers`` (an add kernel per tap) computes
what today's does, so its A/B times two forms of one computation, and the CPU wiring run prints
every row of its table."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_taps  # noqa: E402
from cpu_bench import printed_ratio_tolerance  # noqa: E402

from laguna_dflash import LLM  # noqa: E402
from laguna_dflash.engine.runner import ForwardItem  # noqa: E402
from laguna_dflash.models import decoder  # noqa: E402
from laguna_dflash.models.random_init import write_random_pair  # noqa: E402


def test_add_per_tap_computes_what_run_layers_computes(tmp_path, monkeypatch) -> None:
    target, _ = write_random_pair(tmp_path, seed=3)
    engine = LLM(model=str(target)).engine
    prompt = list(range(5, 17))
    n, num_layers = len(prompt), len(engine.target.layers)
    wanted = tuple(range(num_layers))
    blocks = engine.allocator.allocate(engine.allocator.blocks_needed(n, 0))
    try:
        outs = {}
        for name, impl in bench_taps.IMPLEMENTATIONS.items():
            monkeypatch.setattr(decoder, "run_layers", impl)
            outs[name] = engine.runner.forward(prompt, [ForwardItem(n, 0, n, blocks)], wanted)
    finally:
        engine.allocator.free(blocks)
    (new_hidden, new_taps), (old_hidden, old_taps) = outs.values()
    assert new_taps.shape == (n, num_layers * engine.target.spec.hidden_size)
    # the same sums in the same order: equal up to the fused kernels' rounding
    torch.testing.assert_close(new_taps, old_taps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_hidden, old_hidden, rtol=1e-5, atol=1e-5)


def test_cpu_wiring_prints_every_row(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_taps.py", "--device", "cpu", "--layers", "2", "--hidden", "256",
                                      "--context", "32", "--new-tokens", "3", "--rounds", "1",
                                      "--batches", "1,2"])
    bench_taps.main()
    assert decoder.run_layers is bench_taps.IMPLEMENTATIONS["next norm's sum"]  # restored
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| decode", "| prefill"))]
    assert len(rows) == 2 * (1 + 2)  # two implementations x (the decode step + two prefill batches)
    for row in rows:
        target_only, loaded, ratio = (float(c) for c in row.strip("|").split("|")[3:])
        # times printed to 0.001 ms, the ratio to 0.001
        tolerance = printed_ratio_tolerance(loaded, target_only, 0.001, 0.001, 0.001)
        assert target_only > 0 and loaded > 0 and abs(ratio - loaded / target_only) <= tolerance
