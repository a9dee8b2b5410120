"""Triton paged attention (``kernels/paged_attention.py``, ``engine/triton_attention.py``).

``TritonPagedBackend.attend`` must equal ``TorchSDPABackend.attend`` on identical random caches and
metadata built by the engine's own ``build_metadata`` (random, non-contiguous block tables, block
size 16, a sentinel in the scratch block):

* under Triton's CPU interpreter (``TRITON_INTERPRET=1``, in ONE child pytest so the variable never
  reaches other tests): decode (Q=1), verify (Q=4, 8), the DFlash drafter block (Q=8
  bidirectional), mixed batches (prefill chunk + decode + verify, different context lengths),
  sliding window (causal and bidirectional), sinks, the per-layer causality override, split-K,
  GQA ratios 1/4/8 x head_dim 64/128, fp32 (tight) and bf16 (loose);
* without a GPU: the compiled (non-interpreter) kernel builds for sm_90 with ptxas, unspilled;
* on CUDA (skipped without one): the same cases, long contexts with split-K, CUDA-graph capture and
  replay on new metadata, no host sync, and a timing table vs the SDPA reference (``-s`` shows it).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest
import torch
from interpreter_child import HAS_TRITON, INTERPRETED, interpreted, run_interpreted_child
from ptx_sm90 import loads_before_pdl_wait, pinned_options, ptxas_spills, sm90_compile_lock

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


def _poisoned_partials(monkeypatch, skip_empty: bool) -> None:
    """Split-K scratch pre-filled with NaN (as uninitialised memory may hold): any acc row the
    merge reads without the attention kernel having written it shows in the output."""
    new_partials = pa._new_partials

    def poisoned(*args, **kwargs):
        return tuple(x.fill_(float("nan")) for x in new_partials(*args, **kwargs))

    monkeypatch.setattr(pa, "_new_partials", poisoned)
    monkeypatch.setattr(pa, "SKIP_EMPTY_SPLITS", skip_empty)


# requests of very different lengths (and a window): most of the short ones' and the windowed
# ones' key chunks are empty
_EMPTY_SPLIT_CASES = [([(200, 1), (5, 1), (90, 4)], True, None), ([(180, 4), (3, 4)], True, 24),
                      ([(150, 8), (10, 8)], False, 16)]


@interpreted
@pytest.mark.parametrize("skip_empty", [True, False], ids=["skip_empty", "keep_empty"])
def test_interpreted_empty_splits_are_not_read(monkeypatch, skip_empty):
    """Split-K chunks holding no visible key store no acc rows (``SKIP_EMPTY_SPLITS``) and the
    merge reads none of them: poisoned scratch changes no value, either way. The output gate too."""
    _poisoned_partials(monkeypatch, skip_empty)
    for specs, causal, window in _EMPTY_SPLIT_CASES:
        q, kc, vc, meta, _ = make_case(specs, 2, 64, torch.float32, causal)
        compare(q, kc, vc, meta, window=window, num_splits=6, block_n=16)
        gate = torch.randn(q.shape[0], q.shape[1], generator=torch.Generator().manual_seed(1))
        compare(q, kc, vc, meta, window=window, num_splits=6, block_n=16, gate=gate)


@cuda
@pytest.mark.parametrize("skip_empty", [True, False], ids=["skip_empty", "keep_empty"])
def test_cuda_empty_splits_are_not_read(monkeypatch, skip_empty):
    _poisoned_partials(monkeypatch, skip_empty)
    for specs, causal, window in _EMPTY_SPLIT_CASES:
        q, kc, vc, meta, _ = make_case([(c * 10, n) for c, n in specs], 4, 128, torch.bfloat16, causal,
                                       device="cuda", num_heads=32)
        compare(q, kc, vc, meta, window=window and window * 10)
        compare(q, kc, vc, meta, window=window and window * 10, num_splits=12)


def _recorded_partials(monkeypatch) -> list:
    """Each launch's split-K scratch ``(acc, m, l)``, appended as it is allocated."""
    captured, new_partials = [], pa._new_partials

    def recording(*args, **kwargs):
        captured.append(new_partials(*args, **kwargs))
        return captured[-1]

    monkeypatch.setattr(pa, "_new_partials", recording)
    return captured


