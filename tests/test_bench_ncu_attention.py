"""benchmarks/ncu_attention.py: the ncu raw-CSV report (the workload itself runs on the GPU)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from interpreter_child import run_interpreted_script

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import ncu_attention as ncu  # noqa: E402

STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
# as ncu --page raw --csv --print-units base writes it: program output first, a header, a units
# row, then one row a kernel (thousands separators in quoted numbers)
RAW = "\n".join([
    "==PROF== Connected to process 7 (python)",
    '"ID","Process ID","Kernel Name","gpu__time_duration.sum","launch__registers_per_thread",'
    '"smsp__inst_executed.sum","' + STALL.format("long_scoreboard") + '","' + STALL.format("barrier")
    + '","' + STALL.format("wait") + '"',
    '"","","","nsecond","register/thread","inst","ratio","ratio","ratio"',
    '"0","7","_paged_attention_kernel(ptr, ptr)","10,000","190","2,000","3.5","0.5","1.0"',
    '"1","7","_merge_splits_kernel","2,000","40","500","0.2","0.1","0.9"',
    '"2","7","_paged_attention_kernel(ptr, ptr)","12,000","190","2,200","4.5","0.7","1.0"',
])


def test_report_averages_each_kernel_and_orders_its_stalls():
    rows = ncu.parse_raw_csv(RAW)
    assert [r["ID"] for r in rows] == ["0", "1", "2"]  # the units row and the log lines dropped
    attn, merge = ncu.summarize("q4_sliding", rows, top=2)
    assert attn.startswith("| q4_sliding | `_paged_attention_kernel` | 2 | 11.00 | 190 |")
    assert "| 2.1 |" in attn  # thousand instructions, mean of 2,000 and 2,200
    assert attn.endswith("| long_scoreboard 4.00, wait 1.00 |")  # largest two, barrier dropped
    assert merge.startswith("| q4_sliding | `_merge_splits_kernel` | 1 | 2.00 | 40 |")
    assert merge.endswith("| wait 0.90, long_scoreboard 0.20 |")


def test_report_splits_a_kernel_by_grid_and_gives_its_dram_rate():
    header = ('"ID","Kernel Name","gpu__time_duration.sum","launch__grid_size","dram__bytes_read.sum"\n'
              '"","","nsecond","","byte"\n')
    rows = ncu.parse_raw_csv(header + '"0","_skinny(ptr)","10,000","644","42,000,000"\n'
                             '"1","_skinny(ptr)","2,000","16","1,000,000"\n'
                             '"2","_skinny(ptr)","12,000","644","42,000,000"\n')
    big, small = ncu.summarize("decode", rows)
    assert big.startswith("| decode | `_skinny [644]` | 2 | 11.00 |")
    assert "| 3.82 |" in big  # 42 MB in 11 us
    assert small.startswith("| decode | `_skinny [16]` | 1 | 2.00 |")
    assert "| 0.50 |" in small


def test_report_rejects_input_that_is_not_ncu_raw_csv(tmp_path):
    with pytest.raises(ValueError, match="--page raw --csv"):
        ncu.parse_raw_csv("Kernel,us\nx,1\n")
    empty = tmp_path / "empty.csv"
    empty.write_text(RAW.split("\n")[1] + "\n" + RAW.split("\n")[2] + "\n")
    with pytest.raises(SystemExit, match="profiled no kernel"):
        ncu.report([str(empty)])


def test_metrics_list_asks_for_duration_and_every_stall_reason(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["ncu_attention.py", "metrics"])
    ncu.main()
    metrics = capsys.readouterr().out.strip().split(",")
    assert "gpu__time_duration.sum" in metrics
    assert any(m.startswith("regex:smsp__average_warps_issue_stalled_") for m in metrics)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="needs triton (the workload runs under its CPU interpreter here)")
def test_workload_runs_under_the_interpreter():
    """``run`` (what ncu profiles) at a small context, on the CPU under TRITON_INTERPRET=1."""

    script = Path(ncu.__file__)
    for shape in ("sliding", "full"):
        proc = run_interpreted_script(script, "run", "--q", "4", "--shape", shape, "--device", "cpu",
                                      "--context", "64", "--calls", "1")
        assert proc.returncode == 0, proc.stderr[-3000:]
