"""Run a Gluon kernel's Python body on the CPU with torch tensors: the values a correct build
computes, for the kernels Triton's interpreter cannot run.

Gluon (``triton.experimental.gluon``) has no interpreter, so a Gluon kernel's values were checked
only by CUDA tests. Its layouts, shared-memory swizzles, barriers and inline PTX decide how a
kernel runs, not what it computes (a correct compiler keeps the values), so this emulation drops
them and runs the kernel's Python function once a program, in grid order, on torch tensors:

* a pointer is a flat tensor and an int64 offset tensor (:class:`Pointer`); ``load`` and
  ``store`` index it, and an access under the mask outside the tensor raises
  :class:`OutOfBounds` (on a GPU: an illegal address, or another tensor's bytes);
* shared memory is a tensor filled with NaN at allocation (:class:`SharedMemory`), so a read of
  a slot no thread stored poisons the result; ``index``, ``slice``, ``load``, ``store`` act on it;
* layouts, ``thread_barrier`` and ``inline_asm_elementwise`` (the PDL instructions) do nothing
  to values.

What it checks: the code we write (index arithmetic, masks, which stage is where when, the
accumulation and the stores). What it cannot: the compiler, the layouts' own correctness, the
barriers and races (each program runs alone, its "threads" in lockstep): the CUDA tests do.

Only what the kernels here use is emulated; anything else raises ``AttributeError`` naming it.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass

import torch


class OutOfBounds(IndexError):
    """A load or store under its mask outside its tensor."""


class Value(torch.Tensor):
    """A kernel's tensor value: immutable, as in Triton. ``a += b`` binds ``a`` to a new tensor
    (torch would add in place, into every name bound to the same tensor: ``acc1 = acc0`` then
    ``acc0 += ...`` would change ``acc1``); operations on values give values."""

    def __iadd__(self, other):
        return self + other

    def __isub__(self, other):
        return self - other

    def __imul__(self, other):
        return self * other

    def __itruediv__(self, other):
        return self / other


def _value(t: torch.Tensor) -> Value:
    return t.as_subclass(Value)


@dataclass(frozen=True)
class _PointerType:
    element_ty: torch.dtype


class Pointer:
    """A tensor of pointers into ``base`` (flattened): ``offsets`` elements from its start."""

    def __init__(self, base: torch.Tensor, offsets: torch.Tensor | int = 0) -> None:
        self.base = base
        self.offsets = torch.as_tensor(offsets, dtype=torch.int64)

    @property
    def dtype(self) -> _PointerType:
        return _PointerType(self.base.dtype)

    def __add__(self, other: torch.Tensor | int) -> Pointer:
        return Pointer(self.base, self.offsets + torch.as_tensor(other).to(torch.int64))

    __radd__ = __add__


def _flat(base: torch.Tensor) -> torch.Tensor:
    """``base``'s elements as the kernel addresses them, from its first one to its last (strides
    included: a view with a row stride spans its gaps too)."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(base.shape, base.stride())) if base.numel() else 0
    return base.as_strided((extent,), (1,))


def _broadcast(ptr: Pointer, mask, *shapes: torch.Size) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the flat tensor, offsets, mask) broadcast together (and to ``shapes``); raises
    :class:`OutOfBounds` for an offset under the mask outside the tensor."""
    keep = torch.as_tensor(True if mask is None else mask, dtype=torch.bool)
    shape = torch.broadcast_shapes(ptr.offsets.shape, keep.shape, *shapes)
    offsets, keep = ptr.offsets.expand(shape), keep.expand(shape)
    flat = _flat(ptr.base)
    bad = keep & ((offsets < 0) | (offsets >= flat.numel()))
    if bad.any():
        raise OutOfBounds(f"{int(bad.sum())} accesses outside a tensor of {flat.numel()} elements, e.g. "
                          f"offset {int(offsets[bad][0])}")
    return flat, offsets, keep


def _load(ptr: Pointer, mask=None, other=None, **_hints) -> torch.Tensor:
    flat, offsets, keep = _broadcast(ptr, mask)
    values = _value(flat[torch.where(keep, offsets, 0)])
    if mask is not None:
        values = torch.where(keep, values, torch.as_tensor(0 if other is None else other, dtype=values.dtype))
    return values


def _store(ptr: Pointer, value: torch.Tensor, mask=None, **_hints) -> None:
    value = torch.as_tensor(value)
    flat, offsets, keep = _broadcast(ptr, mask, value.shape)
    flat[offsets[keep]] = value.expand(offsets.shape)[keep].to(flat.dtype)


class SharedMemory:
    """A shared-memory buffer (or a view of one): NaN until stored."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    @property
    def shape(self) -> list[int]:
        return list(self.data.shape)

    def index(self, i: int) -> SharedMemory:
        return SharedMemory(self.data[i])

    def slice(self, start: int, length: int, dim: int = 0) -> SharedMemory:
        return SharedMemory(self.data.narrow(dim, start, length))

    def load(self, layout=None) -> torch.Tensor:
        return _value(self.data.clone())

    def store(self, value: torch.Tensor) -> None:
        assert tuple(value.shape) == tuple(self.data.shape), (tuple(value.shape), tuple(self.data.shape))
        self.data.copy_(value)