def _relative_window_decode(monkeypatch) -> tuple[list, tuple]:
    """A decode at position 400 (float32, 2 KV heads, head_dim 64), launched as in graphs with
    relative chunks at this short key axis -> (the launches' recorded scratch, the case)."""
    captured = _recorded_partials(monkeypatch)
    monkeypatch.setattr(pa, "RELATIVE_MIN_KEYS", 0)
    _as_in_graphs(monkeypatch)
    return captured, make_case([(400, 1)], 2, 64, torch.float32, True)


def _as_in_graphs(monkeypatch) -> None:
    """The backend's launches as inside a CUDA-graph build (no ``fixed_splits``: relative
    chunks apply there only)."""
    from laguna_dflash.engine import triton_attention

    monkeypatch.setattr(triton_attention, "fixed_eager_splits", False)


@interpreted
@pytest.mark.parametrize("relative", [True, False], ids=["relative", "absolute"])
def test_interpreted_split_modes_match_sdpa(monkeypatch, relative):
    """Split-K chunks relative to each query tile's visible keys (``RELATIVE_SPLITS``, the
    default) or absolute from key 0: both equal the reference over mixed lengths, windows and
    the bidirectional block, with poisoned scratch (no unwritten acc row read)."""
    _poisoned_partials(monkeypatch, True)
    monkeypatch.setattr(pa, "RELATIVE_SPLITS", relative)
    monkeypatch.setattr(pa, "RELATIVE_MIN_KEYS", 0)  # these key axes are short
    _as_in_graphs(monkeypatch)
    for specs, causal, window in _EMPTY_SPLIT_CASES + [([(300, 1), (90, 1), (7, 1)], True, 32)]:
        q, kc, vc, meta, _ = make_case(specs, 2, 64, torch.float32, causal)
        compare(q, kc, vc, meta, window=window, num_splits=5, block_n=16)


@interpreted
def test_interpreted_relative_splits_give_every_split_keys(monkeypatch):
    """A decode at position 400 with a 48-key window, 4 splits: relative chunks give each split
    one 16-key tile of the window (every split's m finite); absolute chunks of 112 keys from
    key 0 leave three of the four empty. The split count of a sliding layer comes from its
    window (relative) or the whole key axis (absolute)."""
    seen, choose = [], pa.choose_num_splits
    monkeypatch.setattr(pa, "choose_num_splits", lambda n, keys, dev: seen.append(keys) or choose(n, keys, dev))
    monkeypatch.setattr(pa, "RELATIVE_WINDOW_SLACK", False)  # its own test below
    captured, (q, kc, vc, meta, _) = _relative_window_decode(monkeypatch)
    holding = {}
    for relative in (True, False):
        monkeypatch.setattr(pa, "RELATIVE_SPLITS", relative)
        captured.clear()
        compare(q, kc, vc, meta, window=48, num_splits=4, block_n=16)
        holding[relative] = torch.isfinite(captured[0][1][:, 0, 0]).sum().item()  # part_m [S, T, H]
        compare(q, kc, vc, meta, window=48, block_n=16)  # the count chosen from the shapes
    assert holding == {True: 4, False: 1}
    lmax = meta.key_slots.shape[1]
    assert seen[0] == 49 < lmax == seen[1], (seen, lmax)  # 48 keys + the query tile; the axis
    # below RELATIVE_MIN_KEYS (the default: contexts past 2048) a forward of more than
    # RELATIVE_ANY_LENGTH_MAX_QUERIES query tokens a request (a verify, the drafter block; the
    # default lets the 1-token decode through), and eager forwards (fixed_splits) at any
    # length, keep the absolute chunks
    monkeypatch.setattr(pa, "RELATIVE_SPLITS", True)
    monkeypatch.setattr(pa, "choose_num_splits", lambda *args: 4)  # the CPU's choice is 1
    long_case = make_case([(2000, 1)], 2, 64, torch.float32, True)
    verify_case = make_case([(400, 4)], 2, 64, torch.float32, True)
    short_case = (q, kc, vc, meta, None)
    # (min keys, max queries at any length, fixed_splits, the case, splits holding keys:
    # absolute, the window in 1 of 4 splits of 112 keys from key 0; relative, 4 of 16 keys from
    # key 352; fixed: 32 of 64 keys from key 0, where relative ones would be 4 of 16 from 1952)
    above = 1 << 20  # a min-keys bound above both key axes
    for min_keys, any_length, fixed, case, want in ((above, 0, False, short_case, 1),
                                                    (above, 1, False, short_case, 4),
                                                    (above, 1, False, verify_case, 1),
                                                    (above, 4, False, verify_case, 4),
                                                    (0, 1, True, long_case, 2)):
        monkeypatch.setattr(pa, "RELATIVE_MIN_KEYS", min_keys)
        monkeypatch.setattr(pa, "RELATIVE_ANY_LENGTH_MAX_QUERIES", any_length)
        captured.clear()
        cq, ck, cv, cmeta, _ = case
        pa.paged_attention(cq, ck, cv, cmeta.query_index, cmeta.query_positions, cmeta.key_slots,
                           cmeta.seq_lens, scale=cq.shape[-1] ** -0.5, causal=True, sliding_window=48,
                           block_n=16, fixed_splits=fixed)
        part_m = captured[0][1]
        assert torch.isfinite(part_m[:, 0, 0]).sum().item() == want, (min_keys, any_length, fixed)


