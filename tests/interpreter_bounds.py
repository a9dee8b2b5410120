"""Out-of-bounds checks for Triton's CPU interpreter (test children only).

On a GPU an out-of-bounds load or store is an illegal address (or, inside the caching
allocator's slack, a silent read of another tensor); under ``TRITON_INTERPRET=1`` the same
access reads or writes whatever host memory lies there, and the interpreted test passes. The
forty-second pass lost a GPU call to one (a preload past the last weight row block with more
programs than row blocks), which every CPU test had run through.

:func:`install` makes every load, store and atomic of an interpreted launch check that each
address its mask lets through lies inside one of the launch's tensor arguments (the bytes of the
view, ``data_ptr`` to its last element, not the whole storage), and raise
:class:`OutOfBoundsAccess` naming the kernel, the operation, the first stray address and the
nearest argument otherwise. Masked-off lanes are not checked (the GPU does not touch them
either). It relies on private names of ``triton.runtime.interpreter`` (``GridExecutor._init_args_hst``,
``InterpreterBuilder.create_masked_load`` / ``create_masked_store`` / ``create_atomic_rmw`` /
``create_atomic_cas``) and leaves the interpreter untouched when one is missing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

_launch = threading.local()  # .ranges: the running launch's Ranges; None outside a launch
stats = {"checked_ops": 0}


class OutOfBoundsAccess(IndexError):
    """An interpreted kernel touched an address outside every tensor argument of its launch."""


class Ranges:
    """The byte ranges ``[start, end)`` of a launch's tensor arguments, merged where views of one
    storage overlap, plus each argument's name for the error message."""

    def __init__(self, kernel: str, named: list[tuple[str, int, int]]) -> None:
        self.kernel = kernel
        self.named = sorted(named, key=lambda item: item[1])
        merged: list[list[int]] = []
        for _, start, end in self.named:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self.starts = np.array([m[0] for m in merged], dtype=np.uint64)
        self.ends = np.array([m[1] for m in merged], dtype=np.uint64)

    def check(self, op: str, addresses: np.ndarray, mask: np.ndarray | None, num_bytes: int) -> None:
        """Raise unless every address in ``addresses`` (uint64, any shape) where ``mask`` holds
        starts ``num_bytes`` inside one range."""
        stats["checked_ops"] += 1
        if addresses.size == 0:
            return
        # fast path: every address, masked-off ones too, inside the range of the lowest
        lowest, highest = int(addresses.min()), int(addresses.max())
        at = int(np.searchsorted(self.starts, lowest, side="right")) - 1
        if at >= 0 and highest + num_bytes <= int(self.ends[at]):
            return
        if mask is not None:
            # interpreted masks are not always bool (an int1 made by `&` of scalars is int32)
            addresses = addresses[np.broadcast_to(mask.astype(bool, copy=False), addresses.shape)]
        addresses = addresses.reshape(-1)
        if addresses.size == 0:
            return
        index = np.searchsorted(self.starts, addresses, side="right").astype(np.int64) - 1
        is_inside = index >= 0
        clipped = np.maximum(index, 0)
        is_inside &= addresses + np.uint64(num_bytes) <= self.ends[clipped]
        if bool(is_inside.all()):
            return
        stray = int(addresses[~is_inside][0])
        num_stray = int((~is_inside).sum())
        raise OutOfBoundsAccess(
            f"kernel {self.kernel}: {op} of {num_bytes}-byte elements touches {num_stray} "
            f"address(es) outside every tensor argument, the first {self._describe(stray)}"
        )

    def _describe(self, address: int) -> str:
        if not self.named:
            return f"0x{address:x} (the launch has no tensor argument)"
        name, start, end = min(
            self.named, key=lambda item: min(abs(address - item[1]), abs(address - item[2]))
        )
        if address >= end:
            where = f"{address - end} bytes past the end of"
        else:
            where = f"{start - address} bytes before"
        return f"0x{address:x}, {where} argument '{name}' ({end - start} bytes)"


def _tensor_bytes(tensor: Any) -> tuple[int, int] | None:
    """``[first byte, one past the last byte)`` of a strided view; None when it is empty."""
    if tensor.numel() == 0:
        return None
    element = tensor.element_size()
    span = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    start = tensor.data_ptr()
    return start, start + (span + 1) * element


def _named_tensors(name: str, arg: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(arg, tuple | list):
        for i, item in enumerate(arg):
            yield from _named_tensors(f"{name}[{i}]", item)
    elif hasattr(arg, "base") and hasattr(arg, "block_shape"):  # a TensorDescriptor
        yield from _named_tensors(f"{name}.base", arg.base)
    elif hasattr(arg, "data_ptr") and hasattr(arg, "numel"):
        yield name, arg


def _element_bytes(pointers: Any) -> int:
    return max(1, pointers.get_element_ty().primitive_bitwidth // 8)


def install() -> bool:
    """Wrap the interpreter's argument set-up and memory operations (idempotent). True when
    installed."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    executor = getattr(interpreter, "GridExecutor", None)
    builder = getattr(interpreter, "InterpreterBuilder", None)
    names = ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas")
    if executor is None or builder is None or not hasattr(executor, "_init_args_hst") or not all(
        hasattr(builder, name) for name in names
    ):
        logger.info("triton's interpreter lacks a private name this relies on: left unchecked")
        return False
    if getattr(executor._init_args_hst, "_checks_bounds", False):
        return True
    init_args = executor._init_args_hst
    masked_load, masked_store = builder.create_masked_load, builder.create_masked_store
    atomic_rmw, atomic_cas = builder.create_atomic_rmw, builder.create_atomic_cas

    def init_args_checked(self: Any, args_dev: Any, kwargs: Any) -> Any:
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        arg_names = list(getattr(self, "arg_names", []))
        named = [*zip(arg_names, args_hst), *kwargs_hst.items()]
        spans = []
        for name, arg in named:
            for label, tensor in _named_tensors(str(name), arg):
                span = _tensor_bytes(tensor)
                if span is not None:
                    spans.append((label, *span))
        _launch.ranges = Ranges(getattr(self.fn, "__name__", str(self.fn)), spans)
        return args_hst, kwargs_hst

    def check(op: str, pointers: Any, mask: Any) -> None:
        ranges = getattr(_launch, "ranges", None)
        if ranges is not None:
            ranges.check(op, pointers.data, None if mask is None else mask.data, _element_bytes(pointers))

    def load_checked(self: Any, ptrs: Any, mask: Any, *args: Any, **kwargs: Any) -> Any:
        check("load", ptrs, mask)
        return masked_load(self, ptrs, mask, *args, **kwargs)

    def store_checked(self: Any, ptrs: Any, value: Any, mask: Any, *args: Any, **kwargs: Any) -> Any:
        check("store", ptrs, mask)
        return masked_store(self, ptrs, value, mask, *args, **kwargs)

    def rmw_checked(self: Any, op: Any, ptr: Any, val: Any, mask: Any, *args: Any, **kwargs: Any) -> Any:
        check("atomic", ptr, mask)
        return atomic_rmw(self, op, ptr, val, mask, *args, **kwargs)

    def cas_checked(self: Any, ptr: Any, *args: Any, **kwargs: Any) -> Any:
        check("atomic_cas", ptr, None)
        return atomic_cas(self, ptr, *args, **kwargs)

    init_args_checked._checks_bounds = True
    executor._init_args_hst = init_args_checked
    builder.create_masked_load = load_checked
    builder.create_masked_store = store_checked
    builder.create_atomic_rmw = rmw_checked
    builder.create_atomic_cas = cas_checked
    return True
