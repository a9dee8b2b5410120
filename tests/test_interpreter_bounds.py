"""tests/interpreter_bounds.py: under Triton's interpreter a load, store or atomic that a mask
lets through outside every tensor argument of the launch raises (naming the kernel and the
nearest argument), one inside passes, masked-off lanes are not checked whatever their address,
a view's bounds are its own (not its storage's), and masks the interpreter holds as integers
(not bool) are read as masks."""

from __future__ import annotations

import pytest
import torch
from interpreter_child import (
    HAS_TRITON,
    INTERPRETED,
    interpreted,
    run_interpreted_child,
    run_interpreted_script,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, MASKED: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        if MASKED:
            tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n, other=0.0), mask=offs < n)
        else:
            tl.store(y_ptr + offs, tl.load(x_ptr + offs))

    @triton.jit
    def _store_at_kernel(y_ptr, at, value):
        tl.store(y_ptr + at, value)

    @triton.jit
    def _atomic_add_kernel(y_ptr, at, BLOCK: tl.constexpr):
        offs = at + tl.arange(0, BLOCK)
        tl.atomic_add(y_ptr + offs, tl.full([BLOCK], 1, tl.int32))

    @triton.jit
    def _integer_mask_kernel(x_ptr, y_ptr, is_on, ROWS: tl.constexpr, COLS: tl.constexpr,
                             BLOCK_C: tl.constexpr):
        # a [ROWS, BLOCK_C] tile of a [ROWS, COLS] matrix, columns past COLS masked off;
        # `cols < COLS` is bool, but `&` with a comparison of a runtime scalar (`is_on > 0`) makes
        # the interpreter's mask int32 (as skinny_gemm's `(kk < K) & (M > 1)`)
        rows, cols = tl.arange(0, ROWS)[:, None], tl.arange(0, BLOCK_C)[None, :]
        offs = rows * COLS + cols
        x = tl.load(x_ptr + offs, mask=(cols < COLS) & (is_on > 0), other=0.0)
        tl.store(y_ptr + offs, x, mask=cols < COLS)

def test_interpreter_child() -> None:
    if INTERPRETED or not HAS_TRITON:
        pytest.skip("this is the parent: needs triton, and not already interpreted")
    run_interpreted_child(__file__, timeout=120)


_SCRIPT = """
import sys
import torch
import triton
import triton.language as tl
from helper_next_to_the_script import BLOCK


@triton.jit
def _copy(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs))


n = int(sys.argv[1])
x, y = torch.arange(n, dtype=torch.float32), torch.zeros(BLOCK)
_copy[(1,)](x, y, BLOCK=BLOCK)
print("copied", int(y.sum()))
"""


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs triton (runs its own interpreter child)")
def test_scripts_run_under_the_interpreter_are_checked_too(tmp_path):
    # as `python script.py 16`: its arguments, and its own directory first on sys.path
    (tmp_path / "helper_next_to_the_script.py").write_text("BLOCK = 16\n")
    script = tmp_path / "copy.py"
    script.write_text(_SCRIPT)
    fits = run_interpreted_script(script, "16", timeout=120)
    assert fits.returncode == 0 and "copied 120" in fits.stdout, fits.stderr[-2000:]
    short = run_interpreted_script(script, "10", timeout=120)
    assert short.returncode != 0
    assert "OutOfBoundsAccess" in short.stderr and "_copy: load" in short.stderr, short.stderr[-2000:]


@interpreted
def test_interpreted_unmasked_load_past_the_end_raises_naming_kernel_and_argument():
    import interpreter_bounds
    from triton.runtime.errors import InterpreterError

    assert interpreter_bounds.install()  # conftest installed it: idempotent
    x, y = torch.arange(10, dtype=torch.float32), torch.zeros(16)
    with pytest.raises(InterpreterError, match=r"_copy_kernel: load of 4-byte elements touches 6 "
                       r"address.*0 bytes past the end of argument .x_ptr. \(40 bytes\)"):
        _copy_kernel[(1,)](x, y, 10, BLOCK=16, MASKED=False)


@interpreted
def test_interpreted_masked_lanes_are_not_checked():
    import interpreter_bounds

    x, y = torch.arange(10, dtype=torch.float32), torch.zeros(10)
    before = interpreter_bounds.stats["checked_ops"]
    _copy_kernel[(2,)](x, y, 10, BLOCK=8, MASKED=True)  # program 1's lanes 2..7 masked off
    assert torch.equal(y, x)
    assert interpreter_bounds.stats["checked_ops"] - before == 4  # a load and a store a program


@interpreted
def test_interpreted_a_view_is_bounded_by_itself_not_its_storage():
    from triton.runtime.errors import InterpreterError

    storage = torch.zeros(12, dtype=torch.float32)
    view = storage[4:8]
    _store_at_kernel[(1,)](view, 3, 1.0)
    assert storage[7] == 1.0
    with pytest.raises(InterpreterError, match=r"store .* 0 bytes past the end of argument .y_ptr. \(16 bytes\)"):
        _store_at_kernel[(1,)](view, 4, 2.0)  # storage[8]: inside the storage, past the view
    with pytest.raises(InterpreterError, match=r"4 bytes before argument .y_ptr."):
        _store_at_kernel[(1,)](view, -1, 2.0)
    assert storage[8] == 0.0 and storage[3] == 0.0  # raised before writing


@interpreted
def test_interpreted_strided_view_spans_first_to_last_element():
    from triton.runtime.errors import InterpreterError

    matrix = torch.zeros(4, 6, dtype=torch.float32)
    column = matrix[:, 2]  # strided: elements 2, 8, 14, 20 of the storage
    _store_at_kernel[(1,)](column, 18, 1.0)  # element 20: the column's last
    assert column[3] == 1.0
    with pytest.raises(InterpreterError, match="past the end"):
        _store_at_kernel[(1,)](column, 19, 1.0)


@interpreted
def test_interpreted_atomic_out_of_bounds_raises():
    from triton.runtime.errors import InterpreterError

    y = torch.zeros(8, dtype=torch.int32)
    _atomic_add_kernel[(1,)](y, 4, BLOCK=4)
    assert y.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(InterpreterError, match="_atomic_add_kernel: atomic"):
        _atomic_add_kernel[(1,)](y, 5, BLOCK=4)


@interpreted
def test_interpreted_integer_masks_are_masks():
    # read as indices, not as a mask, the int32 mask's 0 / 1 would pick whole rows 0 and 1 of
    # the addresses, row 1's masked-off column past the end among them
    x, y = torch.arange(6, dtype=torch.float32), torch.full((6,), -1.0)
    _integer_mask_kernel[(1,)](x, y, 1, ROWS=2, COLS=3, BLOCK_C=4)
    assert torch.equal(y, x)
    _integer_mask_kernel[(1,)](x, y, 0, ROWS=2, COLS=3, BLOCK_C=4)  # every load lane off
    assert torch.equal(y, torch.zeros(6))
