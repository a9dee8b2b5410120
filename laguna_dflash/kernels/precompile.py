"""Triton kernel builds ahead of their launches, on a thread pool.

Start-up capture (``cuda_graph_capture="startup"``) launches every kernel variant that the graphs
of every padded batch size and key bucket need. Built one at a time as each was first launched,
they took most of that phase: on the H200 at the server's defaults, 62.7 of its 89.7 s went to
Triton builds, 65 of them paged-attention variants (docs/PERFORMANCE.md, twenty-fourth pass).

Inside :func:`launches_build_only`, a Triton launch does not run. It submits the build of its
variant to a thread pool (Triton's own ``AsyncCompileMode``) and returns; a variant already
built, loaded or submitted costs nothing. Leaving the scope waits for the builds, and the kernels'
in-memory caches then hold them, so the launches that follow start at once. Triton runs its
MLIR / LLVM passes without holding the GIL and ptxas as a subprocess, so the threads build in
parallel. A build that fails is dropped here; the real launch builds it again and raises.

What runs inside the scope must not need a kernel's results. The engine records forwards into
throwaway CUDA graphs there, where nothing executes (``engine.cuda_graph.build_kernels_ahead``).
A kernel module that keeps device state created on first use (zeroed workspaces) registers its
cache with :func:`register_state`. State created inside the scope is dropped on exit: nothing
ever filled it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

logger = logging.getLogger(__name__)

C = TypeVar("C", dict, list)

# the registered first-use caches (module dicts / lists holding device tensors)
_STATES: list[dict | list] = []
# open launches_build_only scopes (the scope is process-wide)
_num_open_scopes = 0


def is_build_only() -> bool:
    """True inside :func:`launches_build_only`: what is launched there does not run, so code
    that would do one-time work on its first call (``torch.compile``, which cannot compile
    inside the CUDA graph recording the engine runs there) should take its plain path."""
    return _num_open_scopes > 0


def register_state(cache: C) -> C:
    """Register a module-level cache (a dict or list) of device state created on first use, so
    that :func:`launches_build_only` can drop what a build-only pass put there. -> ``cache``."""
    _STATES.append(cache)
    return cache


def default_num_threads() -> int:
    """Build threads: the CPUs this process may use, at most 32."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(32, cpus))


@dataclass
class Builds:
    """What a :func:`launches_build_only` scope did, filled in when it ends."""

    num_threads: int
    num_submitted: int = 0  # distinct variants submitted (not built or loaded before the scope)
    num_failed: int = 0  # of those, builds that raised (their launches will raise)


def _snapshot(cache: dict | list) -> dict | list:
    return dict(cache) if isinstance(cache, dict) else list(cache)


def _restore(cache: dict | list, saved: dict | list) -> None:
    if isinstance(cache, dict):
        cache.clear()
        cache.update(saved)
    else:
        cache[:] = saved


@contextlib.contextmanager
def launches_build_only(num_threads: int | None = None) -> Iterator[Builds]:
    """Scope in which every Triton launch (``JITFunction.run``, Gluon kernels included) builds
    its variant on a pool of ``num_threads`` threads (default :func:`default_num_threads`)
    instead of running; on exit, waits for every build, puts the built kernels in their caches
    and restores the registered first-use state (:func:`register_state`). Process-wide while it
    lasts: no other thread may launch Triton kernels meanwhile."""
    from triton.runtime import _async_compile
    from triton.runtime.jit import JITFunction

    global _num_open_scopes
    builds = Builds(num_threads or default_num_threads())
    saved = [_snapshot(cache) for cache in _STATES]
    launch = JITFunction.run

    def build_only(self, *args, grid, warmup, **kwargs):
        return launch(self, *args, grid=grid, warmup=True, **kwargs)

    _num_open_scopes += 1
    try:
        with ThreadPoolExecutor(builds.num_threads, thread_name_prefix="triton-build") as pool:
            mode = _async_compile.AsyncCompileMode(pool, ignore_errors=True)
            with mode:  # its exit waits for the builds and fills the kernels' caches
                JITFunction.run = build_only
                yield builds
            builds.num_submitted = len(mode.raw_futures)
            builds.num_failed = sum(f.exception() is not None for f in mode.raw_futures)
    finally:
        _num_open_scopes -= 1
        JITFunction.run = launch
        for cache, state in zip(_STATES, saved):
            _restore(cache, state)
    if builds.num_failed:
        logger.warning("%d of %d Triton kernel builds ahead of launch failed; their launches "
                       "will build them again and report the error", builds.num_failed,
                       builds.num_submitted)