@interpreted
def test_interpreted_window_slack_splits_a_window_into_one_tile_runs(monkeypatch):
    """``RELATIVE_WINDOW_SLACK``: a sliding layer's split count counts the tiles its window can
    span once tile-aligned, so each split walks one tile (a 48-key window at position 400 spans
    4 tiles of 16: 4 splits holding keys), where the window's keys alone (49) give 3 splits of
    two-tile runs, one of them empty; the values stay the reference's."""
    # as on a GPU that wants many programs: as many 16-key splits as the keys allow
    monkeypatch.setattr(pa, "choose_num_splits", lambda n, keys, dev: max(1, keys // 16))
    captured, (q, kc, vc, meta, _) = _relative_window_decode(monkeypatch)
    splits = {}
    for slack in (False, True):
        monkeypatch.setattr(pa, "RELATIVE_WINDOW_SLACK", slack)
        captured.clear()
        compare(q, kc, vc, meta, window=48, block_n=16)
        part_m = captured[0][1][:, 0, 0]
        splits[slack] = (part_m.shape[0], torch.isfinite(part_m).sum().item())
    assert splits == {False: (3, 2), True: (4, 4)}, splits


@interpreted
def test_interpreted_fixed_splits_keep_the_empty_chunks(monkeypatch):
    """``fixed_splits`` (eager forwards): a chosen split count above one becomes ``_MAX_SPLITS``
    chunks of whole tiles, most of them empty here, launched as such (the kernels' NUM_SPLITS),
    and the values are the reference's; poisoned scratch shows any empty chunk read."""
    _poisoned_partials(monkeypatch, True)
    monkeypatch.setattr(pa, "choose_num_splits", lambda *args: 3)  # the CPU's choice is 1
    launched = []
    kernels = pa._kernels

    def recording(interpret):
        attn, merge = kernels(interpret)

        class Launch:
            def __init__(self, kernel):
                self.kernel = kernel

            def __getitem__(self, grid):
                def run(*args, **kw):
                    launched.append(kw["NUM_SPLITS"])
                    return self.kernel[grid](*args, **kw)
                return run
        return Launch(attn), Launch(merge)

    monkeypatch.setattr(pa, "_kernels", recording)
    q, kc, vc, meta, _ = make_case([(100, 1), (20, 1), (60, 4)], 2, 64, torch.float32, True)
    scale = q.shape[-1] ** -0.5
    want = TorchSDPABackend().attend(q, kc, vc, meta, scale=scale)
    args = (q, kc, vc, meta.query_index, meta.query_positions, meta.key_slots, meta.seq_lens)
    got = pa.paged_attention(*args, scale=scale, causal=True, block_n=16, fixed_splits=True)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    assert launched == [pa._MAX_SPLITS, pa._MAX_SPLITS]  # 7 of 32 chunks hold keys (104 / 16)
    launched.clear()
    pa.paged_attention(*args, scale=scale, causal=True, block_n=16)
    assert launched == [3, 3]
    launched.clear()  # a forward of many tokens (a prefill) keeps its count: partials stay small
    monkeypatch.setattr(pa, "FIXED_SPLITS_MAX_PARTIAL_BYTES", pa._MAX_SPLITS * 6 * NUM_HEADS * 64 * 4 - 1)
    pa.paged_attention(*args, scale=scale, causal=True, block_n=16, fixed_splits=True)
    assert launched == [3, 3]


@interpreted
def test_interpreted_causality_override_and_group_padding():
    """The per-layer ``is_causal`` override beats ``meta.is_causal`` both ways; a GQA group of 3
    (rows not a power of two) and head_dim 80 (padded to a 128-wide tile)."""
    q, kc, vc, meta, _ = make_case([(9, 8), (40, 3)], 2, 64, torch.float32, causal=True)
    compare(q, kc, vc, meta, is_causal=False, block_n=16)
    q, kc, vc, meta, _ = make_case([(9, 8), (40, 3)], 2, 80, torch.float32, causal=False, num_heads=6)
    compare(q, kc, vc, meta, is_causal=True, window=5, block_n=16)
    compare(q, kc, vc, meta, block_n=32)


# Laguna-S-2.1: 72 query heads over 8 KV heads on sliding layers (GQA 9, not a power of two: a
# tile of BLOCK_Q = 7 queries x 9 heads = 63 of 64 rows), 36 over 4 a rank under 2-way TP (GQA 9
# again); sliding window 512 with a context longer than it; the drafter's bidirectional 16-token
# block. (id, [(context_len, num_tokens)], causal, window, kv_heads, num_heads, num_splits, block_n)
S21_CASES = [
    ("s21_decode_gqa9", [(37, 1), (130, 1)], True, None, 8, 72, None, None),
    ("s21_tp2_verify4_gqa9", [(20, 4), (77, 4)], True, None, 4, 36, None, None),
    ("s21_drafter_block16_w512", [(600, 16)], False, 512, 8, 72, None, 64),
    ("s21_decode_w512", [(700, 1)], True, 512, 8, 72, None, 64),
    ("s21_verify4_split3", [(150, 4)], True, None, 8, 72, 3, 16),
]


def _s21_compare(case, dtype, device: str = "cpu", block_n=None) -> None:
    """One S-2.1 case against the SDPA reference, with Laguna's per-head output gate."""
    name, specs, causal, window, kv_heads, num_heads, splits, case_block_n = case
    q, kc, vc, meta, _ = make_case(specs, kv_heads, 128, dtype, causal, device=device, num_heads=num_heads,
                                   seed=len(name))
    assert num_heads // kv_heads == 9
    if window is not None:  # the context outruns the window: some keys must be masked out
        assert max(c + n for c, n in specs) > window
    gate = torch.randn(q.shape[0], num_heads, generator=torch.Generator().manual_seed(2)).to(device)
    compare(q, kc, vc, meta, window=window, num_splits=splits, block_n=block_n or case_block_n, gate=gate)


@interpreted
@pytest.mark.parametrize("case", S21_CASES, ids=[c[0] for c in S21_CASES])
def test_interpreted_s21_gqa9(case):
    """S-2.1's head layouts in fp32 (tight); the batch-1 decode also in bf16."""
    _s21_compare(case, torch.float32)
    if case[0] == "s21_decode_gqa9":
        _s21_compare(case, torch.bfloat16)


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


def test_split_plan_drops_or_keeps_the_empty_chunks():
    assert pa.split_plan(1000, 64, 12) == (8, 128)  # 84 keys a split -> 2 tiles: 8 chunks
    assert pa.split_plan(1000, 64, 32) == (16, 64)
    assert pa.split_plan(1000, 64, 32, keep_empty=True) == (32, 64)
    assert pa.split_plan(130, 64, 32, keep_empty=True) == (32, 64)
    assert pa.split_plan(4096, 64, 32, keep_empty=True) == (32, 128)
    assert pa.split_plan(100, 16, 1) == (1, 112)


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="triton not installed / interpreter on")
def test_backend_fixes_the_split_count_outside_graph_builds(monkeypatch):
    """Eager forwards ask for the fixed split count (``triton_attention.fixed_eager_splits``);
    forwards inside a CUDA-graph build (captures, their warm-ups, the build-ahead recordings)
    keep the count of their key bucket."""
    from laguna_dflash.engine import triton_attention
    from laguna_dflash.models import layers

    calls = []
    monkeypatch.setattr(pa, "is_available", lambda device: True)
    monkeypatch.setattr(pa, "paged_attention", lambda *a, **kw: calls.append(kw["fixed_splits"]) or a[0])
    q, kc, vc, meta, _ = make_case([(5, 3), (20, 1)], 2, 64, torch.float32, True)
    backend = TritonPagedBackend()
    backend.attend(q, kc, vc, meta, scale=0.125)
    with layers.building_cuda_graph():
        backend.attend(q, kc, vc, meta, scale=0.125)
    monkeypatch.setattr(triton_attention, "fixed_eager_splits", False)
    backend.attend(q, kc, vc, meta, scale=0.125)
    assert calls == [True, False, False]


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
    with sm90_compile_lock():
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options=pinned_options({"num_warps": num_warps, "num_stages": 2,
                                                          "launch_pdl": pdl}))
    return compiled, ptxas_spills(compiled.asm["ptx"])


