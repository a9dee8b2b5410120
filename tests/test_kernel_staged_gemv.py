"""kernels/staged_gemv.py: the batch-1 GEMV that parks its weight in shared memory before the PDL wait.

Gluon has no interpreter. On the CPU: the values of every kernel's Python body, run by
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
from ptx_sm90 import can_compile_sm90, compile_gluon_sm90, ptxas_registers, ptxas_spills

from laguna_dflash.kernels import staged_gemv as stg

needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or not HAS_TRITON or torch.cuda.get_device_capability() < (9, 0),
    reason="needs a CUDA sm_90+ device and triton")


def _build(cfg: stg.StagedConfig, k: int, pdl: bool = True, m: int = 1) -> str:
    # staged_gemv's own launch arguments (shapes only: meta tensors), PDL as asked
    w, x = torch.empty(cfg.block_n, k, device="meta"), torch.empty(m, k, device="meta")
    kernel, _, _, consts = stg._launch_arguments(x, w, cfg, torch.empty(m, cfg.block_n, device="meta"))
    consts["PDL"] = pdl
    types = {"w_ptr": "*bf16", "x_ptr": "*bf16", "y_ptr": "*bf16", "stride_xm": "i32", "stride_ym": "i32"}
    # the engine's x and y have 16-divisible row strides (triton specialises them at the launch)
    return compile_gluon_sm90(kernel, types, consts, {"num_warps": cfg.num_warps, "launch_pdl": pdl},
                              divisible=("stride_xm", "stride_ym"))


_CUDA_CORE_ROWS = stg.StagedConfig(8, 256, 16, 2)  # the 2-4 row CUDA-core kernel's config in pass102


@pytest.mark.skipif(not can_compile_sm90() or INTERPRETED, reason="needs triton's nvidia backend")
@pytest.mark.parametrize("cfg,k,m", [
    (stg.StagedConfig(8, 512, 8), 8192, 1), (stg.StagedConfig(8, 512, 8), 6144, 1),
    (stg.StagedConfig(8, 512, 4), 3072, 1), (stg.StagedConfig(8, 512, 8), 2048, 1),
    (stg.StagedConfig(8, 512, 1), 1024, 1), (_CUDA_CORE_ROWS, 8192, 4),
    (_CUDA_CORE_ROWS, 8192, 2), (stg.StagedConfig(8, 256, 16, 4), 8192, 4),
    (_CUDA_CORE_ROWS, 9216, 3), (stg.StagedConfig(8, 512, 8, 4), 8192, 4),
    (stg.StagedConfig(16, 256, 8, 4), 6144, 4),
], ids=["o_proj", "o_proj-6144", "ahead-past-end", "all-parked", "one-parked", "verify-4-rows", "2-rows",
        "4-rows-8x256x4", "s21-3-rows", "4-rows-8x512", "4-rows-16x256-6144"])
def test_sm90_stages_are_parked_before_the_pdl_wait(cfg, k, m):
    """Before ``griddepcontrol.wait``: the loads of the parked stages plus four stages ahead (no
    load past the last stage), all ``evict_first`` 16-byte vectors, and the parked stages'
    shared-memory stores; after it x and the remaining stages' loads, then the signal; ``m``
    rows stored; no spills. 2-4 rows: x read from global memory (no shared-memory x), and the
    registers leave room for two programs an SM. Without PDL: no griddepcontrol at all."""
    stages = cfg.stages
    ptx = _build(cfg, k, m=m)
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
    assert after.count("st.global") >= m  # one output row each
    assert max(ptxas_spills(ptx)) == 0
    if m > 1:
        assert before.count("st.shared") == after.count("ld.shared") == parked * per_stage  # weights only
        assert after.count("ld.global") - after.count(evict_first) == m * num_k * cfg.stage_k // 256  # x
        assert max(ptxas_registers(ptx)) * 32 * cfg.num_warps * 2 <= 65536
    assert "griddepcontrol" not in _build(cfg, k, pdl=False, m=m)


@pytest.mark.skipif(not can_compile_sm90() or INTERPRETED, reason="needs triton's nvidia backend")
@pytest.mark.parametrize("k,m,cfg", [
    (8192, 4, None), (8192, 2, None), (9216, 3, None), (6144, 4, None), (8192, 1, None),
    (8192, 4, stg.StagedConfig(16, 64, 16, 4, True)), (4096, 4, stg.StagedConfig(16, 64, 16, 2, True)),
    (3072, 4, None), (8192, 4, stg.StagedConfig(16, 64, 24, 4, True)),
], ids=["o_proj-4", "o_proj-2", "s21-3", "6144-4", "one-row", "64-wide-slices", "2-warps-all-parked",
        "6-stages-4-parked", "24-asked-16-parked"])
def test_sm90_tensor_core_kernel_parks_then_multiplies_on_mma(k, m, cfg):
    """The tensor-core kernel (the default 2-4 row config): before the wait only the parked and
    the four stages ahead of the weight (16-byte evict_first loads) and the parked stages'
    shared-memory stores; after it ldmatrix reads of the parked stages, one mma.sync m16n8k16 a
    warp and 16 columns of a stage, x's loads, the signal, y's stores; no spills."""
    cfg = cfg or stg.default_config(2048, k, 4)
    assert cfg.tensor_cores and cfg.block_n == 16 and k % cfg.stage_cols == 0
    ptx = _build(cfg, k, m=m)
    wait = ptx.index("griddepcontrol.wait")
    before, after = ptx[:wait], ptx[wait:]
    num_k = k // cfg.stage_cols
    per_stage = cfg.block_n * cfg.stage_cols * 2 // 16 // (32 * cfg.num_warps)  # 16-byte loads a thread
    parked = cfg.parked(k)
    assert parked & (parked - 1) == 0 and parked <= min(cfg.stages, num_k)
    evict_first = "ld.global.L1::evict_first.L2::cache_hint.v4"
    assert before.count(evict_first) == before.count("ld.global") == min(parked + 4, num_k) * per_stage
    assert before.count("st.shared") >= parked * per_stage and "ldmatrix" not in before
    assert after.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == num_k * cfg.stage_k // 16
    assert after.count("ldmatrix") >= parked * cfg.stage_k // 16
    assert after.count(evict_first) == max(0, num_k - parked - 4) * per_stage
    assert after.count("ld.global") > after.count(evict_first)  # x
    assert after.index("griddepcontrol.launch_dependents") < after.rindex("st.global")
    assert max(ptxas_spills(ptx)) == 0
    assert "griddepcontrol" not in _build(cfg, k, pdl=False, m=m)


def test_default_config_and_shared_memory():
    assert stg.default_config(2048, 8192) == stg.StagedConfig(8, 512, 8, 4)
    assert stg.default_config(2048, 8192, 4) == stg.StagedConfig(16, 128, 8, 4, True)
    # the tensor-core kernel: 8 parked stages of 16 x (4 x 128) and one stage of scratch
    assert stg.default_config(2048, 8192, 4).smem_bytes(8192, 4) == 9 * 16 * 512 * 2
    assert stg.StagedConfig(16, 64, 16, 4, True).stage_cols == 256
    # the 2-4 row CUDA-core kernel keeps x out of shared memory: only the parked stages
    assert _CUDA_CORE_ROWS.smem_bytes(8192, 4) == 64 * 1024
    assert stg.StagedConfig(8, 256, 16).smem_bytes(8192, 4) == 16 * 8 * 256 * 2
    # S-2.1's o_proj (K = 9216) at 3-4 rows fits; narrower stages divide smaller K
    assert stg.default_config(3072, 9216, 4).smem_bytes(9216, 4) <= stg._MAX_SMEM
    assert stg.default_config(64, 192, 2) == stg.StagedConfig(16, 16, 8, 4, True)  # 192 = 3 x 64
    assert stg.default_config(64, 8, 2).stage_k == 16  # K % stage_cols != 0: supports() refuses it
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
    assert stg.default_config(2048, 8192, 4) == stg.StagedConfig(*stg.MULTI_ROW_CONFIG)  # 2-4 rows: unchanged


def test_gluon_is_detected():
    assert stg._has_gluon() == (HAS_TRITON and _importable("triton.experimental.gluon"))


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def test_cpu_tensors_are_refused_with_a_fix():
    x, w = torch.zeros(1, 256, dtype=torch.bfloat16), torch.zeros(64, 256, dtype=torch.bfloat16)
    assert not stg.supports(w) and not stg.can_use(x, w)
    assert not stg.supports(w, m=0) and not stg.supports(w, m=stg.MAX_M + 1)
    with pytest.raises(ValueError, match="can_use"):
        stg.staged_gemv(x, w)


def _ulps(y: torch.Tensor, want: torch.Tensor) -> float:
    # |y - want| in units of want's bf16 spacing (2^-7 relative), plus a floor for values near 0
    return ((y.float() - want).abs() / (want.abs() * 2.0**-7 + 1e-3)).max().item()


def _emulated(x: torch.Tensor, w: torch.Tensor, cfg: stg.StagedConfig) -> torch.Tensor:
    """:func:`staged_gemv`'s launch run by tests/gluon_emulator.py on the CPU; y starts as NaN,
    so an element no program writes shows."""
    y = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype)
    kernel, grid, args, kwargs = stg._launch_arguments(x, w, cfg, y)
    gluon_emulator.run(kernel, grid, *args, **kwargs)
    return y


@pytest.mark.skipif(not stg._has_gluon(), reason="needs triton's Gluon (triton 3.6)")
@pytest.mark.parametrize("n,k,m,cfg", [
    (64, 8192, 1, None), (32, 6144, 1, None), (64, 1024, 1, None),
    (32, 8192, 1, stg.StagedConfig(16, 512, 6, 8)), (16, 128, 1, stg.StagedConfig(8, 64, 1, 4)),
    (64, 8192, 4, None), (32, 6144, 3, None), (48, 9216, 4, None), (32, 1024, 2, None),
    (32, 8192, 1, stg.StagedConfig(16, 64, 16, 4, True)), (32, 1024, 4, stg.StagedConfig(16, 64, 16, 2, True)),
    (32, 3072, 4, stg.StagedConfig(16, 128, 8, 4, True)),
    (32, 8192, 4, _CUDA_CORE_ROWS), (32, 8192, 2, _CUDA_CORE_ROWS), (48, 9216, 3, _CUDA_CORE_ROWS),
    (32, 6144, 4, stg.StagedConfig(16, 256, 8, 4)), (32, 8192, 4, stg.StagedConfig(8, 512, 8, 4)),
], ids=lambda v: str(v) if not isinstance(v, stg.StagedConfig) else
    f"{v.block_n}x{v.stage_k}-{v.stages}-w{v.num_warps}{'-tc' if v.tensor_cores else ''}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_emulated_kernels_match_the_fp64_reference(n, k, m, cfg, dtype):
    """Each kernel (one row, 2-4 rows on CUDA cores, 1-4 rows on the tensor cores) run on the
    CPU by the Gluon emulation: within one output ulp of the exact sum, every y element written,
    no access outside w, x (a row-strided view: rows past M are outside it) or y."""
    cfg = cfg or stg.default_config(n, k, m)
    g = torch.Generator().manual_seed(n + k + m)
    w = (torch.randn(n, k, generator=g) * 0.02).to(dtype)
    x = torch.randn(m, k + 64, generator=g).to(dtype)[:, :k]  # row stride k + 64
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
@pytest.mark.parametrize("n,k,m,cfg", [
    (2048, 8192, 1, None),
    (2048, 6144, 1, None),
    (2048, 8192, 1, stg.StagedConfig(16, 512, 6, 8)),
    (256, 1024, 1, None),
    (64, 128, 1, stg.StagedConfig(8, 64, 1, 4)),
    (64, 192, 1, None),
    (2048, 8192, 4, None),
    (2048, 6144, 3, None),
    (256, 1024, 2, None),
    (2048, 8192, 4, stg.StagedConfig(8, 256, 8, 4)),
    (2048, 8192, 4, _CUDA_CORE_ROWS),
    (2048, 8192, 1, stg.StagedConfig(16, 64, 16, 4, True)),
    (2048, 8192, 3, stg.StagedConfig(16, 64, 16, 4, True)),
    (256, 1024, 4, stg.StagedConfig(16, 64, 16, 2, True)),
    (2048, 8192, 4, stg.StagedConfig(8, 512, 8, 4)),
    (2048, 6144, 4, stg.StagedConfig(16, 256, 8, 4)),
    (2048, 8192, 2, stg.StagedConfig(8, 256, 16, 4)),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_matches_the_fp64_reference(n, k, m, cfg, dtype):
    """Within one output ulp of the exact sum, bitwise the same on every call and in a graph;
    x rows with a row stride (a view) for m > 1."""
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(dtype)
    x = torch.randn(m, k + 64, device="cuda", generator=g).to(dtype)[:, :k]  # row stride k + 64
    assert stg.can_use(x, w, cfg)
    want = (x.double() @ w.double().T).float()
    y = stg.staged_gemv(x, w, cfg)
    assert y.shape == (m, n) and y.dtype == dtype
    assert _ulps(y, want) <= 1.0
    assert torch.equal(stg.staged_gemv(x, w, cfg), y)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = stg.staged_gemv(x, w, cfg)
    x.copy_(torch.randn(m, k, device="cuda", generator=g).to(dtype))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(yg, stg.staged_gemv(x, w, cfg))  # the replay read the new x


@needs_sm90
@pytest.mark.parametrize("n,k,m", [(3072, k, m) for k in (9216, 6144, 4608, 3072) for m in (1, 2, 3, 4)],
                         ids=lambda v: str(v))
def test_cuda_s21_o_proj_matches_the_fp64_reference(n, k, m):
    """S-2.1's o_proj (hidden 3072 over 72 / 48 heads x 128; 36 / 24 a rank under 2-way TP) on
    the default config, 1-4 rows."""
    test_cuda_matches_the_fp64_reference(n, k, m, None, torch.bfloat16)


@needs_sm90
@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("tokens,cfg", [(1, None), (4, None), (4, _CUDA_CORE_ROWS)],
                         ids=["one-row", "4-rows-tensor-cores", "4-rows-cuda-cores"])
def test_cuda_o_proj_after_attention_reads_this_replays_output(early, tokens, cfg):
    """Q/K kernel -> attention -> split merge -> staged o_proj in one graph, PDL-launched, with
    ``early_signal`` (o_proj resident while attention runs, as the engine launches it) and
    without; one token (decode) and four (the K = 3 verify, each 2-4 row kernel). Every replay
    gets new q/k/v; o_proj must read the merge's output of the same replay (a read before its
    wait would see the previous one): 30 replays, each bitwise against an eager o_proj of the
    attention output the replay left."""
    from test_kernel_paged_attention import NUM_HEADS, make_case

    from laguna_dflash.kernels import paged_attention as pa
    from laguna_dflash.kernels import pdl
    from laguna_dflash.kernels import qk_norm_rope_cache as qnrc

    if not pdl.active(torch.device("cuda"), False):
        pytest.skip("needs programmatic dependent launch")
    dtype, kv_heads, head_dim = torch.bfloat16, 2, 128
    _, kc, vc, meta, _ = make_case([(700, tokens)], kv_heads, head_dim, dtype, True, device="cuda", seed=3)
    g = torch.Generator(device="cuda").manual_seed(3)
    qkv = torch.randn(tokens, (NUM_HEADS + 2 * kv_heads) * head_dim, device="cuda", generator=g).to(dtype)
    qw = torch.ones(head_dim, device="cuda", dtype=dtype)
    angles = torch.arange(1024, device="cuda")[:, None] * torch.rand(head_dim, device="cuda", generator=g)
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    w = (torch.randn(512, NUM_HEADS * head_dim, device="cuda", generator=g) * 0.02).to(dtype)
    assert stg.supports(w, cfg, m=tokens)

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        q = qnrc.qk_norm_rope_cache(qkv, NUM_HEADS, kv_heads, head_dim, qw, qw, 1e-6, cos, sin,
                                    meta.positions, head_dim, meta.slot_mapping, kc, vc)
        out = pa.paged_attention(q, kc, vc, meta.query_index, meta.query_positions, meta.key_slots,
                                 meta.seq_lens, scale=head_dim ** -0.5, causal=True, num_splits=4,
                                 early_signal=early)
        return out, stg.staged_gemv(out.reshape(tokens, -1), w, cfg)

    forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, y = forward()
    for _ in range(30):
        qkv.copy_(torch.randn(qkv.shape, device="cuda", generator=g).to(dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, stg.staged_gemv(out.reshape(tokens, -1), w, cfg))
