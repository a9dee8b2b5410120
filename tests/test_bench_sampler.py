"""benchmarks/bench_sampler.py: the CPU wiring run times every part (sampling, penalties,
logprobs) against its per-request baseline, the greedy picks agree, the penalised rows of the
baseline and the batched code agree; bad flags are errors naming the flag."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_sampler  # noqa: E402


def test_cpu_wiring_times_every_part() -> None:
    args = bench_sampler.parse_args(["--device", "cpu", "--dtype", "float32", "--vocab", "512",
                                     "--batches", "1,3", "--rows", "1,2", "--iters", "1"])
    results = bench_sampler.run(args)
    parts = {r[0] for r in results}
    assert parts == {"sampling", "penalties", "logprobs"}
    assert len([r for r in results if r[0] == "sampling"]) == 2 * 2 * len(bench_sampler.MODES)
    for what, batch, rows, mode, loop_us, batched_us, same in results:
        assert loop_us > 0 and batched_us > 0
        if what == "penalties":
            assert same == batch  # every request's rows agree with the loop's
        if mode in ("greedy", "seeded"):  # the same argmax; seeded: the same draws, same probs
            assert same == batch * rows, (mode, batch, rows)


@pytest.mark.parametrize("flag, value", [("--what", "sorting"), ("--modes", "nucleus"), ("--rows", "0")])
def test_bad_flags_name_the_flag(flag, value, capsys) -> None:
    with pytest.raises(SystemExit):
        bench_sampler.parse_args([flag, value])
    assert flag in capsys.readouterr().err
