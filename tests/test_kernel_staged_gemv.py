"""kernels/staged_gemv.py: the batch-1 GEMV that parks its weight in shared memory before the PDL wait.

Gluon has no interpreter. On the CPU: the values of the kernel's Python body, run by
tests/gluon_emulator.py (index arithmetic, masks, the staging, the stores: not the compiler or
races), and the sm_90 build checked offline (what is issued before ``griddepcontrol.wait``, no
spills). On a GPU: the values against an fp64 reference, determinism, CUDA-graph replays, and the
attention -> merge -> o_proj chain with early signals (a race would read the previous replay's
attention output).
"""

from __future__ import annotations

import gluon_emulator
import pytest
import torch
from interpreter_child import HAS_TRITON, INTERPRETED
from ptx_sm90 import can_compile_sm90, compile_gluon_sm90, ptxas_spills

from laguna_dflash.kernels import staged_gemv as stg

needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or not HAS_TRITON or torch.cuda.get_device_capability() < (9, 0),
    reason="needs a CUDA sm_90+ device and triton")


def _build(cfg: stg.StagedConfig, k: int, pdl: bool = True) -> str:
    # staged_gemv's own launch arguments (shapes only: meta tensors), PDL as asked
    w, x = torch.empty(cfg.block_n, k, device="meta"), torch.empty(1, k, device="meta")
    kernel, _, _, consts = stg._launch_arguments(x, w, cfg, torch.empty(1, cfg.block_n, device="meta"))
    consts["PDL"] = pdl
    types = {"w_ptr": "*bf16", "x_ptr": "*bf16", "y_ptr": "*bf16"}
    return compile_gluon_sm90(kernel, types, consts, {"num_warps": cfg.num_warps, "launch_pdl": pdl})


@pytest.mark.skipif(not can_compile_sm90() or INTERPRETED, reason="needs triton's nvidia backend")
@pytest.mark.parametrize("cfg,k", [
    (stg.StagedConfig(8, 512, 8), 8192), (stg.StagedConfig(8, 512, 8), 6144),
    (stg.StagedConfig(8, 512, 4), 3072), (stg.StagedConfig(8, 512, 8), 2048),
    (stg.StagedConfig(8, 512, 1), 1024),
], ids=["o_proj", "o_proj-6144", "ahead-past-end", "all-parked", "one-parked"])
def test_sm90_stages_are_parked_before_the_pdl_wait(cfg, k):
    """Before ``griddepcontrol.wait``: the loads of the parked stages plus four stages ahead (no
    load past the last stage), all ``evict_first`` 16-byte vectors, and the parked stages'
    shared-memory stores; after it x and the remaining stages' loads, then the signal; the row
    stored; no spills. Without PDL: no griddepcontrol at all."""
    stages = cfg.stages
    ptx = _build(cfg, k)
    assert ptx.count("griddepcontrol.wait") == 1
    wait = ptx.index("griddepcontrol.wait")
    before, after = ptx[:wait], ptx[wait:]
    num_k = k // cfg.stage_k
    per_stage = cfg.block_n * cfg.stage_k * 2 // 16 // (32 * cfg.num_warps)  # 16-byte loads a thread
    parked = min(stages, num_k)
    ahead = min(parked + 4, num_k)
    evict_first = "ld.global.L1::evict_first.L2::cache_hint.v4"
    assert before.count(evict_first) == before.count("ld.global") == ahead * per_stage
    assert before.count("st.shared") >= parked * per_stage
    assert after.count(evict_first) == (num_k - ahead) * per_stage
    assert after.count("ld.global") > after.count(evict_first)  # x
    assert "griddepcontrol.launch_dependents" in after
    assert after.count("st.global") >= 1  # the output row
    assert max(ptxas_spills(ptx)) == 0
    assert "griddepcontrol" not in _build(cfg, k, pdl=False)


def test_default_config_and_shared_memory():
    assert stg.default_config(2048, 8192) == stg.StagedConfig(8, 512, 8, 4)
    assert stg.default_config(2048, 6144) == stg.StagedConfig(8, 512, 8, 4)
    # S-2.1's o_proj (K = 9216) fits; narrower stages divide smaller K
    assert stg.default_config(3072, 9216).smem_bytes(9216) <= stg._MAX_SMEM
    assert stg.default_config(64, 192) == stg.StagedConfig(8, 64, 8, 4)  # 192 = 3 x 64
    assert stg.default_config(64, 8).stage_k == 64  # K % stage_k != 0: supports() refuses it
    for k in (64, 128, 192, 256, 512, 2048, 6144, 8192):
        assert k % stg.default_config(64, k).stage_k == 0
    # 8 parked [8, 512] stages + x as 16 (8192 / 512) rows of 512
    assert stg.StagedConfig().smem_bytes(8192) == (8 * 8 + 16) * 512 * 2
    assert stg.StagedConfig().smem_bytes(6144) == (8 * 8 + 16) * 512 * 2  # 12 x rows padded to 16
    assert stg.StagedConfig(stages=8).smem_bytes(1024) == (2 * 8 + 2) * 512 * 2  # only 2 stages