def _sm90_builds(dtype: str, head_dim: int, group: int, qmax: int, splits: int, causal: bool,
                 window: bool, sinks: bool, pdl: bool = False, prefetch: bool = False,
                 preload: bool = True, early_signal: bool = False, invariant: bool = False):
    """The attention kernel (and the merge kernel with split-K) as ``paged_attention`` launches
    them; ``invariant``: as with ``batch_invariant=True`` (one query a tile, partials and the
    split-order merge even for one split)."""
    attn, merge = pa._kernels(False)
    block_q = 1 if invariant else pa._block_q(qmax, group)
    block_m = max(16, pa._next_pow2(block_q * group))
    partials = splits > 1 or invariant
    consts = dict(NUM_HEADS=group * 4, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_Q=block_q,
                  BLOCK_M=block_m, BLOCK_N=64, CAUSAL=causal, HAS_WINDOW=window, HAS_SINKS=sinks,
                  NUM_SPLITS=splits, IEEE=dtype == "fp32", DYNAMIC_LOOP=True, SPLIT_TILES=0,
                  HAS_GATE=not partials,  # the engine gates Laguna's output in the last store
                  PDL=pdl, PREFETCH=256 if prefetch else 0, PRELOAD=preload and not invariant,
                  EARLY_SIGNAL=early_signal, SKIP_EMPTY=pa.SKIP_EMPTY_SPLITS, PARTIALS=partials)
    consts.update({n: 1 for n in ("stride_qd", "stride_kc_d", "stride_vc_d", "stride_od",
                                  "stride_qi_q", "stride_qp_q", "stride_ks_j")})
    ptrs = {n: f"*{dtype}" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "sinks_ptr", "gate_ptr",
                                     "prefetch_ptr")}
    ptrs.update(prefetch_nbytes="i64", prefetch_chunk="i64")
    ptrs.update({n: "*i64" for n in ("query_index_ptr", "query_pos_ptr", "key_slots_ptr", "seq_lens_ptr")})
    ptrs.update({n: "*fp32" for n in ("part_acc_ptr", "part_m_ptr", "part_l_ptr")})
    builds = [_aot_sm90(attn, consts, ptrs, ("stride_qt", "stride_qh", "stride_kc_s", "stride_kc_h",
                                             "stride_vc_s", "stride_vc_h", "stride_ot", "stride_oh"),
                        pa._num_warps(block_m, head_dim), pdl)]
    if partials:
        mconsts = dict(NUM_HEADS=group * 4, HEAD_DIM=head_dim, BLOCK_D=head_dim, NUM_SPLITS=splits,
                       BLOCK_S=max(2, pa._next_pow2(splits)), HAS_SINKS=sinks, stride_od=1, HAS_GATE=True,
                       PDL=pdl, EARLY_SIGNAL=early_signal, SKIP_EMPTY=pa.SKIP_EMPTY_SPLITS,
                       SEQUENTIAL=invariant)
        builds.append(_aot_sm90(merge, mconsts, ptrs, ("stride_ot", "stride_oh", "stride_gt"),
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
    ("bf16", 128, 8, 1, 8, True, True, True, "invariant"),  # batch_invariant: 8 splits, merged in order
    ("bf16", 128, 8, 1, 1, True, False, False, "invariant"),  # ... one split, still merged
], ids=lambda c: "-".join(map(str, c)))
def test_compiles_for_sm90_without_spills(cfg):
    """The compiled path (dynamic key loop) is not what the interpreter runs: check it builds."""
    invariant = cfg[-1] == "invariant"
    builds = _sm90_builds(*cfg[:8], invariant=invariant)
    assert len(builds) == (2 if cfg[4] > 1 or invariant else 1)
    for compiled, spills in builds:
        assert "cubin" in compiled.asm
        assert spills and max(spills) == 0, spills


