"""benchmarks/bench_prefill.py on the CPU (2 layers, narrow): a row per mode and case, the padded
("graphs") prefills give the eager first token, and a prefill past the largest graph bucket runs
eagerly in both modes (the times are the GPU's: docs/PERFORMANCE.md)."""

from __future__ import annotations

from cpu_bench import run_cpu_bench, table_rows


def test_bench_prefill_prints_both_modes():
    out = run_cpu_bench("bench_prefill.py", "--new", "8,40", "--prefix", "0,32", "--rounds", "1",
                        "--max-prefill-graph-tokens", "32")  # 40 tokens: eager in both modes
    rows = [r for r in table_rows(out) if r[0] != "prefill"]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (mode, p, n) for mode in ("eager", "graphs") for p in ("0", "32") for n in ("8", "40")]
    assert all(r[-1] == "True" for r in rows)
    assert all(r[4] == "1.00" for r in rows if r[0] == "eager")
    assert "graph buckets (8, 16, 32)" in out
