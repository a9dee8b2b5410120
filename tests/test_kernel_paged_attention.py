"""Triton paged attention (``kernels/paged_attention.py``, ``engine/triton_attention.py``).

``TritonPagedBackend.attend`` must equal ``TorchSDPABackend.attend`` on identical random caches and
metadata built by the engine's own ``build_metadata`` (random, non-contiguous block tables, block
size 16, a sentinel in the scratch block):

* under Triton's CPU interpreter (``TRITON_INTERPRET=1``, in ONE child pytest so the variable never
  reaches other tests): decode (Q=1), verify (Q=4, 8), the DFlash drafter block (Q=8
  bidirectional), mixed batches (prefill chunk + decode + verify, different context lengths),
  sliding window (causal and bidirectional), sinks, the per-layer causality override, split-K,
  GQA ratios 1/4/8 x head_dim 64/128, fp32 (tight) and bf16 (loose); the in-kernel split-K merge
  (``MERGE_IN_KERNEL``) bitwise equal to the two-launch one, its counters re-armed;
* without a GPU: the compiled (non-interpreter) kernel builds for sm_90 with ptxas, unspilled, also
  with the in-kernel merge (its loads through L2, no barrier per split, after the PDL signal);
* on CUDA (skipped without one): the same cases, long contexts with split-K, CUDA-graph capture and
  replay on new metadata, no host sync, the in-kernel merge bitwise equal to the two-launch one
  (eagerly and replayed in a graph), and a timing table vs the SDPA reference (``-s`` shows it).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess

import pytest
import torch
from interpreter_child import HAS_TRITON, INTERPRETED, interpreted, run_interpreted_child
from ptx_sm90 import loads_before_pdl_wait

from laguna_dflash.engine import attention
from laguna_dflash.engine.attention import AttentionMetadata, TorchSDPABackend
from laguna_dflash.engine.runner import ForwardItem, build_metadata
from laguna_dflash.engine.triton_attention import TritonPagedBackend, register
from laguna_dflash.kernels import paged_attention as pa

HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON) or INTERPRETED, reason="needs CUDA and triton")

TOL = {torch.float32: {"rtol": 2e-5, "atol": 2e-5},
       torch.bfloat16: {"rtol": 3e-2, "atol": 3e-2}}  # a few bf16 ulps of outputs ~1
BLOCK_SIZE = 16
NUM_HEADS = 8
SENTINEL = 1e3  # scratch block contents: visible in the output if a masked key leaked in


def make_case(specs: list[tuple[int, int]], kv_heads: int, head_dim: int, dtype: torch.dtype,
              causal: bool, device: str = "cpu", num_heads: int = NUM_HEADS, seed: int = 0,
              num_blocks: int | None = None):
    """Random caches + metadata for requests ``(context_len, num_tokens)``: the new tokens sit at
    positions ``context_len ..`` and see ``seq_len = context_len + num_tokens`` keys.

    Returns (q [T, H, D] as a strided view, k_cache, v_cache, meta, items)."""
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-(c + n) // BLOCK_SIZE) for c, n in specs)
    num_blocks = num_blocks or need + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered, non-monotonic tables
    items = []
    for ctx, n in specs:
        nb = -(-(ctx + n) // BLOCK_SIZE)
        items.append(ForwardItem(num_tokens=n, start_pos=ctx, seq_len=ctx + n,
                                 block_table=[perm.pop() for _ in range(nb)]))
    scratch_slot = num_blocks * BLOCK_SIZE
    meta = build_metadata(items, BLOCK_SIZE, scratch_slot, torch.device(device), is_causal=causal)
    shape = ((num_blocks + 1) * BLOCK_SIZE, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    k_cache[scratch_slot:] = SENTINEL
    v_cache[scratch_slot:] = SENTINEL
    t = meta.num_tokens
    # q as the model makes it: a view into a wider projection output (row stride != H * D)
    qkv = torch.randn(t, num_heads * head_dim + 2 * kv_heads * head_dim, generator=g).to(dtype).to(device)
    q = qkv[:, : num_heads * head_dim].view(t, num_heads, head_dim)
    return q, k_cache.to(device), v_cache.to(device), meta, items


class _NoFallback(TorchSDPABackend):
    def attend(self, *args, **kwargs):
        pytest.fail("TritonPagedBackend fell back to the torch reference where the kernel is available")


def compare(q, k_cache, v_cache, meta: AttentionMetadata, *, window=None, sinks=None, is_causal=None,
            num_splits=None, block_n=None, tol=None, gate=None) -> float:
    scale = q.shape[-1] ** -0.5
    kwargs = {"scale": scale, "sliding_window": window, "sinks": sinks, "is_causal": is_causal,
              "gate": gate}
    want = TorchSDPABackend().attend(q, k_cache, v_cache, meta, **kwargs)
    backend = TritonPagedBackend(num_splits=num_splits, block_n=block_n)
    if pa.is_available(q.device):  # the interpreter child and CUDA: the kernel must run
        backend.fallback = _NoFallback()
    got = backend.attend(q, k_cache, v_cache, meta, **kwargs)
    assert got.shape == want.shape and got.dtype == q.dtype
    assert torch.isfinite(got).all()
    tol = dict(tol or TOL[q.dtype])
    # outputs are softmax averages of N(0, 1) values: over long contexts they shrink, so the
    # absolute tolerance scales with the reference's magnitude (a dropped key must still show)
    tol["atol"] *= min(1.0, want.abs().amax().item())
    torch.testing.assert_close(got, want, **tol)
    return (got.float() - want.float()).abs().max().item()


# (id, [(context_len, num_tokens)], causal, window, sinks, kv_heads, head_dim, num_splits)
CASES = [
    ("decode", [(5, 1), (37, 1), (80, 1), (130, 1)], True, None, False, 1, 128, None),
    ("verify4", [(3, 4), (40, 4), (77, 4)], True, None, False, 2, 64, None),
    ("verify8", [(0, 8), (21, 8), (64, 8), (100, 8)], True, None, False, 1, 128, None),
    ("draft_block8", [(9, 8), (50, 8), (120, 8)], False, None, False, 2, 128, None),
    ("mixed_causal", [(0, 20), (37, 1), (12, 8), (70, 4)], True, None, False, 2, 64, None),
    ("mixed_block", [(0, 8), (33, 5), (90, 8)], False, None, False, 8, 64, None),
    ("window_causal", [(0, 20), (37, 1), (12, 8), (70, 4)], True, 16, False, 2, 64, None),
    ("window_bidir", [(9, 8), (50, 8), (120, 8)], False, 8, False, 1, 128, None),
    ("window_bidir_narrow", [(9, 8), (50, 16), (0, 16)], False, 3, False, 1, 64, None),  # W < Q, 2 q-tiles
    ("sinks_window_causal", [(3, 4), (40, 4), (77, 1)], True, 16, True, 2, 128, None),
    ("sinks_causal", [(0, 20), (45, 8)], True, None, True, 8, 64, None),
    ("sinks_bidir", [(9, 8), (50, 8)], False, None, True, 2, 64, None),
    ("split2_decode", [(200, 1), (37, 1), (150, 1)], True, None, True, 1, 128, 2),
    ("split3_verify", [(150, 8), (60, 4)], True, None, False, 2, 64, 3),
    ("split3_block_window", [(140, 8), (10, 8)], False, 24, True, 2, 64, 3),
]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_interpreted_matches_sdpa(case, dtype):
    name, specs, causal, window, has_sinks, kv_heads, head_dim, splits = case
    q, kc, vc, meta, _ = make_case(specs, kv_heads, head_dim, dtype, causal, seed=len(name))
    sinks = torch.randn(NUM_HEADS, generator=torch.Generator().manual_seed(3)) * 2 if has_sinks else None
    compare(q, kc, vc, meta, window=window, sinks=sinks, num_splits=splits, block_n=16)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_heads", [8, 2, 1], ids=["gqa1", "gqa4", "gqa8"])
def test_interpreted_gqa_head_dim(kv_heads, head_dim, dtype):
    """A mixed causal batch over the GQA ratios 1 / 4 / 8 and head_dim 64 / 128 (default tile)."""
    q, kc, vc, meta, _ = make_case([(0, 12), (70, 1), (21, 8)], kv_heads, head_dim, dtype, True,
                                   seed=kv_heads + head_dim)
    compare(q, kc, vc, meta)


def _gate_cases(device: str = "cpu"):
    """(q, caches, meta, gate) with per-head and per-element gates; the per-head logits are a
    column slice of a wider projection (as the engine passes them), covering softplus's tails."""
    q, kc, vc, meta, _ = make_case([(5, 1), (150, 1), (40, 4)], 2, 64, torch.float32, True, device=device)
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(q.shape[0], NUM_HEADS + 3, generator=g) * 6
    wide[0, :3] = torch.tensor([-30.0, 25.0, 0.0])  # e^g below 1e-4, above the threshold, 0
    per_element = torch.randn(q.shape[0], NUM_HEADS, q.shape[2], generator=g)
    return q, kc, vc, meta, wide[:, 1 : NUM_HEADS + 1].to(device), per_element.to(device)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("splits", [1, 3])
