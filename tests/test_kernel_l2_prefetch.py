"""kernels/l2_prefetch.py: the chunk plan covers every byte of a weight exactly once, and the
prefetch only runs where it can (CUDA sm90+, compiled, contiguous and 16-byte aligned)."""

from __future__ import annotations

import pytest
import torch

from laguna_dflash.kernels import l2_prefetch


def _chunks(nbytes: int, chunk: int, num_parts: int, block: int) -> list[tuple[int, int]]:
    # the kernel's (offset, size) per lane: size = clamp(nbytes - offset, 0, chunk)
    out = []
    for part in range(num_parts):
        for lane in range(block):
            off = (part * block + lane) * chunk
            out.append((off, min(max(nbytes - off, 0), chunk)))
    return out


@pytest.mark.parametrize("nbytes,num_parts,block", [(33_554_432, 256, 256), (16, 1, 256),
                                                      (48_000, 7, 32), (4096 * 16 + 16, 3, 4)])
def test_plan_covers_every_byte_once(nbytes, num_parts, block):
    chunk = l2_prefetch.chunk_bytes(nbytes, num_parts, block)
    assert chunk % 16 == 0 and chunk > 0
    covered = 0
    for off, size in _chunks(nbytes, chunk, num_parts, block):
        assert size % 16 == 0 and size >= 0  # the instruction's size operand: a multiple of 16
        if size:
            assert off == covered  # contiguous, in order, no overlap
            covered += size
    assert covered == nbytes


def test_plan_is_none_where_the_prefetch_cannot_run():
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert l2_prefetch.plan(None, 4) is None
    assert l2_prefetch.plan(w, 4) is None  # CPU
    assert not l2_prefetch.prefetch_l2(w)


def test_region_is_a_whole_number_of_16_byte_units_from_either_end():
    w = torch.arange(100 * 8, dtype=torch.bfloat16).view(100, 8)  # 1600 bytes
    tail = l2_prefetch.region(w, 1000, from_end=True)
    head = l2_prefetch.region(w, 1000)
    assert tail.numel() == head.numel() == 496  # 992 bytes
    assert torch.equal(tail, w.reshape(-1)[-496:]) and torch.equal(head, w.reshape(-1)[:496])
    assert tail.data_ptr() - w.data_ptr() == (800 - 496) * 2  # a multiple of 16 from the start
    assert l2_prefetch.region(w, 10**6).numel() == w.numel()
    assert l2_prefetch.region(w, 15) is None and l2_prefetch.region(w, 0) is None
    assert l2_prefetch.region(w[:, 1:], 1000) is None  # not contiguous


def _pieces(spread: l2_prefetch.Spread, num_parts: int, lanes: int) -> list[tuple[int, int]]:
    # ``_prefetch_l2_lanes``' (offset, size) per issuing lane: lane l < LANES of program p takes
    # piece p * LANES + l, size clamp(nbytes - offset, 0, size)
    out = []
    for c in range(num_parts * lanes):
        off = c * spread.stride
        out.append((off, min(max(spread.nbytes - off, 0), spread.size)))
    return out


@pytest.mark.parametrize("nbytes,num_parts,lanes", [(16_000_000, 128, 2), (16_000_000, 128, 1), (4096, 3, 2)])
def test_contiguous_spread_covers_every_byte_once(nbytes, num_parts, lanes):
    w = torch.zeros(nbytes // 2, dtype=torch.bfloat16)
    spread = l2_prefetch.contiguous_spread(w, num_parts * lanes)
    assert spread.num_pieces <= num_parts * lanes and spread.stride == spread.size
    covered = 0
    for off, size in _pieces(spread, num_parts, lanes):
        if size:
            assert off == covered and size % 16 == 0
            covered += size
    assert covered == nbytes


def test_row_suffixes_cover_the_end_of_every_row():
    """One piece a row: the last ``max_bytes / N`` bytes (a multiple of 16) of each row, so
    the bytes covered are exactly those of ``w[:, K - piece:]``."""
    w = torch.zeros(10, 64, dtype=torch.bfloat16)  # rows of 128 bytes
    spread = l2_prefetch.row_suffixes(w, 500)  # 50 a row -> 48
    assert (spread.stride, spread.size, spread.num_pieces) == (128, 48, 10)
    start = spread.base.data_ptr() - w.data_ptr()
    covered = set()
    for off, size in _pieces(spread, 4, 3):  # 12 lanes for 10 pieces: two issue nothing
        covered.update(range(start + off, start + off + size))
    want = {r * 128 + b for r in range(10) for b in range(128 - 48, 128)}
    assert covered == want
    assert l2_prefetch.row_suffixes(w, 10**6).size == 128  # whole rows at most
    assert l2_prefetch.row_suffixes(w, 100) is None  # under 16 bytes a row
    assert l2_prefetch.row_suffixes(w.t(), 500) is None and l2_prefetch.row_suffixes(w[0], 500) is None
    assert not l2_prefetch.can_run(spread)  # CPU


def test_issue_plan_lanes_per_program(monkeypatch):
    """A region is cut into ``region_lanes`` pieces a program; a spread keeps its pieces, spread
    over the programs (ceil); more lanes than a program's threads, no program, or a prefetch that
    cannot run here: ``(None, 0)``."""
    w = torch.zeros(2048, 8192, dtype=torch.bfloat16)
    rows = l2_prefetch.row_suffixes(w, 16 << 20)
    assert l2_prefetch.issue_plan(rows, 51, 256, 2) == (None, 0)  # CPU: cannot run
    monkeypatch.setattr(l2_prefetch, "can_run", lambda spread: spread is not None)
    assert l2_prefetch.issue_plan(rows, 51, 256, 2) == (rows, 41)  # 2048 rows over 51 programs
    assert l2_prefetch.issue_plan(rows, 4, 256, 2) == (None, 0)  # 512 lanes a program
    assert l2_prefetch.issue_plan(rows, 0, 256, 2) == (None, 0)
    assert l2_prefetch.issue_plan(None, 8, 256, 2) == (None, 0)
    spread, lanes = l2_prefetch.issue_plan(l2_prefetch.region(w, 1 << 20), 128, 256, 2)
    assert lanes == 2 and spread.num_pieces == 256 and spread.nbytes == 1 << 20


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_plan_on_cuda():
    w = torch.zeros(128, 64, dtype=torch.bfloat16, device="cuda")
    sm90 = torch.cuda.get_device_capability() >= (9, 0)
    assert (l2_prefetch.plan(w, 4) is not None) == sm90
    assert l2_prefetch.plan(w[:, 1:], 4) is None  # not contiguous
    assert l2_prefetch.plan(w.view(-1)[1:], 4) is None  # not 16-byte aligned


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs a CUDA sm90+ GPU")
def test_cuda_s21_o_proj_prefetch_changes_nothing():
    """S-2.1's largest decode o_proj (3072 x 72 heads x 128, bf16: 56.6 MB) is covered by the
    plan of 256 attention programs to the byte and left unchanged by the prefetch."""
    w = torch.randn(3072, 72 * 128, device="cuda").to(torch.bfloat16)
    before = w.clone()
    nbytes, chunk = l2_prefetch.plan(w, 256)
    assert nbytes == w.numel() * 2 and chunk * 256 * l2_prefetch.PREFETCH_BLOCK >= nbytes
    assert l2_prefetch.prefetch_l2(w)
    torch.cuda.synchronize()
    assert torch.equal(w, before)
