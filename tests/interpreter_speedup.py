"""Triton's CPU interpreter without its repeated language patching (test children only).

Under ``TRITON_INTERPRET=1`` triton 3.6 patches ``triton.language`` for the interpreter (every
builtin wrapped, ``inspect.getmembers`` over ``tl``, ``tl.tensor``, ``tl.math``) once per kernel
launch, and again on every call of a nested ``@triton.jit`` helper, in every program of the
grid, without undoing the nested patches: in one profile of an engine test under the
interpreter they were 28% of its time (97 of 349 s).

:func:`install` makes each launch patch both language modules the interpreter patches
(``tl`` and ``tl.core``: triton's standard library, ``tl.sum`` and the like, sees ``core`` only)
whichever its kernel sees, undo both at its end, and skip the patch of every nested call
inside the launch (it would patch the same modules again). Triton
itself leaves ``tl.core`` patched after a launch whose helpers patched it; here the launch undoes
it. It also memoizes ``_get_np_dtype`` (a dict of 17 triton dtypes built and hashed on every call:
27.7 of the 86.8 s a top-k case's custom-combine reductions took under cProfile; those run element
by element in Python). It relies
on private names of ``triton.runtime.interpreter`` (``_patch_lang``, ``_LangPatchScope``,
``GridExecutor.__call__``, ``_get_np_dtype``) and leaves the interpreter untouched when one is
missing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# the running launch's function; None outside a launch
_launch = threading.local()
stats = {"launch_patches": 0, "nested_skipped": 0}


class _Globals:
    """What ``_patch_lang`` reads of a function: its globals (here, the modules to patch)."""

    def __init__(self, modules: dict[str, Any]) -> None:
        self.__globals__ = modules


def install() -> bool:
    """Wrap the interpreter's patching (idempotent). True when installed."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    executor = getattr(interpreter, "GridExecutor", None)
    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if patch_lang is None or scope_type is None or executor is None or np_dtype is None:
        logger.info("triton's interpreter lacks a private name this relies on: left as it is")
        return False
    if getattr(patch_lang, "_skips_nested", False):
        return True
    launch_call = executor.__call__

    import triton.language as tl

    every_language = _Globals({"tl": tl, "core": tl.core})

    def call_launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        previous = getattr(_launch, "current", None)
        _launch.current = self.fn
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            _launch.current = previous

    def patch_once(fn: Callable) -> Any:
        current = getattr(_launch, "current", None)
        if current is None:  # a helper called outside a launch: as triton does
            return patch_lang(fn)
        if fn is current:  # the launch: every module its kernel and helpers may see
            stats["launch_patches"] += 1
            return patch_lang(every_language)
        stats["nested_skipped"] += 1
        return scope_type()  # the launch patched every module a helper sees: nothing to undo

    np_dtypes: dict[Any, Any] = {}

    def np_dtype_once(tt_dtype: Any) -> Any:
        # the original looks tt_dtype up in a dict by equality and hash: so does this cache;
        # pointer types (and blocks of them) are unhashable: the original answers those
        try:
            found = np_dtypes.get(tt_dtype)
        except TypeError:
            return np_dtype(tt_dtype)
        if found is None:
            found = np_dtypes[tt_dtype] = np_dtype(tt_dtype)
        return found

    np_dtype_once.wrapped = np_dtype

    patch_once._skips_nested = True
    interpreter._patch_lang = patch_once
    interpreter._get_np_dtype = np_dtype_once
    executor.__call__ = call_launch
    return True