def test_interpreted_output_gate(splits, dtype):
    """``gate`` multiplies by softplus in the store (split or not) as the torch reference does."""
    q, kc, vc, meta, per_head, per_element = _gate_cases()
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    for gate in (per_head, per_element.to(dtype)):
        compare(q, kc, vc, meta, gate=gate, num_splits=splits, block_n=16)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("splits", [1, 3])
def test_cuda_output_gate(splits, dtype):
    q, kc, vc, meta, per_head, per_element = _gate_cases("cuda")
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    for gate in (per_head, per_element.to(dtype)):
        compare(q, kc, vc, meta, gate=gate, num_splits=splits)


@interpreted
def test_interpreted_strided_seq_lens():
    """Metadata columns of a wider state buffer (as the CUDA-graph runner holds them) give the
    same result as contiguous ones."""
    q, kc, vc, meta, _ = make_case([(5, 1), (150, 1), (40, 1)], 2, 64, torch.float32, True)
    state = torch.stack([meta.seq_lens, torch.zeros_like(meta.seq_lens)], dim=1)
    meta.seq_lens = state[:, 0]
    assert not meta.seq_lens.is_contiguous()
    compare(q, kc, vc, meta, num_splits=2, block_n=16)


@interpreted
def test_interpreted_causality_override_and_group_padding():
    """The per-layer ``is_causal`` override beats ``meta.is_causal`` both ways; a GQA group of 3
    (rows not a power of two) and head_dim 80 (padded to a 128-wide tile)."""
    q, kc, vc, meta, _ = make_case([(9, 8), (40, 3)], 2, 64, torch.float32, causal=True)
    compare(q, kc, vc, meta, is_causal=False, block_n=16)
    q, kc, vc, meta, _ = make_case([(9, 8), (40, 3)], 2, 80, torch.float32, causal=False, num_heads=6)
    compare(q, kc, vc, meta, is_causal=True, window=5, block_n=16)
    compare(q, kc, vc, meta, block_n=32)


