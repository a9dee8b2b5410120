"""benchmarks/bench_sampled_decode.py: the CPU wiring run prints a row per batch size and engine
setup with a positive rate per mode and ratios that follow from the rates; a bad ``--modes``
value is an error naming the flag and the valid modes."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_sampled_decode  # noqa: E402
from cpu_bench import printed_ratio_tolerance  # noqa: E402

ARGS = ["--device", "cpu", "--layers", "2", "--hidden", "256", "--context", "16",
        "--new-tokens", "6", "--batches", "1,2", "--rounds", "1"]


def test_cpu_wiring_prints_every_row(capsys) -> None:
    bench_sampled_decode.main(ARGS + ["--modes", "greedy,seeded", "--k", "3", "--sim-length", "2.5"])
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| ")]
    assert rows[0] == ["batch", "decode", "greedy tok/s", "seeded tok/s (x greedy)"]
    body = rows[1:]
    assert [(r[0], r[1]) for r in body] == [(b, setup) for b in ("1", "2")
                                            for setup in ("target-only", "DFlash K=3 L=2.5")]
    for r in body:
        greedy = float(r[2])
        rate, ratio = (float(x) for x in re.fullmatch(r"([0-9.]+) \(([0-9.]+)x\)", r[3]).groups())
        assert greedy > 0 and rate > 0
        # all three figures are rounded when printed (rates to 0.1, the ratio to 0.01)
        assert abs(ratio - rate / greedy) <= printed_ratio_tolerance(rate, greedy, 0.1, 0.1, 0.01)


def test_greedy_is_always_timed_and_modes_keep_table_order() -> None:
    args = bench_sampled_decode.parse_args(ARGS + ["--modes", "top-p,temp"])
    assert args.modes == ["greedy", "temp", "top-p"]
    assert bench_sampled_decode.parse_args(ARGS).modes == ["greedy", "temp", "top-p", "seeded"]


def test_seeded_requests_get_distinct_seeds() -> None:
    params = bench_sampled_decode.mode_params("seeded", 4, 10)
    assert [p.seed for p in params] == [0, 1, 2, 3]
    assert all(p.temperature == 0.7 and p.top_p == 0.95 and p.max_tokens == 10 for p in params)
    assert all(p.is_greedy for p in bench_sampled_decode.mode_params("greedy", 2, 10))


@pytest.mark.parametrize("flags, named", [
    (["--modes", "greedy,nucleus"], "--modes"),
    (["--batches", "1,x"], "--batches"),
    (["--k", "3", "--sim-length", "5"], "--sim-length"),
])
def test_a_bad_value_names_the_flag(capsys, flags, named) -> None:
    with pytest.raises(SystemExit) as exited:
        bench_sampled_decode.parse_args(ARGS + flags)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {named}" in err
    if named == "--modes":
        assert "'nucleus'" in err and "greedy, temp, top-p, seeded" in err


def test_a_switch_times_each_sampled_mode_again_with_it_set(capsys, monkeypatch) -> None:
    # --switch: each sampled mode gets a column of its own, timed with the switch set (and only
    # then: greedy and the plain columns run with the default), restored after the run
    import laguna_dflash.engine.sampler as sampler
    seen = []
    real = bench_sampled_decode.decode_rate

    def spy(llm, prompts, params):
        seen.append((params[0].is_greedy, params[0].seed is not None, sampler.sort_narrow_keys))
        return real(llm, prompts, params)

    monkeypatch.setattr(bench_sampled_decode, "decode_rate", spy)
    bench_sampled_decode.main(ARGS + ["--batches", "1", "--modes", "seeded",
                                      "--switch", "laguna_dflash.engine.sampler:sort_narrow_keys=False"])
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| batch"))
    assert [c.strip() for c in header.strip("|").split("|")][2:] == [
        "greedy tok/s", "seeded tok/s (x greedy)", "seeded (sort_narrow_keys=False) tok/s (x greedy)"]
    # two rounds (warm-up and one timed) x two setups x three columns; the switch only in its own
    assert sorted(set(seen)) == [(False, True, False), (False, True, True), (True, False, True)]
    assert len(seen) == 12 and sum(not on for *_, on in seen) == 4
    assert sampler.sort_narrow_keys is True


def test_a_bad_switch_names_the_flag(capsys) -> None:
    with pytest.raises(SystemExit):
        bench_sampled_decode.parse_args(ARGS + ["--switch", "laguna_dflash.engine.sampler:no_such=1"])
    assert "argument --switch" in capsys.readouterr().err