@pytest.mark.skipif(not _PTXAS or INTERPRETED, reason="needs triton's nvidia backend (ptxas)")
def test_sm90_four_token_verify_tile_builds_with_eight_warps(monkeypatch):
    """The A/B the verify's attention is waiting for (``WARPS8_MIN_TILE = 32 * 128``): the
    4-token tile (BLOCK_M 32) then gets 8 warps and still builds without spills; decode keeps 4."""
    assert pa._num_warps(32, 128) == 4  # the default
    monkeypatch.setattr(pa, "WARPS8_MIN_TILE", 32 * 128)
    assert pa._num_warps(32, 128) == 8 and pa._num_warps(16, 128) == 4
    (attn, spills), _ = _sm90_builds("bf16", 128, 8, 4, 32, True, True, False, pdl=True)
    assert max(spills) == 0 and ".reqntid 256" in attn.asm["ptx"]  # 8 warps of 32 threads


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
@pytest.mark.parametrize("early", [False, True])
def test_sm90_early_signal_comes_before_the_wait(early):
    """``EARLY_SIGNAL``: both kernels signal their dependents before their PDL wait (the
    launch after the merge may then be resident during attention); without it, only after."""
    cfg = ("bf16", 128, 8, 1, 4, True, False, True)
    for compiled, spills in _sm90_builds(*cfg, pdl=True, early_signal=early):
        ptx = compiled.asm["ptx"]
        first_signal = ptx.index("griddepcontrol.launch_dependents")
        assert (first_signal < ptx.index("griddepcontrol.wait")) == early
        assert ptx.count("griddepcontrol.wait") == 1
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
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", S21_CASES, ids=[c[0] for c in S21_CASES])
def test_cuda_s21_gqa9(case, dtype):
    for block_n in (16, None):
        _s21_compare(case, dtype, device="cuda", block_n=block_n)