# (id, [(context_len, num_tokens)], causal, window, sinks, gate, kv_heads, group, head_dim, dtype,
#  num_splits asked, num_splits run) with 16-key tiles
MERGE_CASES = [
    # batch-1-like decode, 16 splits; the second request's 41 keys leave splits 3..15 without a key
    ("decode_g8_s16_sinks", [(250, 1), (40, 1)], True, None, True, False, 1, 8, 64, torch.float32, 16, 16),
    ("decode_g6_s3_gate", [(150, 1), (37, 1), (90, 1)], True, None, False, True, 2, 6, 128, torch.bfloat16,
     3, 3),
    ("verify4_g8_s2_sinks_gate", [(60, 4), (13, 4)], True, None, True, True, 1, 8, 64, torch.bfloat16, 2, 2),
    # DFlash block: 16 bidirectional queries, group 6 -> 10 queries a tile, 2 query tiles
    ("block16_g6_s3_window_sinks_gate", [(40, 16), (100, 16)], False, 24, True, True, 1, 6, 64, torch.float32,
     3, 3),
    ("window_decode_g8_s16_gate", [(200, 1), (120, 1)], True, 40, False, True, 2, 8, 64, torch.float32, 16, 13),
]


def _merge_case(case):
    """(q, caches, meta, paged_attention args, kwargs, backend kwargs) of one ``MERGE_CASES`` row."""
    name, specs, causal, window, has_sinks, has_gate, kv_heads, group, head_dim, dtype, splits, run = case
    num_heads = kv_heads * group
    q, kc, vc, meta, _ = make_case(specs, kv_heads, head_dim, dtype, causal, num_heads=num_heads, seed=len(name))
    g = torch.Generator().manual_seed(7)
    sinks = torch.randn(num_heads, generator=g) * 2 if has_sinks else None
    gate = (torch.randn(q.shape[0], num_heads + 1, generator=g) * 4)[:, 1:] if has_gate else None  # strided
    lmax = meta.key_slots.shape[1]
    keys_per_split = -(-lmax // splits)
    split_len = -(-keys_per_split // 16) * 16
    assert -(-lmax // split_len) == run  # the split count the case means to exercise
    args = (q, kc, vc, meta.query_index, meta.query_positions, meta.key_slots, meta.seq_lens)
    kwargs = dict(scale=head_dim ** -0.5, causal=causal, sliding_window=window, sinks=sinks, gate=gate,
                  num_splits=splits, block_n=16)
    return q, kc, vc, meta, args, kwargs


def _poison_empty(monkeypatch) -> None:
    """``torch.empty`` / ``empty_like`` hand out NaN-filled float tensors: the split partials of
    a call never hold the previous call's values (the CPU allocator reuses freed blocks), so a
    merge that reads a split before it is written shows."""
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(fn):
        def make(*args, **kwargs):
            t = fn(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        return make

    monkeypatch.setattr(torch, "empty", poisoned(empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(empty_like))


@interpreted
@pytest.mark.parametrize("case", MERGE_CASES, ids=[c[0] for c in MERGE_CASES])
def test_interpreted_merge_in_kernel_is_bitwise_the_two_launch_merge(case, monkeypatch):
    """``MERGE_IN_KERNEL``: the split-K merge in the attention launch (last-arriving program of
    each tile) gives the two-launch path's bits, launches no merge kernel, and matches SDPA."""
    q, kc, vc, meta, args, kwargs = _merge_case(case)
    _poison_empty(monkeypatch)
    monkeypatch.setattr(pa, "MERGE_IN_KERNEL", False)
    two_launches = pa.paged_attention(*args, **kwargs)
    monkeypatch.setattr(pa, "MERGE_IN_KERNEL", True)
    attn_kernel = pa._kernels(True)[0]
    monkeypatch.setattr(pa, "_kernels", lambda interpret: (attn_kernel, None))  # no merge launch
    one_launch = pa.paged_attention(*args, **kwargs)
    assert torch.equal(one_launch, two_launches)
    compare(q, kc, vc, meta, window=kwargs["sliding_window"], sinks=kwargs["sinks"], gate=kwargs["gate"],
            is_causal=kwargs["causal"], num_splits=kwargs["num_splits"], block_n=16)


@interpreted
def test_interpreted_merge_in_kernel_rearms_its_counters(monkeypatch):
    """The last program of each tile resets its arrival counter: after a call every counter is 0
    (a CUDA graph can replay the launch), so consecutive calls agree bit for bit; a bigger grid
    grows the buffer and keeps the old one (a captured graph may still point at it)."""
    monkeypatch.setattr(pa, "MERGE_IN_KERNEL", True)
    monkeypatch.setattr(pa, "_COUNTERS", {})
    monkeypatch.setattr(pa, "_RETIRED_COUNTERS", [])
    monkeypatch.setattr(pa, "_MIN_COUNTERS", 2)
    cpu = torch.device("cpu")
    for specs, size in (([(100, 1)], 2), ([(100, 1), (40, 1), (70, 1)], 8)):  # 1 x 2 then 3 x 2 tiles
        q, kc, vc, meta, _ = make_case(specs, 2, 64, torch.float32, True)
        args = (q, kc, vc, meta.query_index, meta.query_positions, meta.key_slots, meta.seq_lens)
        outs = [pa.paged_attention(*args, scale=0.125, causal=True, num_splits=4, block_n=16) for _ in range(2)]
        assert torch.equal(outs[0], outs[1])
        assert pa._COUNTERS[cpu].numel() == size and not pa._COUNTERS[cpu].any()
    assert len(pa._RETIRED_COUNTERS) == 1 and not pa._RETIRED_COUNTERS[0].any()


@interpreted
def test_interpreted_is_available():
    assert pa.is_available("cpu")


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="triton not installed / already the child")
def test_kernel_under_triton_interpreter():
    run_interpreted_child(__file__, timeout=600)


# ---- without a GPU -----------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="triton not installed / interpreter on")
def test_cpu_without_interpreter_falls_back_to_sdpa():
    assert not pa.is_available("cpu")
    q, kc, vc, meta, _ = make_case([(5, 3), (20, 1)], 2, 64, torch.float32, True)
    backend = TritonPagedBackend()
    got = backend.attend(q, kc, vc, meta, scale=0.125, sliding_window=4)
    want = TorchSDPABackend().attend(q, kc, vc, meta, scale=0.125, sliding_window=4)
    assert torch.equal(got, want)


def test_register_exposes_triton_backend(monkeypatch):
    monkeypatch.setattr(attention, "_BACKENDS", dict(attention._BACKENDS))  # restored afterwards
    with pytest.raises(ValueError, match="unknown"):
        attention.get_attention_backend("flash")
    register()
    assert isinstance(attention.get_attention_backend("triton"), TritonPagedBackend)
    assert isinstance(attention.get_attention_backend("auto"), TorchSDPABackend)


def test_rejects_bad_inputs():
    q, kc, vc, meta, _ = make_case([(5, 3)], 2, 64, torch.float32, True)
    args = (meta.query_index, meta.query_positions, meta.key_slots, meta.seq_lens)
    with pytest.raises(ValueError, match="GQA"):
        pa.paged_attention(q[:, :3], kc, vc, *args, scale=1.0, causal=True)
    with pytest.raises(ValueError, match="sinks"):
        pa.paged_attention(q, kc, vc, *args, scale=1.0, causal=True, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="block_n"):
        pa.paged_attention(q, kc, vc, *args, scale=1.0, causal=True, block_n=24)


def _aot_sm90(kernel, consts: dict, ptr_types: dict, aligned: tuple[str, ...], num_warps: int,
              pdl: bool = False):
    """Compile ``kernel`` ahead of time for sm_90 (no GPU needed) with the specialisations a real
    launch gets (unit strides as constants, 16-aligned pointers and strides); ptxas -v on the PTX
    -> (compiled kernel, spill-store bytes per function)."""
    import re
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        signature[name] = ptr_types.get(name, "fp32" if name == "scale_log2" else "i32")
        if name.endswith("_ptr") or name in aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": 2, "launch_pdl": pdl})
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(compiled.asm["ptx"])
        proc = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", path + ".o"],
                              capture_output=True, text=True, check=True)
    return compiled, [int(x) for x in re.findall(r"(\d+) bytes spill stores", proc.stderr)]


def _sm90_builds(dtype: str, head_dim: int, group: int, qmax: int, splits: int, causal: bool,
                 window: bool, sinks: bool, pdl: bool = False, prefetch: bool = False,
                 preload: bool = True, merge: bool = False):
    """The attention kernel (and the merge kernel with split-K, unless ``merge``: the in-kernel
    merge, ``MERGE_IN_KERNEL``) as ``paged_attention`` launches them."""
    attn, merge_kernel = pa._kernels(False)
    merge = merge and splits > 1
    block_q = pa._block_q(qmax, group)
    block_m = max(16, pa._next_pow2(block_q * group))
    consts = dict(NUM_HEADS=group * 4, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_Q=block_q,
                  BLOCK_M=block_m, BLOCK_N=64, CAUSAL=causal, HAS_WINDOW=window, HAS_SINKS=sinks,
                  NUM_SPLITS=splits, IEEE=dtype == "fp32", DYNAMIC_LOOP=True, SPLIT_TILES=0,
                  HAS_GATE=splits == 1 or merge,  # the engine gates Laguna's output in the last store
                  PDL=pdl, PREFETCH=256 if prefetch else 0, PRELOAD=preload,
                  MERGE_IN_KERNEL=merge,
                  MERGE_BLOCK_D=pa._merge_block_d(block_m, head_dim) if merge else head_dim)
    consts.update({n: 1 for n in ("stride_qd", "stride_kc_d", "stride_vc_d", "stride_od",
                                  "stride_qi_q", "stride_qp_q", "stride_ks_j")})
    ptrs = {n: f"*{dtype}" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "sinks_ptr", "gate_ptr",
                                     "prefetch_ptr")}
    ptrs.update(prefetch_nbytes="i64", prefetch_chunk="i64")
    ptrs.update({n: "*i64" for n in ("query_index_ptr", "query_pos_ptr", "key_slots_ptr", "seq_lens_ptr")})
    ptrs.update({n: "*fp32" for n in ("part_acc_ptr", "part_m_ptr", "part_l_ptr")})
    ptrs.update(counter_ptr="*i32")
    builds = [_aot_sm90(attn, consts, ptrs, ("stride_qt", "stride_qh", "stride_kc_s", "stride_kc_h",
                                             "stride_vc_s", "stride_vc_h", "stride_ot", "stride_oh"),
                        pa._num_warps(block_m, head_dim), pdl)]
    if splits > 1 and not merge:
        mconsts = dict(NUM_HEADS=group * 4, HEAD_DIM=head_dim, BLOCK_D=head_dim, NUM_SPLITS=splits,
                       HAS_SINKS=sinks, stride_od=1, HAS_GATE=True, PDL=pdl)
        builds.append(_aot_sm90(merge_kernel, mconsts, ptrs, ("stride_ot", "stride_oh", "stride_gt"),
                                1 if head_dim <= 64 else 2, pdl))
    return builds


_PTXAS = HAS_TRITON and os.path.exists(os.path.join(
    os.path.dirname(importlib.util.find_spec("triton").origin), "backends", "nvidia", "bin", "ptxas"))


@pytest.mark.skipif(not _PTXAS or INTERPRETED, reason="needs triton's nvidia backend (ptxas)")
@pytest.mark.parametrize("cfg", [
    ("bf16", 128, 8, 1, 1, True, False, True),    # decode, GQA 8, sinks
    ("bf16", 128, 8, 8, 4, True, True, True),     # verify, split-K, window
    ("bf16", 128, 1, 64, 1, False, True, False),  # drafter block / prefill tile, bidirectional SWA
    ("bf16", 64, 4, 16, 1, False, False, False),
], ids=lambda c: "-".join(map(str, c)))
def test_compiles_for_sm90_without_spills(cfg):
    """The compiled path (dynamic key loop) is not what the interpreter runs: check it builds."""
    builds = _sm90_builds(*cfg)
    assert len(builds) == (2 if cfg[4] > 1 else 1)
    for compiled, spills in builds:
        assert "cubin" in compiled.asm
        assert spills and max(spills) == 0, spills


@pytest.mark.skipif(not _PTXAS or INTERPRETED, reason="needs triton's nvidia backend (ptxas)")
def test_sm90_programmatic_dependent_launch_order():
    """With ``kernels.pdl.USE_PDL`` (rules in kernels/pdl.py) the merge kernel waits for its
    inputs before any global load and signals its dependents after the wait; the attention
    kernel, with ``PRELOAD_OLD_KEYS``, reads only through L2 (``.cg``: metadata, key slots, the
    K/V before the first query) before its wait and q after it; without the preload it loads
    nothing before the wait. Without PDL neither instruction is emitted."""
    cfg = ("bf16", 128, 8, 1, 4, True, False, True)  # batch-1 decode with split-K and sinks
    for compiled, _ in _sm90_builds(*cfg):
        assert "griddepcontrol" not in compiled.asm["ptx"]
    (attn, attn_spills), (merge, merge_spills) = _sm90_builds(*cfg, pdl=True)
    ptx = attn.asm["ptx"]
    before_wait = loads_before_pdl_wait(ptx)
    assert before_wait and all("ld.global.cg" in line for line in before_wait), before_wait
    after_wait = ptx[ptx.index("griddepcontrol.wait"):].splitlines()
    assert any("ld.global" in line and ".cg" not in line for line in after_wait)  # q
    assert loads_before_pdl_wait(merge.asm["ptx"]) == []
    (plain, plain_spills), _ = _sm90_builds(*cfg, pdl=True, preload=False)
    assert loads_before_pdl_wait(plain.asm["ptx"]) == []
    for spills in (attn_spills, merge_spills, plain_spills):
        assert spills and max(spills) == 0, spills


@pytest.mark.skipif(not _PTXAS or INTERPRETED, reason="needs triton's nvidia backend (ptxas)")
def test_sm90_l2_prefetch_is_issued_before_the_pdl_wait():
    """With a weight to prefetch (kernels/l2_prefetch.py) the attention kernel issues TMA bulk
    L2 prefetches, each predicated on a non-empty chunk, before its PDL wait (the weight is
    never written: rule 3 of kernels/pdl.py) and no other global access there; without one it
    issues none. Still no spills."""
    cfg = ("bf16", 128, 8, 1, 4, True, False, True)  # batch-1 decode with split-K and sinks
    attn, _ = _sm90_builds(*cfg, pdl=True)
    assert "prefetch" not in attn[0].asm["ptx"]
    (compiled, spills), _ = _sm90_builds(*cfg, pdl=True, prefetch=True)
    ptx = compiled.asm["ptx"]
    before_wait = loads_before_pdl_wait(ptx)
    prefetches = [line for line in before_wait if "cp.async.bulk.prefetch.L2.global" in line]
    assert prefetches and all("ld.global.cg" in line for line in before_wait if line not in prefetches)
    assert ptx.count("cp.async.bulk.prefetch.L2.global") >= 1
    assert spills and max(spills) == 0, spills


def _merge_segment(ptx: str) -> str:
    """The PTX from the in-kernel merge's arrival atomic to its counter reset (the merge)."""
    start = ptx.index("atom.global.gpu.acq_rel.add")
    return ptx[start:ptx.index("atom.global.gpu.relaxed.exch", start)]


@pytest.mark.skipif(not _PTXAS or INTERPRETED, reason="needs triton's nvidia backend (ptxas)")
@pytest.mark.parametrize("group,qmax,splits,sinks", [(8, 1, 16, True), (6, 1, 32, False), (8, 4, 32, True)],
                         ids=["decode-g8-s16-sinks", "decode-g6-s32", "verify4-g8-s32-sinks"])
def test_sm90_merge_in_kernel_builds_without_spills(group, qmax, splits, sinks):
    """``MERGE_IN_KERNEL`` at batch-1 decode / verify shapes (head_dim 128, BLOCK_M 16 / 32, 4
    warps, output gate): one kernel, no spills; one arrival atomic (acq_rel, gpu scope) and one
    reset; the merge reads the partials through L2 only, with no barrier but the one that
    shares the atomic's result (a barrier per split, from a layout conversion, would wait for
    that split's loads: S dependent round trips). With the switch off there is no atomic."""
    cfg = ("bf16", 128, group, qmax, splits, True, False, sinks)
    (compiled, spills), = _sm90_builds(*cfg, merge=True)
    assert spills and max(spills) == 0, spills
    ptx = compiled.asm["ptx"]
    assert ptx.count("atom.global.gpu.acq_rel.add") == 1 and ptx.count("atom.global.gpu.relaxed.exch") == 1
    merge = _merge_segment(ptx)
    assert merge.count("bar.sync") <= 1
    loads = [line for line in merge.splitlines() if "ld.global" in line]
    partials = [line for line in loads if ".b16" not in line]  # not the bf16 sinks / gate
    assert len(partials) >= 3 * splits and all("ld.global.cg" in line for line in partials)
    (plain, _), _ = _sm90_builds(*cfg)
    assert "atom." not in plain.asm["ptx"]


@pytest.mark.skipif(not _PTXAS or INTERPRETED, reason="needs triton's nvidia backend (ptxas)")
def test_sm90_merge_in_kernel_programmatic_dependent_launch_order():
    """With PDL and the in-kernel merge the attention kernel keeps its order (kernels/pdl.py):
    before the wait only L2 loads (metadata, key slots, old K/V), q after it, and the merge (the
    arrival atomic and the partials' loads) after ``launch_dependents``. No spills."""
    (compiled, spills), = _sm90_builds("bf16", 128, 8, 1, 16, True, False, True, pdl=True, merge=True)
    ptx = compiled.asm["ptx"]
    before_wait = loads_before_pdl_wait(ptx)
    assert before_wait and all("ld.global.cg" in line for line in before_wait), before_wait
    assert ptx.index("griddepcontrol.launch_dependents") < ptx.index("atom.global.gpu.acq_rel.add")
    assert spills and max(spills) == 0, spills


# ---- CUDA ----------------------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cuda_matches_sdpa(case, dtype):
    name, specs, causal, window, has_sinks, kv_heads, head_dim, splits = case
    q, kc, vc, meta, _ = make_case(specs, kv_heads, head_dim, dtype, causal, device="cuda", seed=len(name))
    sinks = (torch.randn(NUM_HEADS) * 2).cuda() if has_sinks else None
    for block_n in (16, None):
        compare(q, kc, vc, meta, window=window, sinks=sinks, num_splits=splits, block_n=block_n)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_heads", [8, 2, 1], ids=["gqa1", "gqa4", "gqa8"])
def test_cuda_gqa_head_dim(kv_heads, head_dim, dtype):
    q, kc, vc, meta, _ = make_case([(0, 12), (70, 1), (21, 8)], kv_heads, head_dim, dtype, True,
                                   device="cuda", seed=kv_heads + head_dim)
    compare(q, kc, vc, meta)


@cuda
@pytest.mark.parametrize("causal,window,sinks", [(True, None, False), (True, 512, True), (False, None, False),
                                                 (False, 256, True)])
@pytest.mark.parametrize("qlen", [1, 8, 64, 300])
def test_cuda_long_context(qlen, causal, window, sinks):
    """Long contexts (split-K kicks in for few requests), bf16, 32 heads over 4 KV heads."""
    specs = [(4000, qlen), (1500, qlen)] if qlen <= 64 else [(0, qlen), (2000, qlen)]
    q, kc, vc, meta, _ = make_case(specs, 4, 128, torch.bfloat16, causal, device="cuda", num_heads=32)
    sink = (torch.randn(32) * 2).cuda() if sinks else None
    compare(q, kc, vc, meta, window=window, sinks=sink)
    for splits in (1, 5):
        compare(q, kc, vc, meta, window=window, sinks=sink, num_splits=splits)


@cuda
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability() < (9, 0), reason="needs sm90+")
@pytest.mark.parametrize("splits", [1, None])
def test_cuda_l2_prefetch_changes_no_value(splits):
    """An L2 prefetch of a weight from the attention programs (the decode path's ``o_proj``
    hint) leaves the output bitwise equal and the weight untouched, with and without split-K,
    eagerly and in a CUDA graph."""
    from laguna_dflash.kernels import l2_prefetch

    q, kc, vc, meta, _ = make_case([(1000, 1), (300, 4)], 8, 128, torch.bfloat16, True, device="cuda",
                                   num_heads=64)
    weight = torch.randn(2048, 8192 + 8, device="cuda", dtype=torch.bfloat16)  # 33.6 MB
    before = weight.clone()
    args = (q, kc, vc, meta.query_index, meta.query_positions, meta.key_slots, meta.seq_lens)
    kwargs = dict(scale=128**-0.5, causal=True, num_splits=splits)
    assert l2_prefetch.plan(weight, 256) is not None  # the prefetch path really runs here
    want = pa.paged_attention(*args, **kwargs)
    got = pa.paged_attention(*args, **kwargs, prefetch=weight)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = pa.paged_attention(*args, **kwargs, prefetch=weight)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want) and torch.equal(graphed, want)
    assert torch.equal(weight, before)
    assert l2_prefetch.prefetch_l2(weight) and torch.equal(weight, before)


