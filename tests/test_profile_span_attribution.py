"""``benchmarks/profile_decode_xs.py``'s span attribution: each kernel is charged how far its end
passes the latest end before it, so PDL kernels launched early (whose own durations include their
waits) are not counted twice and the charges add up to the first-to-last span."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def test_span_added_charges_only_the_new_end() -> None:
    from profile_decode_xs import span_added

    kernels = [
        ("gemv", 0.0, 10.0),   # 0 .. 10
        ("norm", 2.0, 9.0),    # launched early, waits, ends at 11: adds 1, not 9
        ("attn", 11.5, 3.0),   # a gap of 0.5 then 3: adds 3.5 (the gap is on the path)
        ("tiny", 12.0, 1.0),   # ends inside attn: adds nothing
        ("gemv", 13.0, 10.0),  # ends at 23: adds 8.5
    ]
    added = span_added(kernels)
    assert added == pytest.approx([10.0, 1.0, 3.5, 0.0, 8.5])
    span = kernels[-1][1] + kernels[-1][2] - kernels[0][1]
    assert sum(added) == pytest.approx(span)
    assert sum(d for _, _, d in kernels) > span  # the summed durations double count the waits
