"""tests/interpreter_speedup.py: under Triton's interpreter a kernel with nested ``@triton.jit``
helpers computes what the reference does while its helpers' calls skip the language patch,
the launch still patches once, and ``triton.language`` is back as it was after the launch; the
memoized numpy dtypes equal the interpreter's own."""

from __future__ import annotations

import pytest
import torch
from interpreter_child import HAS_TRITON, INTERPRETED, interpreted, run_interpreted_child

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _scaled(x, scale):
        return x * scale

    @triton.jit
    def _row_sum_of_scaled(x, scale):
        # tl.zeros_like is triton's standard library: it calls tl.core's builtins (core.full),
        # patched only if the launch patched tl.core, which this file does not see
        return tl.sum(_scaled(x, scale) + tl.zeros_like(x), axis=0)

    @triton.jit
    def _row_sums_kernel(x_ptr, out_ptr, scale, N: tl.constexpr):
        row = tl.program_id(0)
        x = tl.load(x_ptr + row * N + tl.arange(0, N))
        tl.store(out_ptr + row, _row_sum_of_scaled(x, scale))


@interpreted
def test_interpreted_nested_helpers_skip_the_patch_and_compute_the_reference():
    import interpreter_speedup

    assert interpreter_speedup.install()  # conftest installed it: idempotent
    originals = (tl.sum, tl.arange, tl.tensor.__add__)
    x = torch.randn(5, 16)
    out = torch.empty(5)
    before = dict(interpreter_speedup.stats)
    _row_sums_kernel[(5,)](x, out, 0.5, N=16)
    after = interpreter_speedup.stats
    torch.testing.assert_close(out, (x * 0.5).sum(dim=1))
    assert after["launch_patches"] - before["launch_patches"] == 1
    # in each of the five programs two helpers of this file and three of triton's standard
    # library (jitted too: tl.zeros_like, the tl.zeros it calls, tl.sum), none patched again
    assert after["nested_skipped"] - before["nested_skipped"] == 25
    assert (tl.sum, tl.arange, tl.tensor.__add__) == originals


def test_interpreter_child() -> None:
    if INTERPRETED or not HAS_TRITON:
        pytest.skip("this is the parent: needs triton, and not already interpreted")
    run_interpreted_child(__file__, timeout=120)


@interpreted
def test_interpreted_memoized_np_dtypes_equal_the_interpreters():
    import interpreter_speedup
    from triton.runtime import interpreter

    assert interpreter_speedup.install()
    unwrapped = interpreter._get_np_dtype.wrapped
    scalars = [tl.int1, tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.int8, tl.uint8,
               tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.float8e5,
               tl.float8e4nv]
    dtypes = scalars + [tl.pointer_type(tl.float32), tl.block_type(tl.bfloat16, [4, 8]),
                        tl.block_type(tl.pointer_type(tl.int32), [16])]
    for _ in range(2):  # the second round answers from the cache
        for dtype in dtypes:
            assert interpreter._get_np_dtype(dtype) == unwrapped(dtype), dtype