def _allocate_shared_memory(dtype: torch.dtype, shape, layout=None, value=None) -> SharedMemory:
    data = torch.full(tuple(shape), float("nan"), dtype=dtype)
    if value is not None:
        data.copy_(value)
    return SharedMemory(data)


def _layout(*args, **kwargs) -> None:
    return None


class _Program:
    """The ``gl`` namespace for one program of the grid."""

    float16, bfloat16, float32 = torch.float16, torch.bfloat16, torch.float32
    int32, int64 = torch.int32, torch.int64
    BlockedLayout = SliceLayout = SwizzledSharedLayout = NVMMASharedLayout = staticmethod(_layout)
    load, store = staticmethod(_load), staticmethod(_store)
    allocate_shared_memory = staticmethod(_allocate_shared_memory)

    def __init__(self, pid: tuple[int, int, int]) -> None:
        self.pid = pid

    def program_id(self, axis: int) -> int:
        return self.pid[axis]

    @staticmethod
    def static_range(*args) -> range:
        return range(*args)

    @staticmethod
    def arange(start: int, end: int, layout=None) -> torch.Tensor:
        return _value(torch.arange(start, end, dtype=torch.int32))

    @staticmethod
    def zeros(shape, dtype, layout=None) -> torch.Tensor:
        return _value(torch.zeros(tuple(shape), dtype=dtype))

    @staticmethod
    def zeros_like(x: torch.Tensor) -> torch.Tensor:
        return _value(torch.zeros_like(x))

    @staticmethod
    def sum(x: torch.Tensor, axis: int) -> torch.Tensor:
        return x.sum(axis)

    @staticmethod
    def thread_barrier() -> None:
        return None

    @staticmethod
    def inline_asm_elementwise(*args, **kwargs) -> torch.Tensor:
        return _value(torch.zeros((), dtype=torch.int32))  # the PDL instructions: no value


def _python_function(jit_fn, program: _Program, memo: dict) -> Callable:
    """``jit_fn``'s Python function with its closure's ``gl`` and jitted helpers replaced by the
    emulation's (a copy: the real kernel's closure is left alone)."""
    fn = jit_fn.fn
    if fn in memo:
        return memo[fn]
    cells = []
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        value = cell.cell_contents
        if name == "gl":
            value = program
        elif hasattr(value, "fn") and callable(value.fn):  # a jitted helper
            value = _python_function(value, program, memo)
        elif isinstance(value, types.ModuleType):
            raise AttributeError(f"{fn.__name__} uses module {name!r}, which the emulation does not provide")
        cells.append(types.CellType(value))
    emulated = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, tuple(cells))
    memo[fn] = emulated
    return emulated


def run(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """Emulate ``kernel[grid](*args, **kwargs)``: tensor arguments become :class:`Pointer` s,
    each program of ``grid`` runs in turn (launch options such as ``launch_pdl`` are ignored)."""
    kwargs.pop("launch_pdl", None)
    args = [Pointer(a) if isinstance(a, torch.Tensor) else a for a in args]
    grid = tuple(grid) + (1,) * (3 - len(grid))
    for z in range(grid[2]):
        for y in range(grid[1]):
            for x in range(grid[0]):
                program = _Program((x, y, z))
                _python_function(kernel, program, {})(*args, **kwargs)