@cuda
def test_cuda_no_host_sync_and_graph_capture():
    """Capture one attend in a CUDA graph; replay it after refilling the metadata buffers with a
    different batch of the same shapes (other lengths, positions and block tables)."""
    dtype = torch.bfloat16
    q, kc, vc, meta, _ = make_case([(100, 4), (296, 4)], 2, 128, dtype, True, device="cuda", seed=1,
                                   num_blocks=64)
    q2, _, _, meta2, _ = make_case([(296, 4), (53, 3)], 2, 128, dtype, True, device="cuda", seed=2,
                                   num_blocks=64)
    assert meta2.key_slots.shape == meta.key_slots.shape and meta2.query_index.shape == meta.query_index.shape
    sinks = torch.randn(NUM_HEADS, device="cuda")
    backend = TritonPagedBackend()
    kwargs = {"scale": 128 ** -0.5, "sliding_window": 64, "sinks": sinks}
    q_buf = q.contiguous().clone()
    backend.attend(q_buf, kc, vc, meta, **kwargs)  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.attend(q_buf, kc, vc, meta, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.attend(q_buf, kc, vc, meta, **kwargs)
    graph.replay()
    torch.testing.assert_close(out, TorchSDPABackend().attend(q_buf, kc, vc, meta, **kwargs), **TOL[dtype])
    # same shapes: T = 8 vs 7 differ, so pad batch 2 to the captured token count with its own layout
    t = q_buf.shape[0]
    q2_full = torch.zeros_like(q_buf)
    q2_full[: q2.shape[0]] = q2
    for name in ("query_index", "query_positions", "key_slots", "seq_lens"):
        getattr(meta, name).copy_(getattr(meta2, name))
    q_buf.copy_(q2_full)
    graph.replay()
    want = TorchSDPABackend().attend(q2.contiguous(), kc, vc, meta2, **kwargs)
    torch.testing.assert_close(out[: want.shape[0]], want, **TOL[dtype])
    assert out.shape[0] == t


@cuda
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("qlen", [1, 4])
def test_cuda_keys_written_just_before_are_read_after_the_pdl_wait(qlen, splits):
    """With PDL and ``PRELOAD_OLD_KEYS``, attention reads the K/V before each request's first query
    before its wait, and the forward's own K/V, which the Q/K norm + RoPE + cache kernel right
    before it writes, after it. Here those slots hold NaN until that kernel writes them (filled by
    a normal launch at the start of the same CUDA graph, so the Q/K kernel and attention, PDL
    launched, overlap as in the model): a new key read before the wait shows as NaN or a wrong
    output. The requests' new keys fall in the first key tile of some program (the tile loaded
    around the wait). 40 replays, each against the reference on the caches the graph left."""
    from laguna_dflash.kernels import pdl
    from laguna_dflash.kernels import qk_norm_rope_cache as qnrc

    if not pdl.active(torch.device("cuda"), False):
        pytest.skip("needs sm90+ (programmatic dependent launch)")
    dtype, kv_heads, head_dim = torch.bfloat16, 2, 128
    _, kc, vc, meta, _ = make_case([(5, qlen), (70, qlen), (130, qlen)], kv_heads, head_dim, dtype,
                                   True, device="cuda", seed=5)
    g = torch.Generator(device="cuda").manual_seed(5)
    t = meta.num_tokens
    qkv = torch.randn(t, (NUM_HEADS + 2 * kv_heads) * head_dim, device="cuda", generator=g).to(dtype)
    qw = (1 + 0.1 * torch.randn(head_dim, device="cuda", generator=g)).to(dtype)
    kw = (1 + 0.1 * torch.randn(head_dim, device="cuda", generator=g)).to(dtype)
    angles = torch.arange(512, device="cuda")[:, None] * torch.rand(head_dim, device="cuda", generator=g)
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    scale = head_dim ** -0.5

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        kc.index_fill_(0, meta.slot_mapping, float("nan"))  # normal launches: ordered before
        vc.index_fill_(0, meta.slot_mapping, float("nan"))
        q = qnrc.qk_norm_rope_cache(qkv, NUM_HEADS, kv_heads, head_dim, qw, kw, 1e-6, cos, sin,
                                    meta.positions, head_dim, meta.slot_mapping, kc, vc)
        out = pa.paged_attention(q, kc, vc, meta.query_index, meta.query_positions, meta.key_slots,
                                 meta.seq_lens, scale=scale, causal=True, num_splits=splits)
        return q, out

    forward()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, out = forward()
    for _ in range(40):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        want = TorchSDPABackend().attend(q, kc, vc, meta, scale=scale)
        torch.testing.assert_close(out, want, **TOL[dtype])


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [
    # (id, [(context_len, num_tokens)], num_heads over 8 KV heads (head_dim 128), num_splits)
    ("decode_g8_auto", [(1000, 1)], 64, None),  # batch-1 decode, the split count the GPU picks
    ("decode_g8_s16", [(1100, 1)], 64, 16),
    ("decode_g6_s32", [(3000, 1)], 48, 32),
    ("decode_g8_s16_short", [(2000, 1), (150, 1), (700, 1)], 64, 16),  # splits past a request's keys
    ("verify4_g8_auto", [(1500, 4)], 64, None),
    ("verify4_g6_s8", [(1200, 4), (60, 4)], 48, 8),
], ids=lambda c: c[0])
def test_cuda_merge_in_kernel_is_bitwise_the_two_launch_merge(shape, dtype, monkeypatch):
    """``MERGE_IN_KERNEL`` on the GPU, where the splits of a tile really race: the in-kernel
    merge gives the two-launch path's bits whichever program arrives last (three calls), with
    and without sinks + output gate and a sliding window, and leaves every counter at 0."""
    _, specs, num_heads, splits = shape
    q, kc, vc, meta, _ = make_case(specs, 8, 128, dtype, True, device="cuda", num_heads=num_heads)
    g = torch.Generator(device="cuda").manual_seed(3)
    sinks = torch.randn(num_heads, device="cuda", generator=g) * 2
    gate = torch.randn(q.shape[0], num_heads, device="cuda", generator=g) * 4
    args = (q, kc, vc, meta.query_index, meta.query_positions, meta.key_slots, meta.seq_lens)
    for extra in ({}, {"sinks": sinks, "gate": gate}, {"sliding_window": 512, "sinks": sinks}):
        kwargs = dict(scale=128 ** -0.5, causal=True, num_splits=splits, **extra)
        monkeypatch.setattr(pa, "MERGE_IN_KERNEL", False)
        want = pa.paged_attention(*args, **kwargs)
        monkeypatch.setattr(pa, "MERGE_IN_KERNEL", True)
        for _ in range(3):
            assert torch.equal(pa.paged_attention(*args, **kwargs), want)
        torch.cuda.synchronize()
        assert not pa._COUNTERS[q.device].any()
    compare(q, kc, vc, meta, sinks=sinks, gate=gate, num_splits=splits)  # the switch is still on


