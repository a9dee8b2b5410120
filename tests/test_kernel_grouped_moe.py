"""Sorted, fixed-tile grouped MoE experts (``kernels/grouped_moe.py``): ``align_pairs`` and
``sorted_moe_experts`` against a per-pair torch reference and ``fused_moe``.

* Everywhere (pure torch, no interpreter): ``align_pairs`` puts every pair in exactly one row,
  each tile's rows on the tile's expert (in stable pair order), padding rows at ``-1``,
  ``tile_expert`` at ``-1`` exactly past the used tiles, shapes from ``P``, ``E``, ``block_m``
  alone (and the bound reached); input validation, ``P == 0``, importing without triton.
* Under Triton's CPU interpreter (a child pytest with ``TRITON_INTERPRET=1``; skipped in this
  process): fp32 (tight) and bf16 against a per-pair fp32 reference (``h`` rounded where the
  kernels round it), the pair sum against ``fused_moe.moe_experts_reference`` and the pairs
  against ``fused_moe_experts(reduce=False)``: T in {1, 3, 17, 40}, every pair on one expert, every
  token on the same experts, every pair on its own expert, E larger than P, zero weights, a
  folded shared expert, ragged N / K tiles, small configs (several column blocks and K steps),
  ``block_m`` 32, 64 and 128 (the engine's tiles for long forwards); row independence (a token alone == the token in a batch of 37 or shuffled),
  which under numpy checks the indexing.
* Offline sm_90 compile (no GPU): the programmatic-dependent-launch order, no spills, the K loop
  pipelined (``cp.async``), at 16 rows and at the engine's 32, 64 and 128.
* On CUDA (skipped without one): Laguna-XS-2.1 shapes (H 2048, I 512, E 256 + the shared expert,
  k 8 + 1, bf16) against ``fused_moe_experts(reduce=False)`` and the fp32 reference at T = 1, 4,
  300; bitwise row independence alone vs among 37 and 300 tokens and in a shuffled batch; no host
  sync; CUDA-graph capture and replay equal to eager; the engine's tiles at 512, 1024 and 2048
  tokens against the 16-row tiles, the reference and their graph replay.
* Skipped pairs (``has_skipped_pairs``: id ``-1``, an expert on another rank): ``align_pairs``
  puts them, as an expert ``E``, on ``-1`` tiles after the real experts' (pure torch); interpreted
  and on CUDA (no host sync, CUDA-graph capture, the fused kernels' bits) a rank's call against
  the global call on poisoned weights (``test_kernel_fused_moe.ep_problem`` /
  ``check_skipped_pairs``), their ``h`` rows never written; the flag with no ``-1`` changes no bit.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from interpreter_child import HAS_TRITON, INTERPRETED, interpreted, run_interpreted_child
from ptx_sm90 import can_compile_sm90, compile_sm90_spills, loads_before_pdl_wait
from test_kernel_fused_moe import (
    S21,
    check_skipped_pairs,
    eager_then_graphed,
    ep_problem,
    fp32_reference,
    s21_interpreter_tiles,
)

from laguna_dflash.kernels import grouped_moe
from laguna_dflash.kernels.fused_moe import fused_moe_experts
from laguna_dflash.kernels.grouped_moe import align_pairs, max_tiles, sorted_moe_experts

cuda = pytest.mark.skipif(INTERPRETED or not grouped_moe.is_available("cuda"),
                          reason="needs a CUDA GPU (sm80+) and triton")

# relative tolerances on max|ours - ref| / max|ref|
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _ids(t: int, k: int, e: int, mode: str, g: torch.Generator) -> torch.Tensor:
    """``[T, k]`` int64 expert ids, distinct within a token. ``mode``: ``random``; ``one`` (k = 1,
    every pair on the last expert); ``same`` (every token on experts 0..k-1); ``distinct`` (every
    pair on its own expert, needs E >= T*k); ``shared`` (k-1 random routed experts of the first
    E-1, then expert E-1 for every token: the folded shared expert)."""
    if mode == "one":
        assert k == 1
        return torch.full((t, 1), e - 1, dtype=torch.int64)
    if mode == "same":
        return torch.arange(k).repeat(t, 1)
    if mode == "distinct":
        return torch.randperm(e, generator=g)[: t * k].view(t, k)
    if mode == "shared":
        routed = torch.stack([torch.randperm(e - 1, generator=g)[: k - 1] for _ in range(t)])
        return torch.cat([routed.view(t, k - 1), torch.full((t, 1), e - 1)], 1)
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])


def _tokens(t: int, k: int, e: int, hidden: int, dtype: torch.dtype, seed: int, mode: str = "random",
            device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x ``[T, H]``, ids ``[T, k]``, weights ``[T, k]`` (normalised per token, in x.dtype)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g)
    ids = _ids(t, k, e, mode, g)
    weights = torch.rand(t, k, generator=g)
    weights = weights / weights.sum(-1, keepdim=True)
    return x.to(device, dtype), ids.to(device), weights.to(device, dtype)


def _experts(e: int, hidden: int, inter: int, dtype: torch.dtype, seed: int,
             device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up ``[E, 2I, H]``, down ``[E, H, I]``, generated on ``device``."""
    g = torch.Generator(device).manual_seed(seed)
    gate_up = torch.empty(e, 2 * inter, hidden, dtype=dtype, device=device)
    down = torch.empty(e, hidden, inter, dtype=dtype, device=device)
    # drawn in fp32 a few experts at a time: at S-2.1 size all of gate_up in fp32 is 6 GiB,
    # which ran 12 pytest workers out of an 80 GB card
    for w, width in ((gate_up, hidden), (down, inter)):
        for lo in range(0, e, 16):
            chunk = w[lo : lo + 16]
            chunk.copy_(torch.randn(chunk.shape, generator=g, device=device) / width**0.5)
    return gate_up, down


