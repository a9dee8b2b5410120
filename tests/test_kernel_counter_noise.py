"""Counter-based Exp(1) noise (``kernels/counter_noise.py``): Philox4x32-10 and its mapping.

* The reference (numpy uint64) against a plain-Python Philox4x32-10 (itself checked on the Random123
  known-answer vectors): column ``v`` is word ``v & 3`` of counter ``v >> 2``, at columns,
  vocabularies not a multiple of 4, positions past 2^32 and seeds of every sign.
* The float mapping: ``E`` is never 0 or inf, and ``float32(-log(u))`` through a float64 log is
  device-independent (exhaustively, over every one of the 2^23 values of ``u``).
* Statistics: Exp(1) by mean and a Kolmogorov-Smirnov bound that a uniform (the mapping's ``u``
  itself) fails; seeds and positions give different, uncorrelated rows; the four columns of a
  counter are neither equal nor correlated; the exponential race over it samples ``p``.
* Under Triton's CPU interpreter (child pytest, ``TRITON_INTERPRET=1``): the kernel's Philox
  words and ``E`` equal the reference's bit for bit; ``counter_exponential`` takes the kernel.
* On CUDA (skipped without one): the same at the engine's shapes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from interpreter_child import HAS_TRITON, interpreted, run_interpreted_child

from laguna_dflash.kernels import counter_noise as cn

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and triton")
MASK = 0xFFFFFFFF

# ---- a plain-Python Philox4x32-10, written from the paper --------------------------------------


def philox4x32_10(ctr: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & MASK, (k1 + 0xBB67AE85) & MASK
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK, (p0 >> 32) ^ c3 ^ k1, p0 & MASK
    return c0, c1, c2, c3


# Random123's kat_vectors for philox4x32 with 10 rounds: (counter, key, output)
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((MASK, MASK, MASK, MASK), (MASK, MASK), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]

SEEDS = [0, 1, 123, -1, -(2**63), 2**63 - 1, 2**63 + 5, 2**64 - 1, 987654321987654321]
POSITIONS = [0, 1, 2, 7, 2**31, 2**32 - 1, 2**32, 2**32 + 3, 2**40 + 17]


def expected_word(seed: int, pos: int, v: int) -> int:
    """Column ``v``'s word: word ``v & 3`` of Philox of counter ``(v >> 2, pos lo, pos hi, STREAM)``."""
    s = seed % 2**64
    return philox4x32_10((v >> 2, pos & MASK, pos >> 32, cn.STREAM), (s & MASK, s >> 32))[v & 3]


def table(seeds: list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([cn.seed_key(s) for s in seeds], dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64))


# ---- the reference ------------------------------------------------------------------------------


@pytest.mark.parametrize("ctr, key, want", KAT)
def test_python_philox_and_the_reference_rounds_give_the_known_answers(ctr, key, want):
    assert philox4x32_10(ctr, key) == want
    got = cn.philox_words(*(np.array([x], dtype=np.uint64) for x in (*ctr, *key)))
    assert [w.tolist() for w in got] == [[x] for x in want]


@pytest.mark.parametrize("vocab", [70000, 70001, 70002, 70003])
def test_reference_words_equal_the_python_philox(vocab):
    seeds, positions = SEEDS, POSITIONS
    bits = cn.uniform_bits_reference(*table(seeds, positions), vocab)
    assert bits.dtype == torch.int64 and bits.shape == (len(seeds), vocab) and bits.is_contiguous()
    for r, (s, p) in enumerate(zip(seeds, positions)):
        for v in (0, 1, 2, 3, 4, 511, 1023, 1024, 65535, 65536, 69999, *range(69996, vocab)):
            assert int(bits[r, v]) == expected_word(s, p, v), (s, p, v)
    assert 0 <= int(bits.min()) and int(bits.max()) <= MASK


@pytest.mark.parametrize("vocab", [1, 2, 3, 4, 5, 9])
def test_reference_words_of_tiny_vocabularies(vocab):
    bits = cn.uniform_bits_reference(*table(SEEDS, POSITIONS), vocab)
    want = [[expected_word(s, p, v) for v in range(vocab)] for s, p in zip(SEEDS, POSITIONS)]
    assert bits.tolist() == want


def test_reference_chunks_on_the_cpu_cut_between_counters(monkeypatch):
    # chunks of a few counters (and a last one cut short): the words land in the right columns
    seeds, positions = table(SEEDS[:3], POSITIONS[:3])
    want = cn.uniform_bits_reference(seeds, positions, 1003)
    monkeypatch.setattr(cn, "_CPU_CHUNK", 21)  # 7 counters (28 columns) a chunk at 3 rows
    assert torch.equal(cn.uniform_bits_reference(seeds, positions, 1003), want)
    assert [int(want[0, v]) for v in (27, 28, 1002)] == [expected_word(SEEDS[0], POSITIONS[0], v) for v in (27, 28, 1002)]


