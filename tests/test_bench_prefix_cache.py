"""benchmarks/bench_prefix_cache.py on the CPU (2 layers, narrow): every row prints, the cached
runs find the tokens they should (three of four prompts sent together wait for the first one's
prefix) and give the uncached first tokens (the times are the GPU's:
docs/PERFORMANCE.md)."""

from __future__ import annotations

from cpu_bench import run_cpu_bench, table_rows


def test_bench_prefix_cache_prints_every_row():
    out = run_cpu_bench("bench_prefix_cache.py", "--context", "64", "--suffix", "16", "--rounds", "1")
    rows = {r[0]: r[1:] for r in table_rows(out)}
    assert rows["same prompt again"][0] == "48"  # 64 tokens, blocks of 16, the last one computed
    assert rows["cached prefix + 16 new"][0] == "64"
    assert rows["batch 4, prefix cached"][0] == "256"
    assert rows["batch 4, cold"][0] == "192"  # three wait for the first one's prefix
    assert rows["batch 4, cold, side by side"][0] == "0"
    assert all(r[4] == "True" and r[3] == "-" for r in rows.values() if r[0] != "cached tokens")
