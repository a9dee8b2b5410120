"""benchmarks/ncu_kernel_table.py: an ncu raw CSV export grouped by kernel, means scaled."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from ncu_kernel_table import kernel_table  # noqa: E402

# the layout of a real `--page raw --csv --print-units base` export (H100, ncu 2025): ncu's own
# columns (some not numbers) around the metrics asked for, a units row, thousands separators
CSV = '''==PROF== Connected to process 1
"ID","Kernel Name","c2clink__present","dram__bytes_read.sum","gpu__time_duration.sum","launch__func_cache_config","lts__t_sector_hit_rate.pct"
"","","","byte","ns","","%"
"0","_gate_up_gemv_kernel","No-CC","37,748,736","12,000","CachePreferNone","10.5"
"1","_down_gemv_kernel","No-CC","18,874,368","7,000","CachePreferNone","4.5"
"2","_gate_up_gemv_kernel","No-CC","18,874,368","8,000","CachePreferNone","50.5"
'''.splitlines(keepends=True)


def test_rows_are_means_by_kernel_in_us_and_mb() -> None:
    rows = kernel_table(CSV)
    assert rows[0].startswith("| kernel | launches | dram__bytes_read.sum (MB)")
    assert "| _down_gemv_kernel | 1 | 18.87 | 7.00 | 4.50 |" in rows
    assert "| _gate_up_gemv_kernel | 2 | 28.31 | 10.00 | 30.50 |" in rows


def test_an_empty_report_says_so() -> None:
    assert kernel_table(["==PROF== nothing\n"]) == ["(no kernels in the report)"]


def test_a_report_without_a_units_row_keeps_its_first_kernel() -> None:
    rows = kernel_table([CSV[1]] + CSV[3:])
    assert "| _gate_up_gemv_kernel | 2 | 28.31 | 10.00 | 30.50 |" in rows


def test_only_the_metrics_named_are_averaged() -> None:
    rows = kernel_table(CSV, metrics=("gpu__time_duration.sum",))
    assert rows[0] == "| kernel | launches | gpu__time_duration.sum (us) |"
    assert "| _down_gemv_kernel | 1 | 7.00 |" in rows


def test_dram_throughput_is_averaged_when_exported() -> None:
    """``pass180`` also asks for the DRAM throughput (% of peak): averaged as it comes."""
    lines = [CSV[0], CSV[1].rstrip("\n") + ',"dram__throughput.avg.pct_of_peak_sustained_elapsed"\n',
             CSV[2].rstrip("\n") + ',"%"\n'] + [line.rstrip("\n") + f',"{pct}"\n'
                                               for line, pct in zip(CSV[3:], ("80.0", "70.0", "90.0"))]
    rows = kernel_table(lines)
    assert rows[0].endswith("| dram__throughput.avg.pct_of_peak_sustained_elapsed (value) |")
    assert "| _gate_up_gemv_kernel | 2 | 28.31 | 10.00 | 30.50 | 85.00 |" in rows
