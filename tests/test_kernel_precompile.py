"""kernels/precompile.py: Triton launches inside ``launches_build_only`` build their variants on a
thread pool and run nothing.

Offline: Triton's CUDA backend builds real sm_90 kernels (PTX and cubin, through its ptxas) under
a stand-in driver that has no launcher, so a launch that ran would fail. The engine's use (every
start-up capture builds nothing after the pass) is checked on the GPU in test_cuda_graphs.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from ptx_sm90 import can_compile_sm90

from laguna_dflash.kernels import precompile

pytestmark = pytest.mark.skipif(not can_compile_sm90(),
                                reason="needs triton's CUDA backend (and not the interpreter)")


@pytest.fixture
def sm90_driver():
    """Triton's active driver replaced by one that targets sm_90 and cannot launch."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class NoLaunchDriver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def is_active(self):
            return True

        def map_python_to_cpp_type(self, ty):
            return "int32_t" if ty == "i32" else "void*"

    saved = driver._active  # None on a machine without a GPU (no driver is active there)
    driver.set_active(NoLaunchDriver())
    try:
        yield
    finally:
        driver._active = saved


def _kernels():
    import triton
    import triton.language as tl

    def double(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)

    def broken(x_ptr, BLOCK: tl.constexpr):
        tl.static_assert(BLOCK < 0, "this variant does not build")
        tl.store(x_ptr, 1.0)

    return triton.jit(double), triton.jit(broken)


def test_launches_build_their_variants_once_and_run_nothing(sm90_driver) -> None:
    from triton.compiler import CompiledKernel
    from triton.runtime.jit import JITFunction

    double, _ = _kernels()
    launch = JITFunction.run
    x = torch.zeros(64)
    with precompile.launches_build_only(2) as builds:
        for block in (16, 32, 64, 128):
            for _ in range(3):  # a variant launched again is not submitted again
                double[(4,)](x, 64, BLOCK=block)
        double[(4,)](x, 63, BLOCK=16)  # n not a multiple of 16: another specialisation
        assert builds.num_submitted == 0  # counted when the scope ends
    assert JITFunction.run is launch
    assert (builds.num_threads, builds.num_submitted, builds.num_failed) == (2, 5, 0)
    cache = double.device_caches[0][0]
    assert len(cache) == 5 and all(isinstance(k, CompiledKernel) for k in cache.values())
    assert all(len(k.asm["cubin"]) > 0 for k in cache.values())
    assert torch.equal(x, torch.zeros(64))  # nothing ran (and the driver could not launch)
    with precompile.launches_build_only(2) as again:  # built: nothing to submit
        double[(4,)](x, 64, BLOCK=32)
    assert again.num_submitted == 0


def test_a_failed_build_is_counted_and_left_to_the_launch(sm90_driver) -> None:
    double, broken = _kernels()
    x = torch.zeros(16)
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logger = logging.getLogger("laguna_dflash.kernels.precompile")
    logger.addHandler(handler)
    try:
        with precompile.launches_build_only(2) as builds:
            broken[(1,)](x, BLOCK=4)
            double[(1,)](x, 16, BLOCK=8)
    finally:
        logger.removeHandler(handler)
    assert (builds.num_submitted, builds.num_failed) == (2, 1)
    assert len(warnings) == 1 and "1 of 2 Triton kernel builds" in warnings[0]
    assert not broken.device_caches[0][0]  # not cached: the launch builds it again and raises
    assert len(double.device_caches[0][0]) == 1


def test_first_use_state_made_inside_is_dropped_and_the_launch_restored(sm90_driver) -> None:
    from triton.runtime.jit import JITFunction

    workspaces = precompile.register_state({"kept": 1})
    retired = precompile.register_state(["old"])
    launch = JITFunction.run
    try:
        with pytest.raises(RuntimeError, match="boom"), precompile.launches_build_only(1):
            assert JITFunction.run is not launch
            workspaces["made inside"] = 2
            workspaces["kept"] = 3
            retired.append("new")
            raise RuntimeError("boom")
        assert JITFunction.run is launch
        assert workspaces == {"kept": 1} and retired == ["old"]
    finally:
        precompile._STATES.remove(workspaces)
        precompile._STATES.remove(retired)


def test_the_kernel_workspaces_are_registered() -> None:
    from laguna_dflash.kernels import moe_routing, skinny_gemm

    ids = {id(c) for c in precompile._STATES}
    assert {id(skinny_gemm._WORKSPACES), id(skinny_gemm._RETIRED),
            id(moe_routing._ROUTER_WORKSPACES)} <= ids


def test_default_threads_are_the_usable_cpus_capped() -> None:
    assert 1 <= precompile.default_num_threads() <= 32


def test_fused_chains_take_their_eager_body_inside_the_scope(monkeypatch) -> None:
    """``torch.compile`` cannot compile inside the CUDA graph recording of a build-only pass, and
    a failure there would turn a chain's compiled path off for good (models/fusion.py). Inside
    the scope a fused chain runs its eager body; its next call outside compiles."""
    from types import SimpleNamespace

    from laguna_dflash.models import fusion

    calls = []

    def fake_compile(fn, **_):
        calls.append("compile")
        return lambda *args: calls.append("compiled")

    monkeypatch.setattr(torch, "compile", fake_compile)
    chain = fusion.fused(lambda x: calls.append("eager"))
    x = SimpleNamespace(is_cuda=True)  # stands in for a CUDA tensor
    with torch.inference_mode():
        with precompile.launches_build_only(1):
            assert precompile.is_build_only()
            chain(x)
        assert not precompile.is_build_only()
        chain(x)
    assert calls == ["eager", "compile", "compiled"]