@cuda
def test_cuda_merge_in_kernel_in_a_cuda_graph(monkeypatch):
    """One batch-1 decode attention with the in-kernel merge (16 splits, sinks, gate) captured in
    a CUDA graph: every replay gives the two-launch path's bits (the launch re-arms its own
    counters: no memset in the graph), also after new q and a shorter context in the buffers."""
    q, kc, vc, meta, _ = make_case([(1100, 1)], 8, 128, torch.bfloat16, True, device="cuda", num_heads=64)
    g = torch.Generator(device="cuda").manual_seed(4)
    sinks = torch.randn(64, device="cuda", generator=g)
    gate = torch.randn(1, 64, device="cuda", generator=g) * 4
    q_buf = q.contiguous().clone()
    args = (q_buf, kc, vc, meta.query_index, meta.query_positions, meta.key_slots, meta.seq_lens)
    kwargs = dict(scale=128 ** -0.5, causal=True, sinks=sinks, gate=gate, num_splits=16)

    def two_launches() -> torch.Tensor:
        monkeypatch.setattr(pa, "MERGE_IN_KERNEL", False)
        return pa.paged_attention(*args, **kwargs)

    want = two_launches()
    monkeypatch.setattr(pa, "MERGE_IN_KERNEL", True)
    pa.paged_attention(*args, **kwargs)  # compile and allocate the counters outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pa.paged_attention(*args, **kwargs)
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        assert not pa._COUNTERS[q.device].any()
    q_buf.copy_(torch.randn(q_buf.shape, device="cuda", generator=g).to(q_buf.dtype))
    meta.seq_lens.fill_(701)  # splits 11..15 now see no key
    meta.query_positions.fill_(700)
    want = two_launches()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


