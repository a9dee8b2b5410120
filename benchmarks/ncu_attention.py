"""Why is the 4-token verify's attention ~10 us a layer against ~6 at decode? Stall reasons.

Every tile, split and warp variant of ``bench_paged_attention.py`` left the gap (docs/PERFORMANCE.md,
fifteenth pass). This reads the hardware counters with Nsight Compute instead: for each of the XS
shapes (sliding: 64 heads, window 512; full: 48 heads) at 1 and 4 query tokens, the attention and
split-merge kernels' duration, registers, achieved occupancy, DRAM / L2 bytes, instructions, and
the warp stall reasons (warps stalled per issued instruction, largest first).

    # on the device (ncu reads counters on Firecracker machines, not under gVisor; see the device
    # notes), one profiled run per cell, then the table:
    bash benchmarks/gpu_check.sh ncu-attn
    # by hand:
    ncu --clock-control none --cache-control none --nvtx --nvtx-include "measure/" --page raw \\
        --csv --print-units base --metrics "$(python benchmarks/ncu_attention.py metrics)" \\
        python benchmarks/ncu_attention.py run --q 4 --shape sliding > q4_sliding.csv
    python benchmarks/ncu_attention.py report q4_sliding.csv [more.csv ...]

``run`` warms up (compiles, and touches every layer's cache once) outside the NVTX range
``measure``, then calls attention ``--calls`` times inside it, each on another layer's K/V cache
as in the decode graph. Without ncu it simply runs (a wiring check).
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

# metrics read per kernel (``regex:`` selects every stall reason the GPU reports)
METRICS = (
    "gpu__time_duration.sum",
    "launch__registers_per_thread",
    "launch__grid_size",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "lts__t_bytes.sum",
    "smsp__inst_executed.sum",
    "smsp__average_warp_latency_per_inst_issued.ratio",
    r"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio",
)
SHAPES = {"sliding": (64, 512), "full": (48, None)}
_STALL_PREFIX = "smsp__average_warps_issue_stalled_"
_STALL_SUFFIX = "_per_issue_active.ratio"


def run(q_len: int, shape: str, calls: int, context: int, device: str) -> None:
    """The workload: ``calls`` attention calls (+ their merges) inside the NVTX range ``measure``."""
    import torch
    from bench_paged_attention import layer_inputs

    from laguna_dflash.kernels import paged_attention as pa

    heads, window = SHAPES[shape]
    layers = layer_inputs(calls + 1, context, q_len, heads, device)
    kw = dict(scale=128 ** -0.5, causal=True, sliding_window=window)
    for x in layers:  # compile, touch every cache once
        pa.paged_attention(**x, **kw)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("measure")
    for x in layers[1:]:
        pa.paged_attention(**x, **kw)
    if device.startswith("cuda"):
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def parse_raw_csv(text: str) -> list[dict[str, str]]:
    """Rows of ``ncu --page raw --csv`` (header row, then a units row, then one row a kernel);
    any lines ncu or the program printed before the header are skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu raw CSV header (a line starting with \"ID\") in the input: was it "
                         "written by ncu --page raw --csv?")
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    return [r for r in rows if _number(r.get("ID", "")) is not None]  # drop the units row


def _short_name(kernel: str) -> str:
    return kernel.split("(")[0].strip()


def summarize(label: str, rows: list[dict[str, str]], top: int = 5) -> list[str]:
    """Markdown rows: per kernel name (and grid size, where ncu gave it), the mean of each metric
    over its calls, and its ``top`` stall reasons (warps stalled per issued instruction)."""
    by_kernel: dict[str, list[dict[str, str]]] = {}
    for row in rows:  # one kernel at several grids (a GEMV of several shapes): one row per grid
        grid = row.get("launch__grid_size", "")
        name = _short_name(row["Kernel Name"]) + (f" [{grid}]" if grid else "")
        by_kernel.setdefault(name, []).append(row)
    out = []
    for name, group in by_kernel.items():
        def mean(metric: str, group=group) -> float:
            values = [v for v in (_number(r.get(metric, "")) for r in group) if v is not None]
            return sum(values) / len(values) if values else float("nan")

        stalls = sorted(((mean(k), k[len(_STALL_PREFIX):-len(_STALL_SUFFIX)]) for k in group[0]
                         if k.startswith(_STALL_PREFIX) and k.endswith(_STALL_SUFFIX)), reverse=True)
        stall_text = ", ".join(f"{reason} {value:.2f}" for value, reason in stalls[:top] if value == value)
        out.append(
            f"| {label} | `{name}` | {len(group)} | {mean('gpu__time_duration.sum') / 1e3:.2f} | "
            f"{mean('launch__registers_per_thread'):.0f} | "
            f"{mean('sm__warps_active.avg.pct_of_peak_sustained_active'):.1f} | "
            f"{mean('dram__bytes_read.sum') / 1e6:.2f} / {mean('dram__bytes_write.sum') / 1e6:.2f} | "
            f"{mean('dram__bytes_read.sum') / mean('gpu__time_duration.sum') / 1e3:.2f} | "
            f"{mean('lts__t_bytes.sum') / 1e6:.2f} | {mean('smsp__inst_executed.sum') / 1e3:.1f} | "
            f"{mean('smsp__average_warp_latency_per_inst_issued.ratio'):.1f} | {stall_text} |")
    return out


HEADER = ("| cell | kernel | calls | us | regs | occupancy % | DRAM MB read / written | "
          "DRAM read TB/s | L2 MB | k instr | cycles / issue | top stalls (warps per issue) |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")


def report(paths: list[str]) -> None:
    print(HEADER)
    for path in paths:
        rows = parse_raw_csv(Path(path).read_text(errors="replace"))
        if not rows:
            raise SystemExit(f"{path}: ncu profiled no kernel (is the NVTX range 'measure' in the run, "
                             "and were --nvtx --nvtx-include 'measure/' given?)")
        print("\n".join(summarize(Path(path).stem, rows)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the profiled workload")
    r.add_argument("--q", type=int, default=4, help="query tokens of the request")
    r.add_argument("--shape", choices=sorted(SHAPES), default="sliding")
    r.add_argument("--calls", type=int, default=4)
    r.add_argument("--context", type=int, default=1024)
    r.add_argument("--device", default="cuda")
    p = sub.add_parser("report", help="the table from ncu raw CSV files")
    p.add_argument("paths", nargs="+")
    sub.add_parser("metrics", help="the --metrics argument for ncu")
    args = ap.parse_args()
    if args.cmd == "run":
        run(args.q, args.shape, args.calls, args.context, args.device)
    elif args.cmd == "report":
        report(args.paths)
    else:
        print(",".join(METRICS))


if __name__ == "__main__":
    main()
