"""Summarise an Nsight Compute ``--page raw --csv`` export by kernel: launches and the mean of
each metric (``gpu__time_duration.sum`` in us, ``dram__bytes_read.sum`` in MB, percentages as
they are). Used by ``gpu_check.sh pass128`` and ``pass180``.

    python benchmarks/ncu_kernel_table.py report.csv [--width 40]
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict

SCALES = {"gpu__time_duration.sum": ("us", 1e-3), "dram__bytes_read.sum": ("MB", 1e-6)}
# what gpu_check.sh asks ncu for; a raw export also holds ncu's own columns (device__*,
# launch__*, ...), some of them not numbers ('No-CC'), so only the metrics named are averaged
METRICS = ("dram__bytes_read.sum", "gpu__time_duration.sum", "lts__t_sector_hit_rate.pct",
           "dram__throughput.avg.pct_of_peak_sustained_elapsed")


def kernel_table(lines: list[str], width: int = 40, metrics: tuple[str, ...] = METRICS) -> list[str]:
    """Markdown rows ``| kernel | launches | metric means... |`` (header first) from the CSV
    lines ncu printed, for those of ``metrics`` the export holds (in its column order); lines
    before the CSV header (ncu's own log) are skipped."""
    rows = list(csv.DictReader(line for line in lines if line.startswith('"')))
    if not rows:
        return ["(no kernels in the report)"]
    metrics = [k for k in rows[0] if k in metrics]
    # ncu's first data row holds the units when it prints them (no kernel name there)
    data = rows[1:] if not rows[0].get("Kernel Name") else rows
    by: dict[str, list[dict]] = defaultdict(list)
    for row in data:
        by[row["Kernel Name"][:width]].append(row)
    header = ["kernel", "launches"] + [f"{m} ({SCALES.get(m, ('', 1))[0] or 'value'})" for m in metrics]
    out = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for name, group in sorted(by.items()):
        cells = [name, str(len(group))]
        for m in metrics:
            scale = SCALES.get(m, ("", 1.0))[1]
            cells.append(f"{sum(float(r[m].replace(',', '')) for r in group) / len(group) * scale:.2f}")
        out.append("| " + " | ".join(cells) + " |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report")
    ap.add_argument("--width", type=int, default=40, help="characters of the kernel name kept")
    ap.add_argument("--metrics", default=",".join(METRICS), help="comma-separated metric columns")
    args = ap.parse_args()
    with open(args.report) as f:
        print("\n".join(kernel_table(f.readlines(), args.width, tuple(args.metrics.split(",")))))


if __name__ == "__main__":
    main()