def _problem(t, k, e, hidden, inter, dtype, seed, mode="random", device="cpu"):
    return (*_tokens(t, k, e, hidden, dtype, seed, mode, device),
            *_experts(e, hidden, inter, dtype, seed + 1000, device))


def _round_like_kernels(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``v`` rounded to ``dtype`` as a kernel's ``.to(dtype)`` rounds it, back in fp32: to
    nearest on a GPU; toward zero for bf16 under triton 3.6's interpreter (it drops the low 16
    bits), which the reference follows there so that bf16 cases stay within ~1 ulp."""
    if INTERPRETED and dtype == torch.bfloat16:
        return (v.float().contiguous().view(torch.int32) & -65536).view(torch.float32)
    return v.to(dtype).float()


def _pairs_reference(x, ids, weights, gate_up, down) -> torch.Tensor:
    """``[T, k, H]`` fp32: each pair's ``w * down_e(silu(gate_e x) * up_e x)`` in fp32 math, with
    ``h`` rounded to ``x.dtype`` where the kernels round it (small shapes: gathers every pair's
    expert weights)."""
    xf = x.float()
    gu = torch.einsum("th,tknh->tkn", xf, gate_up[ids].float())  # [T, k, 2I]
    gate, up = gu.chunk(2, dim=-1)
    h = _round_like_kernels(F.silu(gate) * up, x.dtype)
    y = torch.einsum("tki,tkhi->tkh", h, down[ids].float())
    return y * weights.float()[..., None]


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item()


# ----------------------------------------------------------------------------- align_pairs (torch)


def _check_alignment(ids: torch.Tensor, e: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every invariant of :func:`align_pairs` on ``ids`` (any shape, flattened)."""
    flat = ids.reshape(-1)
    p = flat.numel()
    row_pair, tile_expert = align_pairs(ids, e, block_m)
    tiles = max_tiles(p, e, block_m)
    assert row_pair.dtype == tile_expert.dtype == torch.int32
    assert row_pair.shape == (tiles * block_m,) and tile_expert.shape == (tiles,)
    # every pair exactly once
    used_rows = row_pair[row_pair >= 0].long()
    assert torch.equal(used_rows.sort().values, torch.arange(p))
    assert torch.all(row_pair >= -1)
    counts = torch.bincount(flat, minlength=e)
    used_tiles = int(((counts + block_m - 1) // block_m).sum())
    assert used_tiles <= tiles
    # tile_expert: the used tiles first, then -1 exactly past them
    assert torch.all(tile_expert[:used_tiles] >= 0) and torch.all(tile_expert[used_tiles:] == -1)
    # experts in increasing order, each on ceil(count / block_m) consecutive tiles
    assert torch.equal(tile_expert[:used_tiles].long(),
                       torch.repeat_interleave(torch.arange(e), (counts + block_m - 1) // block_m))
    rows = row_pair.view(tiles, block_m).long()
    for m in range(tiles):
        real = rows[m][rows[m] >= 0]
        if tile_expert[m] < 0:
            assert real.numel() == 0  # tiles past the used ones: padding only
            continue
        assert real.numel() > 0 and torch.all(flat[real] == tile_expert[m])
        # real rows first, then padding; stable: increasing pair order within the expert
        assert torch.all(rows[m][: real.numel()] >= 0) and torch.all(rows[m][real.numel():] == -1)
        assert torch.all(real[1:] > real[:-1])
    # padding rows: exactly the rounding up of each expert's count, plus the unused tiles
    padding = int((row_pair == -1).sum())
    assert padding == tiles * block_m - p
    return row_pair, tile_expert


@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("t,k,e,mode", [
    (1, 9, 257, "shared"), (4, 9, 257, "shared"), (300, 9, 257, "shared"),
    (1, 1, 8, "random"), (17, 3, 9, "random"), (40, 2, 8, "random"), (37, 3, 9, "random"),
    (40, 1, 9, "one"), (40, 3, 8, "same"), (3, 3, 9, "distinct"), (2, 2, 64, "random"),
])
def test_align_pairs_invariants(t: int, k: int, e: int, mode: str, block_m: int) -> None:
    ids = _tokens(t, k, e, 8, torch.float32, seed=t * 31 + e, mode=mode)[1]
    _check_alignment(ids, e, block_m)


def test_align_pairs_shapes_do_not_depend_on_the_data() -> None:
    p, e, block_m = 40, 9, 16
    variants = [torch.zeros(p, dtype=torch.int64), torch.arange(p) % e, torch.full((p,), e - 1),
                torch.randint(0, e, (p,), generator=torch.Generator().manual_seed(0))]
    shapes = {tuple(t.shape for t in _check_alignment(ids, e, block_m)) for ids in variants}
    assert len(shapes) == 1
    # int32 ids, any leading shape: the same maps
    ids = variants[3]
    assert all(torch.equal(a, b) for a, b in zip(align_pairs(ids.view(8, 5).int(), e, block_m),
                                                  align_pairs(ids, e, block_m), strict=True))


def test_align_pairs_bound_is_reached() -> None:
    """Every expert hit 1 (mod block_m) times: all max_tiles tiles are used, none is -1."""
    e, block_m = 8, 16
    ids = torch.arange(e).repeat_interleave(block_m + 1)[torch.randperm(e * (block_m + 1))]
    _, tile_expert = _check_alignment(ids, e, block_m)
    assert tile_expert.numel() == max_tiles(ids.numel(), e, block_m) == 2 * e
    assert torch.all(tile_expert >= 0)
    # one pair per expert, more experts than pairs, more pairs than experts
    assert max_tiles(9, 257, 16) == 9 and max_tiles(0, 257, 16) == 0
    assert max_tiles(9 * 1024, 257, 16) == (9 * 1024 + 257 * 15) // 16


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("t,k,e_total,lo,hi", [
    (1, 9, 40, 10, 30), (6, 3, 12, 3, 8), (40, 8, 40, 4, 14), (300, 9, 40, 10, 30),
])
def test_align_pairs_skipped_pairs(t, k, e_total, lo, hi, block_m) -> None:
    """The -1 pairs are laid out as one more expert ``E``, after the real ones, on tiles whose
    expert reads -1; the real experts' rows and tiles are those of a call without them."""
    _, (_, local, *_), skipped = ep_problem(t, k, e_total, lo, hi, 8, 4, torch.float32, seed=t + block_m)
    e = hi - lo
    row_pair, tile_expert = align_pairs(local, e, block_m, has_skipped_pairs=True)
    as_expert = _check_alignment(torch.where(local == -1, e, local), e + 1, block_m)
    assert torch.equal(row_pair, as_expert[0])
    assert torch.equal(tile_expert, torch.where(as_expert[1] == e, -1, as_expert[1]))
    # tiles: the real experts' (>= 0), then the skipped pairs' and the unused ones (-1)
    real = int((tile_expert >= 0).sum())
    assert torch.all(tile_expert[:real] >= 0) and torch.all(tile_expert[real:] == -1)
    rest = row_pair.view(-1, block_m)[real:].long()
    assert torch.equal(rest[rest >= 0], torch.nonzero(skipped.reshape(-1)).squeeze(1))
    # the real rows are those of the kept pairs alone (here: the same ids with the -1 pairs cut)
    flat = local.reshape(-1)
    alone, tiles_alone = align_pairs(flat[flat >= 0], e, block_m)
    alone = alone[: real * block_m].long()
    pair_of = torch.nonzero(flat >= 0).squeeze(1)  # index among the kept pairs -> pair index
    assert torch.equal(row_pair[: real * block_m].long(),
                       torch.where(alone >= 0, pair_of[alone.clamp(min=0)], -1))
    assert torch.equal(tile_expert[:real], tiles_alone[:real])
    # shapes from P, E, block_m alone: every pair skipped, none skipped
    for ids in (torch.full_like(local, -1), torch.zeros_like(local)):
        maps = align_pairs(ids, e, block_m, has_skipped_pairs=True)
        assert [m.shape for m in maps] == [row_pair.shape, tile_expert.shape]
    row_pair, tile_expert = align_pairs(torch.full_like(local, -1), e, block_m, has_skipped_pairs=True)
    assert torch.all(tile_expert == -1) and torch.equal(row_pair[: t * k].long(), torch.arange(t * k))


def test_align_pairs_empty() -> None:
    row_pair, tile_expert = align_pairs(torch.zeros(0, 9, dtype=torch.int64), 257, 16)
    assert row_pair.shape == (0,) and tile_expert.shape == (0,)


def test_validation_and_empty() -> None:
    x, ids, w, gu, dn = _problem(3, 2, 4, 8, 4, torch.float32, 0)
    for bad in (0, 8, 24, 48, -16):
        with pytest.raises(ValueError, match="power of two >= 16"):
            sorted_moe_experts(x, ids, w, gu, dn, block_m=bad)
        with pytest.raises(ValueError, match="power of two >= 16"):
            align_pairs(ids, 4, bad)
    with pytest.raises(AssertionError, match="shape mismatch"):
        sorted_moe_experts(x[:, :4], ids, w, gu, dn)
    with pytest.raises(AssertionError, match="share a dtype"):
        sorted_moe_experts(x.double(), ids, w, gu, dn)
    # P == 0: no launch (runs without triton / a GPU)
    for t, k in ((0, 2), (3, 0)):
        out = sorted_moe_experts(x[:t], ids[:t, :k], w[:t, :k], gu, dn)
        assert out.shape == (t, k, 8) and out.dtype == x.dtype


def test_imports_without_triton() -> None:
    """The module (and align_pairs) works on a CPU-only install without triton."""
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import torch\n"
        "from laguna_dflash.kernels import grouped_moe as g\n"
        "assert not g.HAS_TRITON and not g.is_available('cpu')\n"
        "rp, te = g.align_pairs(torch.tensor([[1, 0], [1, 2]]), 3, 16)\n"
        "assert te.tolist() == [0, 1, 2] and rp.tolist()[:2] == [1, -1] and rp.numel() == 48\n"
        "print('ok')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


# ----------------------------------------------------------------------------- interpreter


def test_interpreter_child() -> None:
    if INTERPRETED or not HAS_TRITON:
        pytest.skip("this is the parent: needs triton, and not already interpreted")
    run_interpreted_child(__file__)


def _check_against_references(args, block_m: int = 16, vs_fused: bool = True) -> torch.Tensor:
    x, ids, w, gu, dn = args
    t, k = ids.shape
    out = sorted_moe_experts(*args, block_m=block_m)
    assert out.shape == (t, k, x.shape[1]) and out.dtype == x.dtype
    tol = TOL[x.dtype]
    ref = _round_like_kernels(_pairs_reference(*args), x.dtype)
    assert _rel_err(out, ref) <= tol, _rel_err(out, ref)
    # the pair sum vs the torch path's reference (fp32 math: it does not round h)
    summed = fp32_reference(*args)
    assert _rel_err(out.float().sum(1), summed) <= 2 * tol
    if vs_fused:
        fused = fused_moe_experts(*args, reduce=False)
        assert _rel_err(out, fused) <= tol
    # zero routing weight: exactly zero
    assert torch.all(out[w == 0] == 0)
    return out


# (T, k, E, H, I, mode): H = 64 / I = 32 is one column block and one (masked) K step at the default
# configs; 160 / 80 gives two column blocks and two K steps on both kernels, ragged
_CASES = [
    (1, 3, 9, 64, 32, "random"),
    (3, 2, 9, 64, 32, "random"),
    (17, 3, 9, 64, 32, "random"),    # tiles of several experts with padding rows
    (40, 2, 8, 64, 32, "random"),
    (40, 1, 8, 64, 32, "one"),       # all 40 pairs on one expert: three tiles, the last padded
    (40, 3, 8, 64, 32, "same"),      # every token on experts 0..2
    (3, 3, 9, 64, 32, "distinct"),   # every pair on its own expert: one row a tile
    (2, 2, 64, 64, 32, "random"),    # E larger than P
    (17, 3, 9, 64, 32, "shared"),    # the folded shared expert: one run of all 17 tokens
    (3, 2, 5, 160, 80, "random"),    # ragged: two column blocks and two K steps each
]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,k,e,hidden,inter,mode", _CASES)
def test_interpreted_matches_reference(t, k, e, hidden, inter, mode, dtype) -> None:
    args = _problem(t, k, e, hidden, inter, dtype, seed=t * 7 + k + e, mode=mode)
    _check_against_references(args)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interpreted_zero_weights(dtype) -> None:
    x, ids, w, gu, dn = _problem(17, 3, 9, 64, 32, dtype, seed=5)
    w[::2, 0] = 0
    w[5] = 0  # a whole token
    out = _check_against_references((x, ids, w, gu, dn))
    assert torch.all(out[5] == 0) and torch.all(out[::2, 0] == 0)
    assert torch.all(out[1, 0] != 0)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interpreted_small_tiles_and_larger_block_m(dtype, monkeypatch) -> None:
    """Small configs: two column blocks and four K steps in gate_up, four and two in down; and
    ``block_m`` 32, 64 and 128 (the engine's tiles past 384, 768 and 1792 tokens,
    ``block_m_for``) at the default configs, with experts holding more pairs than a 16-row tile."""
    args = _problem(17, 3, 9, 64, 32, dtype, seed=11)
    monkeypatch.setattr(grouped_moe, "_GATE_UP_CFG", (16, 16, 4, 2))
    monkeypatch.setattr(grouped_moe, "_DOWN_CFG", (16, 16, 4, 2))
    _check_against_references(args, vs_fused=False)
    monkeypatch.undo()
    _check_against_references(args, block_m=32, vs_fused=False)
    many = _problem(40, 2, 3, 64, 32, dtype, seed=12)  # ~27 pairs an expert
    _check_against_references(many, block_m=64, vs_fused=False)
    _check_against_references(many, block_m=128, vs_fused=False)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interpreted_row_independence(dtype) -> None:
    """A token's pairs alone (T = 1) equal the same token's pairs among 37 tokens and in a
    shuffled batch. Under numpy this checks the indexing only, to rounding: ``tl.dot`` becomes a
    BLAS sgemm whose result for a row depends on the row's place in the tile on some CPUs
    (OpenBLAS's Haswell and Zen kernels; ``OPENBLAS_CORETYPE=Haswell`` shows it), so bitwise
    here would test the host's BLAS. A wrong row or expert is off by O(1), far past the
    tolerance; ``test_cuda_row_independence_bitwise`` is the bitwise proof."""
    x, ids, w, gu, dn = _problem(37, 3, 9, 64, 32, dtype, seed=3)
    batch = sorted_moe_experts(x, ids, w, gu, dn)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-5)
    for t in (0, 18, 36):
        alone = sorted_moe_experts(x[t : t + 1], ids[t : t + 1], w[t : t + 1], gu, dn)
        torch.testing.assert_close(alone[0], batch[t], **tol, msg=f"token {t}")
    perm = torch.randperm(37, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(sorted_moe_experts(x[perm], ids[perm], w[perm], gu, dn),
                               batch[perm], **tol)


def _skipped_h_rows(num_experts: int, block_m: int = grouped_moe.DEFAULT_BLOCK_M):
    """``h_rows`` of ``check_skipped_pairs`` for these kernels: ``h`` is in the padded row order,
    so the skipped pairs' rows are where ``align_pairs`` put them."""
    def rows(local: torch.Tensor) -> torch.Tensor:
        row_pair, _ = align_pairs(local, num_experts, block_m, has_skipped_pairs=True)
        return (row_pair >= 0) & (local.reshape(-1)[row_pair.long().clamp(min=0)] == -1)
    return rows


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,k,e_total,lo,hi,hidden,inter", [
    (6, 3, 12, 3, 8, 64, 32),      # mixed tokens
    (40, 8, 40, 4, 14, 160, 80),   # over 100 skipped pairs: several -1 tiles; two column blocks
])
def test_interpreted_skipped_pairs(t, k, e_total, lo, hi, hidden, inter, dtype) -> None:
    full, rank, skipped = ep_problem(t, k, e_total, lo, hi, hidden, inter, dtype, seed=t + k)
    check_skipped_pairs(sorted_moe_experts, full, rank, skipped, module=grouped_moe,
                        h_rows=_skipped_h_rows(hi - lo))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interpreted_skip_flag_without_skipped_pairs(dtype) -> None:
    args = _problem(17, 3, 9, 64, 32, dtype, seed=4)
    assert torch.equal(sorted_moe_experts(*args, has_skipped_pairs=True), sorted_moe_experts(*args))


# ----------------------------------------------------------------------------- sm_90 PTX (offline)


@interpreted
def test_interpreted_s21_eleven_pairs_width_512(monkeypatch) -> None:
    """S-2.1 under 2-way TP: expert width 512 a rank, 11 pairs a token (top-10 + the folded
    shared expert: one run of every token), 3 tokens, fp32, against the references and the
    fused kernels. Hidden and the expert count shrunk (80: ragged; 12)."""
    s21_interpreter_tiles(monkeypatch)
    args = _problem(3, S21["k"], 12, 80, S21["inter"] // 2, torch.float32, seed=21, mode="shared")
    assert torch.all(args[1][:, -1] == 11)
    _check_against_references(args)


def _compile_sm90(which: int, pdl: bool, skip: bool = False,
                  block_m: int = grouped_moe.DEFAULT_BLOCK_M) -> tuple[str, list[int]]:
    """PTX and spill bytes of the gate_up (0) or down (1, ``skip``: its skipped-pairs build)
    kernel at XS-2.1 shapes, bf16, ``block_m`` rows a tile."""
    if which == 0:
        kernel, cfg = grouped_moe._sorted_gate_up_kernel, grouped_moe._GATE_UP_CFG
        types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "row_pair_ptr": "*i32",
                 "tile_expert_ptr": "*i32", "h_ptr": "*bf16"}
        constexprs = dict(K_TOP=9, H=2048, INTER=512)
    else:
        kernel, cfg = grouped_moe._sorted_down_kernel, grouped_moe._DOWN_CFG
        types = {"h_ptr": "*bf16", "w_ptr": "*bf16", "row_pair_ptr": "*i32",
                 "tile_expert_ptr": "*i32", "rw_ptr": "*bf16", "out_ptr": "*bf16"}
        constexprs = dict(H=2048, INTER=512, SKIP_NEGATIVE=skip)
    bn, bk, nw, ns = cfg
    constexprs.update(BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, IEEE=False, PDL=pdl)
    return compile_sm90_spills(kernel, types, constexprs,
                               {"num_warps": nw, "num_stages": ns, "launch_pdl": pdl})


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
@pytest.mark.parametrize("which,skip", [(0, False), (1, False), (1, True)],
                         ids=["gate_up", "down", "down_skip"])
def test_sm90_pdl_order_no_spills_pipelined(which: int, skip: bool) -> None:
    """With ``kernels.pdl.USE_PDL`` (kernels/pdl.py) every global load comes after the wait and the
    dependents are signalled after it; without it no griddepcontrol. No register spills, and the
    K loop's loads are asynchronous copies (software-pipelined). The same for the down kernel's
    skipped-pairs build."""
    ptx, spills = _compile_sm90(which, False, skip)
    assert "griddepcontrol" not in ptx
    assert spills == [0]
    assert "cp.async" in ptx
    ptx, spills = _compile_sm90(which, True, skip)
    assert loads_before_pdl_wait(ptx) == []
    assert spills == [0]


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton's CUDA backend (and not the interpreter)")
@pytest.mark.parametrize("which", [0, 1], ids=["gate_up", "down"])
def test_sm90_engine_tiles_of_long_forwards_do_not_spill(which: int) -> None:
    """The 32-, 64- and 128-row tiles ``block_m_for`` gives forwards past 384, 768 and 1792
    tokens build without register spills, with the PDL order and a pipelined K loop."""
    for block_m in (32, 64, 128):
        ptx, spills = _compile_sm90(which, True, block_m=block_m)
        assert loads_before_pdl_wait(ptx) == [] and "cp.async" in ptx
        assert spills == [0], block_m


# ----------------------------------------------------------------------------- CUDA

XS = {"e": 257, "k": 9, "hidden": 2048, "inter": 512}  # 256 routed + the folded shared expert


@pytest.fixture(scope="module")
def xs_experts() -> tuple[torch.Tensor, torch.Tensor]:
    return _experts(XS["e"], XS["hidden"], XS["inter"], torch.bfloat16, seed=0, device="cuda")


def _xs_tokens(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _tokens(t, XS["k"], XS["e"], XS["hidden"], torch.bfloat16, seed, "shared", "cuda")


@cuda
@pytest.mark.parametrize("t", [1, 4, 300])
def test_cuda_xs21_matches_fused_moe(t: int, xs_experts) -> None:
    gu, dn = xs_experts
    args = (*_xs_tokens(t, seed=t), gu, dn)
    out = sorted_moe_experts(*args)
    assert out.shape == (t, XS["k"], XS["hidden"]) and out.dtype == torch.bfloat16
    fused = fused_moe_experts(*args, reduce=False)
    assert _rel_err(out, fused) <= 2e-2
    ref = fp32_reference(*args)  # fp32 math, summed over the pairs
    assert _rel_err(out.float().sum(1), ref) <= 2e-2
    assert _rel_err(fused.float().sum(1), ref) <= 2e-2


@cuda
def test_cuda_xs21_sorted_gives_the_fused_invariant_bits(xs_experts) -> None:
    """The batch-invariant mode's "auto" MoE runs the fused kernels for short forwards and these
    for long ones; a token keeps its bits across the switch only if both compute every pair
    bitwise the same (measured on the H200; asserted here, and checked by the engine on its
    own weights, ``batch_invariant.sorted_agrees_with_fused``)."""
    from laguna_dflash.kernels import batch_invariant

    gu, dn = xs_experts
    for t in (1, 16, 65, 300):  # 300: the fused path in two launches
        x, ids, w = _xs_tokens(t, seed=100 + t)
        fused = batch_invariant._fused_experts(x, ids, w, gu, dn)
        assert torch.equal(sorted_moe_experts(x, ids, w, gu, dn, block_m=batch_invariant.MOE_BLOCK_M),
                           fused), t
    saved = batch_invariant._agreement
    batch_invariant._agreement = {}
    try:
        assert batch_invariant.sorted_agrees_with_fused(gu, dn)
        assert batch_invariant.moe_kernel_for(batch_invariant.MOE_FUSED_MAX_TOKENS + 1, gu, dn) == "sorted"
    finally:
        batch_invariant._agreement = saved


@cuda
def test_cuda_row_independence_bitwise(xs_experts) -> None:
    """Token t's pairs alone (T = 1) == among the first 37 == among 300 == in a shuffled batch of
    300, bitwise: the tile a pair lands in, its row there and its tile mates do not matter."""
    gu, dn = xs_experts
    x, ids, w = _xs_tokens(300, seed=7)
    full = sorted_moe_experts(x, ids, w, gu, dn)
    first = sorted_moe_experts(x[:37], ids[:37], w[:37], gu, dn)
    assert torch.equal(first, full[:37])
    for t in range(37):
        alone = sorted_moe_experts(x[t : t + 1], ids[t : t + 1], w[t : t + 1], gu, dn)
        assert torch.equal(alone[0], full[t]), t
    perm = torch.randperm(300, device="cuda")
    assert torch.equal(sorted_moe_experts(x[perm], ids[perm], w[perm], gu, dn), full[perm])
    # a token's pairs in another slot order: the same per-pair outputs
    flip = sorted_moe_experts(x, ids.flip(1), w.flip(1), gu, dn)
    assert torch.equal(flip.flip(1), full)


@cuda
def test_cuda_skipped_pairs_xs21_and_graph_capture() -> None:
    """XS-2.1 widths (9 pairs a token, 20 of 40 experts on this rank), bf16 and fp32: the rank's
    pairs are the global call's bits, the skipped ones zeros, their h rows unwritten; the fused
    invariant kernels give the same bits (the batch-invariant mode's "auto" mixes the two); no
    host sync; a captured graph replays another skip pattern as eager computes it."""
    from laguna_dflash.kernels import batch_invariant

    for dtype in (torch.bfloat16, torch.float32):
        for t in (1, 4, 300):
            full, rank, skipped = ep_problem(t, 9, 40, 10, 30, 2048, 512, dtype, seed=t, device="cuda")
            pairs = check_skipped_pairs(sorted_moe_experts, full, rank, skipped, module=grouped_moe,
                                        h_rows=_skipped_h_rows(20))
            if dtype == torch.bfloat16:
                fused = batch_invariant._fused_experts(*rank, has_skipped_pairs=True)
                assert torch.equal(fused, pairs), t
    full, rank, skipped = ep_problem(64, 9, 40, 10, 30, 2048, 512, torch.bfloat16, seed=9, device="cuda")
    x, local, w, gate_up, down = (a.clone() if a.dim() < 3 else a for a in rank)
    eager, static_out, graph = eager_then_graphed(  # a host sync in align_pairs would raise
        lambda: sorted_moe_experts(x, local, w, gate_up, down, has_skipped_pairs=True))
    assert torch.equal(static_out, eager)
    _, other, _ = ep_problem(64, 9, 40, 10, 30, 8, 4, torch.bfloat16, seed=10)
    local.copy_(other[1])
    w.copy_(other[2])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, sorted_moe_experts(x, local, w, gate_up, down, has_skipped_pairs=True))
    assert not torch.isnan(static_out).any() and torch.all(static_out[local == -1] == 0)


@cuda
@pytest.mark.parametrize("t", [512, 1024, 2048])
def test_cuda_xs21_engine_tiles_of_long_forwards(t: int, xs_experts) -> None:
    """At the tile rows the engine takes past 384 / 768 / 1792 tokens (``block_m_for``: 32 / 64 /
    128) the
    pairs match the 16-row tiles' to bf16 rounding (another MMA shape: the same products, maybe
    other last bits) and the fp32 reference; a CUDA graph replays them bitwise."""
    gu, dn = xs_experts
    args = (*_xs_tokens(t, seed=t), gu, dn)
    block_m = grouped_moe.block_m_for(t)
    assert block_m > grouped_moe.DEFAULT_BLOCK_M
    out = sorted_moe_experts(*args, block_m=block_m)
    assert _rel_err(out, sorted_moe_experts(*args)) <= 1e-2
    assert _rel_err(out.float().sum(1), fp32_reference(*args)) <= 2e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = sorted_moe_experts(*args, block_m=block_m)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, out)


@cuda
def test_cuda_no_sync_and_graph_capture(xs_experts) -> None:
    gu, dn = xs_experts
    x, ids, w = (a.clone() for a in _xs_tokens(64, seed=1))
    sorted_moe_experts(x, ids, w, gu, dn)  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync in align_pairs would raise
    try:
        eager = sorted_moe_experts(x, ids, w, gu, dn)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = sorted_moe_experts(x, ids, w, gu, dn)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager)
    # new tokens and routing in the same buffers: replay == eager on them
    nx, nids, nw = _xs_tokens(64, seed=2)
    x.copy_(nx)
    ids.copy_(nids)
    w.copy_(nw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, sorted_moe_experts(x, ids, w, gu, dn))


@cuda
@pytest.mark.parametrize("inter", [1024, 512], ids=["width1024", "tp2-width512"])
@pytest.mark.parametrize("t", [1, 4, 300])
def test_cuda_s21_matches_fused_moe(t: int, inter: int) -> None:
    """S-2.1 on the default tiles: 11 pairs a token (top-10 + the folded shared expert), hidden
    3072, expert width 1024 (512 a rank under 2-way TP), bf16."""
    gu, dn = _experts(S21["e"], S21["hidden"], inter, torch.bfloat16, seed=0, device="cuda")
    args = (*_tokens(t, S21["k"], S21["e"], S21["hidden"], torch.bfloat16, t, "shared", "cuda"), gu, dn)
    out = sorted_moe_experts(*args)
    assert out.shape == (t, S21["k"], S21["hidden"])
    fused = fused_moe_experts(*args, reduce=False)
    assert _rel_err(out, fused) <= 2e-2
    ref = fp32_reference(*args)
    assert _rel_err(out.float().sum(1), ref) <= 2e-2