def test_one_row_config_is_the_switch_default_config_reads(monkeypatch):
    # benchmarks A/B the parked stages through the module constant (nineteenth pass)
    monkeypatch.setattr(stg, "ONE_ROW_CONFIG", (8, 512, 12, 4))
    assert stg.default_config(2048, 8192) == stg.StagedConfig(8, 512, 12, 4)
    assert stg.default_config(2048, 6144).smem_bytes(6144) == (12 * 8 + 16) * 512 * 2


def test_gluon_is_detected():
    assert stg._has_gluon() == (HAS_TRITON and _importable("triton.experimental.gluon"))


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def test_cpu_tensors_and_more_rows_than_one_are_refused_with_a_fix():
    x, w = torch.zeros(1, 256, dtype=torch.bfloat16), torch.zeros(64, 256, dtype=torch.bfloat16)
    assert not stg.supports(w) and not stg.can_use(x, w)
    assert not stg.supports(w, m=0) and not stg.supports(w, m=2)
    with pytest.raises(ValueError, match="can_use"):
        stg.staged_gemv(x, w)
    with pytest.raises(ValueError, match=r"x \(4, 256\).*x \[1, K\].*can_use"):
        stg.staged_gemv(torch.zeros(4, 256, dtype=torch.bfloat16), w)


def _ulps(y: torch.Tensor, want: torch.Tensor) -> float:
    # |y - want| in units of want's bf16 spacing (2^-7 relative), plus a floor for values near 0
    return ((y.float() - want).abs() / (want.abs() * 2.0**-7 + 1e-3)).max().item()


def _emulated(x: torch.Tensor, w: torch.Tensor, cfg: stg.StagedConfig) -> torch.Tensor:
    """:func:`staged_gemv`'s launch run by tests/gluon_emulator.py on the CPU; y starts as NaN,
    so an element no program writes shows."""
    y = torch.full((1, w.shape[0]), float("nan"), dtype=x.dtype)
    kernel, grid, args, kwargs = stg._launch_arguments(x, w, cfg, y)
    gluon_emulator.run(kernel, grid, *args, **kwargs)
    return y