def test_seed_key_takes_the_seed_mod_2_64():
    assert cn.seed_key(-1) == -1 and cn.seed_key(2**64 - 1) == -1 and cn.seed_key(2**63) == -(2**63)
    assert cn.seed_key(5) == 5 == cn.seed_key(2**64 + 5)


def test_exponential_is_the_mapping_of_the_words():
    seeds, positions = table(SEEDS[:4], POSITIONS[:4])
    bits = cn.uniform_bits_reference(seeds, positions, 3000)
    e = cn.counter_exponential_reference(seeds, positions, 3000)
    assert e.dtype == torch.float32
    for r in range(4):
        for v in (0, 17, 2999):
            u = (2 * (int(bits[r, v]) >> 9) + 1) / 2**24
            assert float(e[r, v]) == float(np.float32(-math.log(u)))


def test_the_mapping_never_gives_zero_or_inf_and_its_float32_is_device_independent():
    # every u = (2m + 1) / 2^24 (m < 2^23): E in [2^-24-ish, 16.64], and the float64 log lies
    # >= 64 float64 ulps from a float32 rounding boundary, so any float64 log within a few ulps
    # (each device's, each loop's) rounds to the same float32
    lowest_margin = math.inf
    for start in range(0, 2**23, 2**21):
        m = np.arange(start, start + 2**21, dtype=np.float64)
        e64 = -np.log((2 * m + 1) * 2.0**-24)
        e32 = e64.astype(np.float32)
        c = e32.astype(np.float64)
        up = np.nextafter(e32, np.float32(np.inf)).astype(np.float64)
        down = np.nextafter(e32, np.float32(-np.inf)).astype(np.float64)
        margin = np.minimum(np.abs((c + up) / 2 - e64), np.abs(e64 - (c + down) / 2)) / np.spacing(e64)
        lowest_margin = min(lowest_margin, float(margin.min()))
        assert (e32 > 0).all() and np.isfinite(e32).all()
    assert lowest_margin >= 64, lowest_margin
    ends = cn.exponential_from_bits(torch.tensor([0, MASK]))
    assert ends.tolist() == [float(np.float32(24 * math.log(2))), float(np.float32(-math.log1p(-2.0**-24)))]


def test_cpu_without_the_interpreter_is_the_reference(monkeypatch):
    seeds, positions = table(SEEDS, POSITIONS)
    want = cn.counter_exponential_reference(seeds, positions, 777)
    assert torch.equal(cn.counter_exponential(seeds, positions, 777), want)
    out = torch.full((len(SEEDS), 777), -1.0)
    assert cn.counter_exponential(seeds, positions, 777, "cpu", out=out) is out and torch.equal(out, want)
    assert cn.counter_exponential(seeds[:0], positions[:0], 777).shape == (0, 777)
    monkeypatch.setattr(cn, "USE_KERNEL", False)
    assert not cn.can_use("cpu")


# ---- statistics --------------------------------------------------------------------------------


def ks_exponential(x: torch.Tensor) -> float:
    """Kolmogorov-Smirnov distance between the sample ``x`` and Exp(1)."""
    x = x.double().flatten().sort().values
    n = x.numel()
    cdf = 1.0 - torch.exp(-x)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return float(torch.maximum(i / n - cdf, cdf - (i - 1) / n).max())


def test_noise_is_exp1_and_a_uniform_fails_the_same_check():
    seeds, positions = table([3, 4, -9, 2**63 + 1], [0, 1, 5, 2**33])
    e = cn.counter_exponential_reference(seeds, positions, 50000)  # 200k draws
    n = e.numel()
    assert abs(float(e.double().mean()) - 1.0) < 5 / math.sqrt(n)  # the sd of Exp(1) is 1
    assert abs(float(e.double().var()) - 1.0) < 0.03
    bound = 1.95 / math.sqrt(n)  # KS at alpha 0.001
    assert ks_exponential(e) < bound
    u = torch.exp(-e)  # the mapping's uniform: a wrong mapping fails the check
    assert ks_exponential(u) > 10 * bound
    assert ks_exponential(2 * e) > 10 * bound  # so does Exp(1/2)


def test_rows_of_other_seeds_or_positions_differ_and_do_not_correlate():
    seeds, positions = table([1, 1, 1, 2, -1, 2**64 - 1], [0, 1, 2**32, 0, 0, 0])
    e = cn.counter_exponential_reference(seeds, positions, 20000)
    assert torch.equal(e[4], e[5])  # -1 and 2^64 - 1 are the same 64 bits
    for a in range(5):
        for b in range(a + 1, 5):
            assert (e[a] == e[b]).float().mean() < 0.01, (a, b)
            r = torch.corrcoef(torch.stack([e[a], e[b]]).double())[0, 1]
            assert abs(float(r)) < 0.05, (a, b, float(r))
    # neighbouring columns of a row are uncorrelated too
    assert abs(float(torch.corrcoef(torch.stack([e[0, :-1], e[0, 1:]]).double())[0, 1])) < 0.05


