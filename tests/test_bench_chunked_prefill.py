"""benchmarks/bench_chunked_prefill.py on the CPU (2 layers, narrow): every row prints, the
running request gets tokens between the chunks (none during a whole-prompt prefill), and the
long prompt's first tokens are the unchunked ones (times: docs/PERFORMANCE.md)."""

from __future__ import annotations

from cpu_bench import run_cpu_bench, table_rows


def test_bench_chunked_prefill_rows():
    out = run_cpu_bench("bench_chunked_prefill.py", "--context", "256", "--chunks", "64", "--rounds", "1")
    rows = {r[0]: r[1:] for r in table_rows(out)}
    assert rows["whole prompt (no chunking)"][1] == "0"
    assert int(rows["chunks of 64"][1]) >= 3  # a decode step between each of the 4 chunks
    assert all(r[3] == "True" for name, r in rows.items() if name != "prefill")
