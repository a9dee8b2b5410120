"""Counter-based Exp(1) noise for seeded sampling: a pure function of (seed, position, column).

The sampler's exponential race (``argmax(p / E)``, engine/sampler.py) needs, for a seeded
request, one ``E ~ Exp(1)`` a vocabulary column at each output position. Here that noise is::

    x = Philox4x32-10(key = (seed lo, seed hi), counter = (v >> 2, pos lo, pos hi, STREAM))[v & 3]
    u = (2 * (x >> 9) + 1) * 2^-24                   (float64; exact)
    E = float32(-log(u))                             (log in float64, rounded once to float32)

* Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3",
  SC'11), written from the paper: a 128-bit counter ``(c0, c1, c2, c3)`` and a 64-bit key
  ``(k0, k1)``, ten rounds of::

      (c0, c1, c2, c3) <- (hi(M1 c2) ^ c1 ^ k0,  lo(M1 c2),  hi(M0 c0) ^ c3 ^ k1,  lo(M0 c0))
      M0 = 0xD2511F53, M1 = 0xCD9E8D57    (hi / lo: the two 32-bit halves of the 64-bit product)

  with the key bumped by the Weyl constants ``(0x9E3779B9, 0xBB67AE85)`` (mod 2^32) before
  every round but the first. The Random123 known-answer vectors hold
  (tests/test_kernel_counter_noise.py).
* Key: the seed's 64 bits (a Python int taken mod 2^64, :func:`seed_key`: torch's
  ``manual_seed`` accepts signed and unsigned 64-bit seeds the same way). Counter: the column's
  group of four ``v >> 2`` (``v < 2^32``), the output position ``pos`` (0 = the request's first
  generated token; two 32-bit words) and a fixed stream word ``STREAM`` that keeps this noise
  apart from any other use of the same seed and counter. Column ``v`` takes output word
  ``v & 3`` (the words of the final state in Philox order ``c0, c1, c2, c3``), so one Philox
  call (ten rounds) yields four neighbouring columns: a quarter of the work of one word a
  column. The four words of a counter are as independent as those of different counters (the
  generator's output is the whole 128-bit block; Random123 and cuRAND's Philox use all four).
* Mapping: the top 23 bits ``m = x >> 9`` pick the midpoint of one of 2^23 equal bins of
  (0, 1): ``u = (2m + 1) / 2^24`` in ``[2^-24, 1 - 2^-24]``, never 0 (no ``-log 0 = inf``) and
  never 1 (no ``E = 0``, whose ``p / 0`` an argmax could not rank). Every such ``u`` is exact in
  float32 and float64. So ``E`` lies in ``[5.96e-8, 16.64]`` and takes 2^23 equiprobable values.
* ``E`` is ``-log(u)`` in float64 rounded once to float32. Over all 2^23 values of ``u`` the
  float64 log lies at least 74 float64 ulps from a float32 rounding boundary (checked
  exhaustively by the tests), so any float64 log within a few ulps (glibc, SLEEF, CUDA's
  libdevice, numpy in Triton's interpreter) rounds to the same float32: ``E`` is the same BITS
  on every device and in every position of a tensor (a float32 log is not: torch's vectorised
  and scalar CPU loops, or Triton's approximate GPU log, differ in the last bit now and then).

Hence a seeded request's noise at an output position does not depend on the step kind
(prefill, decode, a verify of any K), the batch, acceptance, preemption or the device.

:func:`counter_exponential` runs the Triton kernel on CUDA (and on the CPU under Triton's
interpreter, the tests), else :func:`counter_exponential_reference` (numpy uint64 words on the
host, where a 32 x 32-bit product is exact; any device); both give the same bits. On one CPU
thread here the reference takes 0.23 ms a ``[1, 4096]`` row and 2.5 ms a ``[1, 100352]`` one,
against 0.10 / 2.0 ms for torch's ``exponential_`` (torch int64 ops with 16-bit halves for the
products: 0.9 / 5.5 ms; one word a column: 1.3 / 17 ms).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
import torch

from .availability import interpret_mode, triton_can_run
from .jit import jit_functions

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["BLOCK", "STREAM", "can_use", "counter_exponential", "counter_exponential_reference",
           "exponential_from_bits", "kernel_uniform_bits", "philox_words", "seed_key", "uniform_bits_reference"]

# The A/B switch (False: the reference on every device).
USE_KERNEL = True
BLOCK = 1024  # columns a program (BLOCK // 4 Philox counters: 2 a thread with 4 warps)
#: counter word 3: this noise's stream ("EXP1" in ASCII)
STREAM = 0x45585031
_MASK32 = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # the round multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # the key's Weyl increments
_ROUNDS = 10
_TWO_POW_M24 = 2.0**-24
_CPU_CHUNK = 2**14  # counters (4 columns each) of a chunk of the reference on the CPU


def seed_key(seed: int) -> int:
    """A request seed (any Python int; the server takes signed 64-bit seeds and choice ``i`` of
    ``n`` adds ``i``) -> the int64 holding its bits mod 2^64 (the Philox key's two words)."""
    s = int(seed) % 2**64
    return s - 2**64 if s >= 2**63 else s


# ---- the reference (numpy uint64: a 32 x 32-bit product is exact below 2^64) ----------------

_U32 = np.uint64(_MASK32)
_S32 = np.uint64(32)


def philox_words(c0: np.ndarray, c1: np.ndarray, c2: np.ndarray, c3: np.ndarray,
                 k0: np.ndarray, k1: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The four words ``(c0, c1, c2, c3)`` of Philox4x32-10 of counter ``(c0, c1, c2, c3)``
    under key ``(k0, k1)``: broadcastable uint64 arrays holding 32-bit values (left as they
    are) -> four uint64 arrays in [0, 2^32) (each of a shape the inputs broadcast to). The round
    products ``M c`` are below 2^64, so uint64 holds them exactly: high word ``p >> 32``, low
    word ``p & (2^32 - 1)``."""
    m0, m1, w0, w1 = np.uint64(_M0), np.uint64(_M1), np.uint64(_W0), np.uint64(_W1)
    for r in range(_ROUNDS):
        if r:  # the key bump between rounds
            k0, k1 = (k0 + w0) & _U32, (k1 + w1) & _U32
        p0, p1 = c0 * m0, c2 * m1
        c0, c1, c2, c3 = (p1 >> _S32) ^ c1 ^ k0, p1 & _U32, (p0 >> _S32) ^ c3 ^ k1, p0 & _U32
    return c0, c1, c2, c3


def uniform_bits_reference(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """The Philox word of every (row, column): ``[R, V]`` int64 in [0, 2^32) on the seeds'
    device (computed on the host); column ``v`` is word ``v & 3`` of counter
    ``(v >> 2, pos lo, pos hi, STREAM)``.

    Args:
        seeds: ``[R]`` int64, the key's 64 bits (:func:`seed_key`).
        positions: ``[R]`` int64, ``>= 0``: the output position (counter words 1, 2).
        vocab: ``V``, the columns (``v >> 2`` is counter word 0), ``<= 2^32``.
    """
    assert seeds.shape == positions.shape and seeds.dim() == 1, (seeds.shape, positions.shape)
    assert 0 <= vocab <= 2**32
    rows, n4 = seeds.shape[0], -(-vocab // 4)  # n4 counters a row, four columns each
    # [R, 1] words; int64 -> uint64 keeps the 64 bits (two's complement)
    key = seeds.to(torch.int64).cpu().numpy().astype(np.uint64).reshape(-1, 1)
    pos = positions.to(torch.int64).cpu().numpy().astype(np.uint64).reshape(-1, 1)
    k0, k1, c1, c2 = key & _U32, key >> _S32, pos & _U32, pos >> _S32
    c3 = np.full_like(c1, STREAM)
    # [R, n4, 4]: word j of counter i is column 4 i + j (the last counter's words past V unused)
    words = np.empty((rows, n4, 4), dtype=np.uint64)
    # in chunks of ~2^14 counters, so that the ~120 passes over a chunk stay in cache
    step = max(1, _CPU_CHUNK // max(rows, 1))
    for start in range(0, n4, step):
        end = min(n4, start + step)
        c0 = np.arange(start, end, dtype=np.uint64).reshape(1, -1)  # [1, n]
        for j, w in enumerate(philox_words(c0, c1, c2, c3, k0, k1)):
            words[:, start:end, j] = w
    flat = torch.from_numpy(words.view(np.int64).reshape(rows, 4 * n4)[:, :vocab])  # values < 2^32
    return flat.contiguous().to(seeds.device)


def exponential_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Philox words (int64 in [0, 2^32)) -> ``E = float32(-log((2 (x >> 9) + 1) 2^-24))``."""
    u = ((bits >> 9) * 2 + 1).to(torch.float64) * _TWO_POW_M24  # exact: < 2^24 times 2^-24
    return u.log_().neg_().to(torch.float32)


def counter_exponential_reference(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """The noise without the kernel, on the tensors' device: ``[R, V]`` float32 Exp(1) draws, row ``r``
    keyed by ``seeds[r]`` (int64 ``[R]``) at output position ``positions[r]`` (int64 ``[R]``);
    the same bits as the kernel."""
    return exponential_from_bits(uniform_bits_reference(seeds, positions, vocab))


# ---- the Triton kernel ------------------------------------------------------------------------

def _store_word(ptrs, cols, vocab, x, BITS: tl.constexpr):
    # one Philox word a lane (uint32) -> its column: the word itself (BITS, int64 out) or
    # E = -log(u), u = (2 (x >> 9) + 1) 2^-24 exact in float64, rounded once to float32
    if BITS:
        tl.store(ptrs, x.to(tl.int64), mask=cols < vocab)
    else:
        odd = (x >> 9) * 2 + 1
        u = odd.to(tl.float64) * 5.9604644775390625e-08
        tl.store(ptrs, (-tl.log(u)).to(tl.float32), mask=cols < vocab)


def _counter_exponential_kernel(seed_ptr, pos_ptr, out_ptr, vocab, stride_out, BLOCK: tl.constexpr,
                                BITS: tl.constexpr):
    # program (r, b): columns [b BLOCK, (b + 1) BLOCK) of row r, from the BLOCK // 4 counters
    # [b BLOCK / 4, (b + 1) BLOCK / 4): counter i gives columns 4i, 4i + 1, 4i + 2, 4i + 3 its
    # words c0, c1, c2, c3. All Philox words are uint32, so products and sums wrap mod 2^32 and
    # shifts are logical; umulhi gives the product's high word. BITS (the tests): store the
    # Philox words themselves (int64 out) instead of E.
    r = tl.program_id(0).to(tl.int64)
    ctrs = tl.program_id(1) * (BLOCK // 4) + tl.arange(0, BLOCK // 4)
    seed = tl.load(seed_ptr + r)
    pos = tl.load(pos_ptr + r)
    zeros = tl.zeros([BLOCK // 4], dtype=tl.uint32)  # the counter words as full blocks from the start
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = ctrs.to(tl.uint32)
    c1 = zeros + (pos & 0xFFFFFFFF).to(tl.uint32)
    c2 = zeros + ((pos >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c3 = zeros + STREAM
    for i in tl.static_range(10):
        if i > 0:  # Weyl key bump
            k0 = k0 + 0x9E3779B9
            k1 = k1 + 0xBB67AE85
        # M0 = 0xD2511F53 multiplies c0, M1 = 0xCD9E8D57 multiplies c2
        hi0 = tl.umulhi(c0, zeros + 0xD2511F53)
        lo0 = c0 * 0xD2511F53
        hi1 = tl.umulhi(c2, zeros + 0xCD9E8D57)
        lo1 = c2 * 0xCD9E8D57
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    # cols + 3 < ceil(V / BLOCK) BLOCK <= 2^31 (V < 2^31, BLOCK a power of 2): no int32 overflow
    cols = ctrs * 4
    ptrs = out_ptr + r * stride_out + cols
    _store_word(ptrs, cols, vocab, c0, BITS)
    _store_word(ptrs + 1, cols + 1, vocab, c1, BITS)
    _store_word(ptrs + 2, cols + 2, vocab, c2, BITS)
    _store_word(ptrs + 3, cols + 3, vocab, c3, BITS)


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """The jitted kernel for one mode (``interpret`` is the cache key)."""
    del interpret
    import triton.language as tl

    ns = jit_functions(__name__, (_store_word, _counter_exponential_kernel))
    ns["STREAM"] = tl.constexpr(STREAM)  # a global a kernel reads must be a constexpr
    return ns["_counter_exponential_kernel"]


def can_use(device: torch.device | str) -> bool:
    """Whether :func:`counter_exponential` takes the kernel on ``device``: switched on, and a
    device Triton runs on (CUDA, or the CPU under its interpreter)."""
    return USE_KERNEL and triton_can_run(device)


def counter_exponential(seeds: torch.Tensor, positions: torch.Tensor, vocab: int,
                        device: torch.device | str | None = None,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """Exp(1) noise ``[R, V]`` float32: row ``r``, column ``v`` is a pure function of
    ``(seeds[r], positions[r], v)`` (module docstring), the same bits on every device.

    Args:
        seeds: ``[R]`` int64, each row's 64-bit key (:func:`seed_key` of the request's seed).
        positions: ``[R]`` int64, ``0 <= pos < 2^64``: each row's output position (0 = the
            request's first generated token).
        vocab: ``V``, ``< 2^31``.
        device: where the noise goes (default: the seeds'). Seeds or positions elsewhere are
            copied there with ``.to`` (from pageable host memory that may synchronise: the
            engine uploads them itself).
        out: optional ``[R, V]`` float32 with unit column stride on ``device`` to fill.

    Returns:
        ``out``, or a new ``[R, V]`` float32 tensor on ``device``. One launch (grid
        ``(R, ceil(V / BLOCK))``) on CUDA; the reference elsewhere.
    """
    rows = seeds.shape[0]
    assert seeds.shape == positions.shape == (rows,), (seeds.shape, positions.shape)
    assert 0 <= vocab < 2**31
    if out is None:
        out = torch.empty((rows, vocab), dtype=torch.float32,
                          device=device if device is not None else seeds.device)
    assert device is None or torch.device(device).type == out.device.type, (device, out.device)
    assert out.shape == (rows, vocab) and out.dtype == torch.float32, (out.shape, out.dtype)
    device = out.device  # with its index ("cuda" -> "cuda:0")
    seeds = seeds.to(device=device, dtype=torch.int64)
    positions = positions.to(device=device, dtype=torch.int64)
    if rows == 0 or vocab == 0:
        return out
    if can_use(device) and out.stride(1) == 1:
        _kernel(interpret_mode())[(rows, -(-vocab // BLOCK))](
            seeds, positions, out, vocab, out.stride(0), BLOCK=BLOCK, BITS=False, num_warps=4)
        return out
    return out.copy_(counter_exponential_reference(seeds, positions, vocab))


def kernel_uniform_bits(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """The kernel's Philox words ``[R, V]`` int64 in [0, 2^32) (the tests compare them with
    :func:`uniform_bits_reference`); ``seeds`` and ``positions`` ``[R]`` int64 on a device the
    kernel runs on (:func:`can_use`)."""
    assert can_use(seeds.device) and positions.device == seeds.device
    out = torch.empty((seeds.shape[0], vocab), dtype=torch.int64, device=seeds.device)
    if out.numel():
        _kernel(interpret_mode())[(seeds.shape[0], -(-vocab // BLOCK))](
            seeds, positions, out, vocab, out.stride(0), BLOCK=BLOCK, BITS=True, num_warps=4)
    return out
