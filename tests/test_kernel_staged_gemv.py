"""kernels/staged_gemv.py: the batch-1 GEMV whose weight stages are requested before the PDL wait.

Gluon has no interpreter: on the CPU the sm_90 build is checked offline (what is issued before
``griddepcontrol.wait``, no spills); on a GPU the values against an fp64 reference, determinism,
CUDA-graph replays, and the attention -> merge -> o_proj chain with early signals (a race would
read the previous replay's attention output).
"""

from __future__ import annotations

import pytest
import torch
from interpreter_child import HAS_TRITON, INTERPRETED
from ptx_sm90 import can_compile_sm90, compile_gluon_sm90, ptxas_spills

from laguna_dflash.kernels import staged_gemv as stg

needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0) or not HAS_TRITON,
    reason="needs a CUDA sm_90+ device and triton")


def _build(cfg: stg.StagedConfig, k: int, pdl: bool = True) -> str:
    from triton.experimental.gluon import language as gl

    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    types = {"w_desc": f"tensordesc<bf16[{cfg.block_n}, {cfg.box_k}],{layout!r}>",
             "x_ptr": "*bf16", "y_ptr": "*bf16"}
    consts = dict(BLOCK_N=cfg.block_n, BOX_K=cfg.box_k, BOXES=cfg.boxes, STAGES=cfg.stages,
                  NUM_K=k // (cfg.boxes * cfg.box_k), X_ROWS=stg._next_pow2(k // cfg.box_k), PDL=pdl,
                  num_warps=cfg.num_warps)
    return compile_gluon_sm90(stg._gluon()[0], types, consts, {"num_warps": cfg.num_warps, "launch_pdl": pdl})


@pytest.mark.skipif(not can_compile_sm90() or INTERPRETED, reason="needs triton's nvidia backend")
@pytest.mark.parametrize("cfg,k", [
    (stg.StagedConfig(), 8192),                      # o_proj: 8 stages, 4 in the ring
    (stg.StagedConfig(16, 256, 2, 12, 4), 8192),     # 16 stages, 12 before the wait
    (stg.StagedConfig(8, 64, 1, 4, 4), 128),         # fewer stages than the ring
    (stg.StagedConfig(), 6144),                      # 6 stages, x padded to 32 boxes
], ids=["o_proj", "deep-ring", "short-k", "o_proj-6144"])
def test_sm90_weight_stages_are_requested_before_the_pdl_wait(cfg, k):
    """Before ``griddepcontrol.wait``: exactly the ring's first ``min(stages, K / stage)`` stages
    of TMA copies (``boxes`` each) and no other global load; x is read after it; the dependents
    are signalled after the last copy is consumed; no spills. Without PDL: no griddepcontrol."""
    ptx = _build(cfg, k)
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.count("griddepcontrol.wait") == 1
    before, after = ptx[:wait], ptx[wait:]
    num_stages_k = k // (cfg.boxes * cfg.box_k)
    assert before.count("cp.async.bulk.tensor") == min(cfg.stages, num_stages_k) * cfg.boxes
    assert "ld.global" not in before
    assert after.count("cp.async.bulk.tensor") == max(0, num_stages_k - cfg.stages) * cfg.boxes
    assert "ld.global" in after  # x
    assert after.rindex("mbarrier.try_wait") < after.index("griddepcontrol.launch_dependents")
    assert max(ptxas_spills(ptx)) == 0
    assert "griddepcontrol" not in _build(cfg, k, pdl=False)


@pytest.mark.skipif(not can_compile_sm90() or INTERPRETED, reason="needs triton's nvidia backend")
@pytest.mark.parametrize("stages,num_k", [(8, 16), (4, 6), (4, 2)])
def test_sm90_ld_st_parks_its_stages_before_the_pdl_wait(stages, num_k):
    """``mode="ld_st"``: before the wait, the loads of the parked stages plus four stages ahead
    (all ``evict_first``, 16-byte vectors; none past the last stage) and the parked stages'
    shared-memory stores; after it x and the remaining stages' loads; no spills."""
    cfg = stg.StagedConfig(8, 256, 2, stages, 4, "ld_st")
    stage_k = 512
    consts = dict(K=num_k * stage_k, BLOCK_N=8, STAGE_K=stage_k, STAGES=stages, NUM_K=num_k,
                  X_ROWS=stg._next_pow2(num_k), PDL=True, num_warps=cfg.num_warps)
    ptx = compile_gluon_sm90(stg._gluon()[2], {"w_ptr": "*bf16", "x_ptr": "*bf16", "y_ptr": "*bf16"},
                             consts, {"num_warps": 4, "launch_pdl": True})
    wait = ptx.index("griddepcontrol.wait")
    before, after = ptx[:wait], ptx[wait:]
    loads_per_stage = 8 * stage_k * 2 // 16 // 128  # 16-byte loads a thread
    pre = min(stages, num_k)
    ahead = min(pre + 4, num_k)
    assert before.count("ld.global.L1::evict_first.L2::cache_hint.v4") == ahead * loads_per_stage
    assert before.count("ld.global") == ahead * loads_per_stage
    assert before.count("st.shared") >= pre * loads_per_stage
    assert after.count("ld.global.L1::evict_first") == (num_k - ahead) * loads_per_stage
    assert "ld.global" in after.replace("ld.global.L1::evict_first", "")  # x
    assert max(ptxas_spills(ptx)) == 0