@cuda
def test_cuda_timing_report():
    """Times the kernel vs the SDPA reference on engine-like shapes (printed with ``-s``)."""
    from triton.testing import do_bench

    rows = []
    for label, specs, causal, window in [
        ("decode R=32 ctx=2k", [(2000, 1)] * 32, True, None),
        ("decode R=4 ctx=16k", [(16000, 1)] * 4, True, None),
        ("verify R=32 Q=8 ctx=2k", [(2000, 8)] * 32, True, None),
        ("verify R=32 Q=8 ctx=2k W=512", [(2000, 8)] * 32, True, 512),
        ("draft block R=32 Q=16 ctx=2k bidir", [(2000, 16)] * 32, False, None),
        ("prefill 1x2048", [(0, 2048)], True, None),
    ]:
        q, kc, vc, meta, _ = make_case(specs, 8, 128, torch.bfloat16, causal, device="cuda", num_heads=64)
        kwargs = {"scale": 128 ** -0.5, "sliding_window": window}
        compare(q, kc, vc, meta, window=window)
        t_tri = do_bench(functools.partial(TritonPagedBackend().attend, q, kc, vc, meta, **kwargs))
        t_ref = do_bench(functools.partial(TorchSDPABackend().attend, q, kc, vc, meta, **kwargs))
        rows.append(f"{label:40s} triton {t_tri * 1e3:9.1f} us   sdpa-gather {t_ref * 1e3:9.1f} us")
    print("\n" + "\n".join(rows))


def test_engine_config_selects_the_triton_backend() -> None:
    """``attention_backend="triton"`` reaches the paged backend; a typo is a clear error."""
    from laguna_dflash.config import EngineConfig
    from laguna_dflash.engine.attention import get_attention_backend
    from laguna_dflash.engine.triton_attention import TritonPagedBackend

    assert isinstance(get_attention_backend("triton"), TritonPagedBackend)
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model="x", attention_backend="flash")