def test_the_four_columns_of_a_counter_neither_repeat_nor_correlate():
    # columns 4i .. 4i+3 are the four words of one Philox call: every pair of them differs (a
    # repeat of one word has chance 2^-32 a pair, of one E 2^-23) and does not correlate, in E
    # and in the words' top bits
    seeds, positions = table([11, -5, 2**63 + 9, 0], [3, 0, 2**32 + 1, 12345])
    bits = cn.uniform_bits_reference(seeds, positions, 100000)
    e = cn.exponential_from_bits(bits).view(4, -1, 4).transpose(0, 2).reshape(4, -1).double()
    words = bits.view(4, -1, 4).transpose(0, 2).reshape(4, -1)  # [word j, 100k counters]
    bound = 5 / math.sqrt(words.shape[1])  # ~5 sd of a correlation of independent samples
    for j in range(4):
        for k in range(j + 1, 4):
            assert not (words[j] == words[k]).any(), (j, k)
            assert (e[j] == e[k]).sum() <= 5, (j, k)
            assert abs(float(torch.corrcoef(torch.stack([e[j], e[k]]))[0, 1])) < bound, (j, k)
            hj, hk = (words[j] >> 31).double(), (words[k] >> 31).double()  # the top bit
            assert abs(float(torch.corrcoef(torch.stack([hj, hk]))[0, 1])) < bound, (j, k)
    # and each word on its own is Exp(1): no word of the four is off
    for j in range(4):
        assert ks_exponential(e[j]) < 1.95 / math.sqrt(e.shape[1]), j


def test_the_exponential_race_over_it_samples_p():
    p = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03, 0.0])
    n = 40000
    seeds, positions = torch.full((n,), 77, dtype=torch.int64), torch.arange(n)
    picks = torch.argmax(p / cn.counter_exponential_reference(seeds, positions, 6), dim=-1)
    freq = torch.bincount(picks, minlength=6).double() / n
    assert freq[5] == 0
    sd = torch.sqrt(p.double() * (1 - p.double()) / n)
    assert ((freq - p.double()).abs() <= 5 * sd + 1e-12).all(), freq


# ---- the kernel ------------------------------------------------------------------------------


def check_kernel(seeds: list[int], positions: list[int], vocab: int, device: str) -> None:
    s, p = (t.to(device) for t in table(seeds, positions))
    bits = cn.kernel_uniform_bits(s, p, vocab)
    want_bits = cn.uniform_bits_reference(s, p, vocab)
    assert torch.equal(bits, want_bits)
    assert cn.can_use(device)
    e = cn.counter_exponential(s, p, vocab, device)
    assert e.dtype == torch.float32 and e.shape == (len(seeds), vocab) and e.device.type == device
    # the same bits, not just within an ulp: the float64 log rounds alike everywhere
    assert torch.equal(e, cn.exponential_from_bits(want_bits))
    assert torch.equal(e.cpu(), cn.counter_exponential_reference(*table(seeds, positions), vocab))


@interpreted
@pytest.mark.parametrize("vocab", [1, 2, 7, cn.BLOCK, cn.BLOCK + 1, cn.BLOCK + 3, 5000])
def test_interpreted_kernel_equals_the_reference(vocab):
    check_kernel(SEEDS, POSITIONS, vocab, "cpu")


def check_row_strided_out(device: str) -> None:
    s, p = table(SEEDS[:3], POSITIONS[:3])
    wide = torch.full((5, 3000), -1.0, device=device)
    out = wide[1:4, 100:2101]  # 2001 columns: the last counter's words 1..3 are masked off
    assert cn.counter_exponential(s.to(device), p.to(device), 2001, device, out=out) is out
    assert torch.equal(out.cpu(), cn.counter_exponential_reference(s, p, 2001))
    assert (wide[0] == -1).all() and (wide[4] == -1).all() and (wide[1:4, :100] == -1).all()
    assert (wide[1:4, 2101:] == -1).all()


@interpreted
def test_interpreted_kernel_fills_a_row_strided_out():
    check_row_strided_out("cpu")


def test_kernel_under_triton_interpreter():
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    run_interpreted_child(__file__)


@needs_cuda
def test_cuda_kernel_equals_the_reference():
    check_kernel(SEEDS, POSITIONS, 5000, "cuda")
    check_kernel(SEEDS, POSITIONS, 5003, "cuda")
    g = torch.Generator().manual_seed(0)
    for rows, vocab in ((1, 100352), (256, 100352), (3, 151936), (2, 100351)):
        seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=g).tolist()
        positions = torch.randint(0, 2**40, (rows,), generator=g).tolist()
        check_kernel(seeds, positions, vocab, "cuda")
    check_row_strided_out("cuda")


@needs_cuda
def test_cuda_graph_replay_reads_new_positions():
    s, p = (t.cuda() for t in table(SEEDS, POSITIONS))
    cn.counter_exponential(s, p, 4096)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cn.counter_exponential(s, p, 4096)
    for step in range(3):
        p.add_(1)
        graph.replay()
        want = [q + step + 1 for q in POSITIONS]
        assert torch.equal(out.cpu(), cn.counter_exponential_reference(*table(SEEDS, want), 4096))