def test_default_config_divides_the_shapes():
    assert stg.default_config(2048, 8192) == stg.StagedConfig(8, 256, 4, 4, 4)
    for k in (64, 128, 192, 256, 512, 2048, 6144):
        cfg = stg.default_config(64, k)
        assert k % (cfg.boxes * cfg.box_k) == 0 and cfg.box_k >= 64
    assert stg.StagedConfig().smem_bytes(8192) == (4 * 4 * 8 * 256 + 8192) * 2
    assert stg.StagedConfig().smem_bytes(6144) == (4 * 4 * 8 * 256 + 8192) * 2  # x padded


def test_cpu_tensors_are_refused_with_a_fix():
    x, w = torch.zeros(1, 256, dtype=torch.bfloat16), torch.zeros(64, 256, dtype=torch.bfloat16)
    assert not stg.can_use(x, w)
    with pytest.raises(ValueError, match="can_use"):
        stg.staged_gemv(x, w)


def _ulps(y: torch.Tensor, want: torch.Tensor) -> float:
    # |y - want| in units of want's bf16 spacing (2^-7 relative), plus a floor for values near 0
    return ((y.float() - want).abs() / (want.abs() * 2.0**-7 + 1e-3)).max().item()


@needs_sm90
@pytest.mark.parametrize("n,k,cfg", [
    (2048, 8192, None),
    (2048, 8192, stg.StagedConfig(16, 256, 2, 12, 4)),
    (2048, 8192, stg.StagedConfig(16, 256, 4, 6, 8)),
    (2048, 6144, None),
    (2048, 8192, stg.StagedConfig(8, 256, 2, 8, 4, "cp_async")),
    (2048, 8192, stg.StagedConfig(8, 256, 2, 8, 4, "ld_st")),
    (2048, 6144, stg.StagedConfig(8, 256, 4, 4, 4, "ld_st")),
    (64, 128, stg.StagedConfig(8, 64, 1, 4, 4, "ld_st")),
    (64, 128, stg.StagedConfig(8, 64, 1, 1, 4, "ld_st")),
    (256, 1024, None),
    (64, 128, stg.StagedConfig(8, 64, 1, 4, 4)),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_matches_the_fp64_reference(n, k, cfg, dtype):
    """Within one output ulp of the exact sum, bitwise the same on every call and in a graph."""
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(dtype)
    x = torch.randn(1, k, device="cuda", generator=g).to(dtype)
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
@pytest.mark.parametrize("mode", ["tma", "ld_st"])
@pytest.mark.parametrize("early", [False, True])
def test_cuda_o_proj_after_attention_reads_this_replays_output(early, mode, monkeypatch):
    """Q/K kernel -> attention -> split merge -> staged o_proj in one graph, PDL-launched, with
    ``paged_attention.EARLY_SIGNAL`` (o_proj resident while attention runs) and without. Every
    replay gets new q/k/v; o_proj must read the merge's output of the same replay (a read before
    its wait would see the previous one): 30 replays, each bitwise against an eager o_proj of the
    attention output the replay left."""
    from test_kernel_paged_attention import NUM_HEADS, make_case

    from laguna_dflash.kernels import paged_attention as pa
    from laguna_dflash.kernels import pdl
    from laguna_dflash.kernels import qk_norm_rope_cache as qnrc

    if not pdl.active(torch.device("cuda"), False):
        pytest.skip("needs programmatic dependent launch")
    monkeypatch.setattr(pa, "EARLY_SIGNAL", early)
    monkeypatch.setattr(stg, "DEFAULT_MODE", mode)
    dtype, kv_heads, head_dim = torch.bfloat16, 2, 128
    _, kc, vc, meta, _ = make_case([(700, 1)], kv_heads, head_dim, dtype, True, device="cuda", seed=3)
    g = torch.Generator(device="cuda").manual_seed(3)
    qkv = torch.randn(1, (NUM_HEADS + 2 * kv_heads) * head_dim, device="cuda", generator=g).to(dtype)
    qw = torch.ones(head_dim, device="cuda", dtype=dtype)
    angles = torch.arange(1024, device="cuda")[:, None] * torch.rand(head_dim, device="cuda", generator=g)
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    w = (torch.randn(512, NUM_HEADS * head_dim, device="cuda", generator=g) * 0.02).to(dtype)
    assert stg.can_use(torch.empty(1, NUM_HEADS * head_dim, device="cuda", dtype=dtype), w)

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        q = qnrc.qk_norm_rope_cache(qkv, NUM_HEADS, kv_heads, head_dim, qw, qw, 1e-6, cos, sin,
                                    meta.positions, head_dim, meta.slot_mapping, kc, vc)
        out = pa.paged_attention(q, kc, vc, meta.query_index, meta.query_positions, meta.key_slots,
                                 meta.seq_lens, scale=head_dim ** -0.5, causal=True, num_splits=4)
        return out, stg.staged_gemv(out.reshape(1, -1), w)

    forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, y = forward()
    for _ in range(30):
        qkv.copy_(torch.randn(qkv.shape, device="cuda", generator=g).to(dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, stg.staged_gemv(out.reshape(1, -1), w))