@cuda
@pytest.mark.parametrize("num_heads,kv_heads", [(72, 8), (36, 4)], ids=["s21_gqa9", "s21_tp2_gqa9"])
@pytest.mark.parametrize("qlen", [1, 4, 16])
def test_cuda_s21_long_context_window_512(qlen, num_heads, kv_heads):
    """S-2.1 sliding layers at long contexts (split-K chosen and forced), causal and the
    drafter's bidirectional block, bf16."""
    for causal in (True, False):
        q, kc, vc, meta, _ = make_case([(4000, qlen), (1500, qlen)], kv_heads, 128, torch.bfloat16, causal,
                                       device="cuda", num_heads=num_heads)
        for splits in (None, 1, 5):
            compare(q, kc, vc, meta, window=512, num_splits=splits)


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
@pytest.mark.parametrize("producer", ["qk_kernel", "head_gemm"])
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("qlen", [1, 4, 16])
def test_cuda_keys_written_just_before_are_read_after_the_pdl_wait(monkeypatch, qlen, splits, producer):
    """With PDL and ``PRELOAD_OLD_KEYS``, attention reads the K/V before each request's first query
    before its wait, and the forward's own K/V, which the Q/K norm + RoPE + cache kernel right
    before it writes, after it. Here those slots hold NaN until that kernel writes them (filled by
    a normal launch at the start of the same CUDA graph, so the Q/K kernel and attention, PDL
    launched, overlap as in the model): a new key read before the wait shows as NaN or a wrong
    output. The requests' new keys fall in the first key tile of some program (the tile loaded
    around the wait). 40 replays, each against the reference on the caches the graph left.
    ``head_gemm``: the K/V come from the Q|K|V|gate GEMM with the Q/K work in its epilogue
    (kernels/qkv_norm_rope_cache.py), which signals attention right after its own wait, before
    its K loop, so attention's programs run their pre-wait loads while it computes."""
    from laguna_dflash.kernels import pdl
    from laguna_dflash.kernels import qk_norm_rope_cache as qnrc
    from laguna_dflash.kernels import qkv_norm_rope_cache as head_gemm

    if not pdl.active(torch.device("cuda"), False):
        pytest.skip("needs sm90+ (programmatic dependent launch)")
    monkeypatch.setattr(pa, "PRELOAD_MAX_QUERIES", None)  # the loads before the wait at any length
    dtype, kv_heads, head_dim = torch.bfloat16, 2, 128
    requests = [(5, qlen), (70, qlen), (130, qlen)]
    if producer == "head_gemm":  # its GEMM takes at most 16 rows, as the engine's decode/verify do
        requests = requests[-max(1, 16 // qlen):]
    _, kc, vc, meta, _ = make_case(requests, kv_heads, head_dim, dtype, True, device="cuda", seed=5)
    g = torch.Generator(device="cuda").manual_seed(5)
    t = meta.num_tokens
    qkv = torch.randn(t, (NUM_HEADS + 2 * kv_heads) * head_dim, device="cuda", generator=g).to(dtype)
    qw = (1 + 0.1 * torch.randn(head_dim, device="cuda", generator=g)).to(dtype)
    kw = (1 + 0.1 * torch.randn(head_dim, device="cuda", generator=g)).to(dtype)
    angles = torch.arange(512, device="cuda")[:, None] * torch.rand(head_dim, device="cuda", generator=g)
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    scale = head_dim ** -0.5
    x = torch.randn(t, 256, device="cuda", generator=g).to(dtype)
    w = (torch.randn((NUM_HEADS + 2 * kv_heads) * head_dim + NUM_HEADS, 256, device="cuda", generator=g)
         * 256**-0.5).to(dtype)
    assert head_gemm.EARLY_SIGNAL or producer == "qk_kernel"

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        kc.index_fill_(0, meta.slot_mapping, float("nan"))  # normal launches: ordered before
        vc.index_fill_(0, meta.slot_mapping, float("nan"))
        if producer == "head_gemm":
            q = head_gemm.qkv_norm_rope_cache(x, w, NUM_HEADS, kv_heads, head_dim, qw, kw, 1e-6, cos, sin,
                                              meta.positions, head_dim, meta.slot_mapping, kc, vc)[0]
        else:
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