@pytest.mark.skipif(not stg._has_gluon(), reason="needs triton's Gluon (triton 3.6)")
@pytest.mark.parametrize("n,k,cfg", [
    (64, 8192, None), (32, 6144, None), (64, 1024, None), (48, 9216, None),
    (32, 8192, stg.StagedConfig(16, 512, 6, 8)), (16, 128, stg.StagedConfig(8, 64, 1, 4)),
], ids=lambda v: str(v) if not isinstance(v, stg.StagedConfig) else
    f"{v.block_n}x{v.stage_k}-{v.stages}-w{v.num_warps}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_emulated_kernel_matches_the_fp64_reference(n, k, cfg, dtype):
    """The kernel run on the CPU by the Gluon emulation: within one output ulp of the exact sum,
    every y element written, no access outside w, x (a row of a wider tensor: reads past K are
    outside it) or y."""
    cfg = cfg or stg.default_config(n, k)
    g = torch.Generator().manual_seed(n + k + 1)
    w = (torch.randn(n, k, generator=g) * 0.02).to(dtype)
    x = torch.randn(1, k + 64, generator=g).to(dtype)[:, :k]  # row stride k + 64
    y = _emulated(x, w, cfg)
    assert not y.isnan().any()
    assert _ulps(y, (x.double() @ w.double().T).float()) <= 1.0


@pytest.mark.skipif(not stg._has_gluon(), reason="needs triton's Gluon (triton 3.6)")
def test_emulation_reports_reads_of_unstored_shared_memory_and_out_of_bounds():
    """The emulation's own checks fail where a kernel would be wrong on the GPU: shared memory
    read before any store is NaN, and an access outside a tensor raises."""
    smem = gluon_emulator._allocate_shared_memory(torch.bfloat16, [2, 4])
    smem.index(1).store(torch.ones(4, dtype=torch.bfloat16))
    assert smem.index(0).load().isnan().all() and (smem.index(1).load() == 1).all()
    x = torch.zeros(2, 8)[:, :4]  # extent 12 elements: offsets 0..11
    ptr = gluon_emulator.Pointer(x)
    assert gluon_emulator._load(ptr + torch.arange(12)).shape == (12,)
    with pytest.raises(gluon_emulator.OutOfBounds, match="1 accesses"):
        gluon_emulator._load(ptr + torch.arange(13))
    assert (gluon_emulator._load(ptr + torch.arange(13), mask=torch.arange(13) < 12, other=5.0)[12] == 5.0)
    with pytest.raises(gluon_emulator.OutOfBounds):
        gluon_emulator._store(ptr + 12, torch.tensor(1.0))
    # values are immutable, as in Triton: "+=" rebinds and leaves another name bound to the tensor
    a = gluon_emulator._value(torch.zeros(3))
    b = a
    a += 1
    assert (b == 0).all() and (a == 1).all()


@needs_sm90
@pytest.mark.parametrize("n,k,cfg", [
    (2048, 8192, None),
    (2048, 6144, None),
    (2048, 8192, stg.StagedConfig(16, 512, 6, 8)),
    (256, 1024, None),
    (64, 128, stg.StagedConfig(8, 64, 1, 4)),
    (64, 192, None),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_matches_the_fp64_reference(n, k, cfg, dtype):
    """Within one output ulp of the exact sum, bitwise the same on every call and in a graph;
    x a row of a wider tensor (a view)."""
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(dtype)
    x = torch.randn(1, k + 64, device="cuda", generator=g).to(dtype)[:, :k]  # row stride k + 64
    assert stg.can_use(x, w, cfg)
    want = (x.double() @ w.double().T).float()
    y = stg.staged_gemv(x, w, cfg)
    assert y.shape == (1, n) and y.dtype == dtype
    assert _ulps(y, want) <= 1.0
    assert torch.equal(stg.staged_gemv(x, w, cfg), y)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = stg.staged_gemv(x, w, cfg)
    x.copy_(torch.randn(1, k, device="cuda", generator=g).to(dtype))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(yg, stg.staged_gemv(x, w, cfg))  # the replay read the new x


@needs_sm90
def test_cuda_refuses_more_rows_than_one():
    """A weight it runs with, but x of 0, 2 or 4 rows: refused (one-row kernel only), and
    staged_gemv's error names can_use."""
    w = torch.zeros(2048, 8192, device="cuda", dtype=torch.bfloat16)
    assert stg.supports(w) and stg.can_use(torch.zeros(1, 8192, device="cuda", dtype=torch.bfloat16), w)
    for m in (0, 2, 4):
        x = torch.zeros(m, 8192, device="cuda", dtype=torch.bfloat16)
        assert not stg.supports(w, m=m) and not stg.can_use(x, w)
        with pytest.raises(ValueError, match="can_use"):
            stg.staged_gemv(x, w)


@needs_sm90
@pytest.mark.parametrize("k", [9216, 6144, 4608, 3072])
def test_cuda_s21_o_proj_matches_the_fp64_reference(k):
    """S-2.1's o_proj (hidden 3072 over 72 / 48 heads x 128; 36 / 24 a rank under 2-way TP) on
    the default config."""
    test_cuda_matches_the_fp64_reference(3072, k, None, torch.bfloat16)


@needs_sm90
@pytest.mark.parametrize("early", [False, True])
def test_cuda_o_proj_after_attention_reads_this_replays_output(early):
    """Q/K kernel -> attention -> split merge -> staged o_proj in one graph, PDL-launched, with
    ``early_signal`` (o_proj resident while attention runs, as the engine launches it) and
    without; one token (the decode). Every replay gets new q/k/v; o_proj must read the merge's
    output of the same replay (a read before its wait would see the previous one): 30 replays,
    each bitwise against an eager o_proj of the attention output the replay left."""
    from test_kernel_paged_attention import NUM_HEADS, make_case

    from laguna_dflash.kernels import paged_attention as pa
    from laguna_dflash.kernels import pdl
    from laguna_dflash.kernels import qk_norm_rope_cache as qnrc

    if not pdl.active(torch.device("cuda"), False):
        pytest.skip("needs programmatic dependent launch")
    dtype, kv_heads, head_dim, tokens = torch.bfloat16, 2, 128, 1
    _, kc, vc, meta, _ = make_case([(700, tokens)], kv_heads, head_dim, dtype, True, device="cuda", seed=3)
    g = torch.Generator(device="cuda").manual_seed(3)
    qkv = torch.randn(tokens, (NUM_HEADS + 2 * kv_heads) * head_dim, device="cuda", generator=g).to(dtype)
    qw = torch.ones(head_dim, device="cuda", dtype=dtype)
    angles = torch.arange(1024, device="cuda")[:, None] * torch.rand(head_dim, device="cuda", generator=g)
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    w = (torch.randn(512, NUM_HEADS * head_dim, device="cuda", generator=g) * 0.02).to(dtype)
    assert stg.supports(w)

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        q = qnrc.qk_norm_rope_cache(qkv, NUM_HEADS, kv_heads, head_dim, qw, qw, 1e-6, cos, sin,
                                    meta.positions, head_dim, meta.slot_mapping, kc, vc)
        out = pa.paged_attention(q, kc, vc, meta.query_index, meta.query_positions, meta.key_slots,
                                 meta.seq_lens, scale=head_dim ** -0.5, causal=True, num_splits=4,
                                 early_signal=early)
        return out, stg.staged_gemv(out.reshape(tokens, -1), w)

    forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, y = forward()
    for _ in range(30):
        qkv.copy_(torch.randn(qkv.shape, device="cuda", generator=g).to(dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, stg.staged_gemv(out.reshape(tokens, -1), w))
