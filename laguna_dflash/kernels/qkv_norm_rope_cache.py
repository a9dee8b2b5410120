"""The Q|K|V|gate projection with the Q/K RMSNorm + RoPE and the paged K/V write in its epilogue.

At decode, verify and drafter-block sizes (``M <= 16`` tokens) an attention layer's input runs
through two launches: the Q|K|V|gate GEMM (``kernels/skinny_gemm.py``) and the per-head
post-processing (``kernels/qk_norm_rope_cache.py``). The second exists because RMSNorm over a
head needs all ``head_dim`` outputs of that head, while the GEMM's measured tiles give a program
16 (GEMV) or 64 (dot path) of them. Here one program owns one whole head: it computes that head's
``head_dim`` output columns for every token with ``tl.dot`` and finishes them itself, so the
second launch and its dependent round trip go away. The grid shrinks to one program a head (80
for a 64-head Laguna layer) plus the gate tiles; on the H200 such a grid streams the XS-2.1
weight within ~7% of the measured GEMM configs (``benchmarks/bench_head_tiles.py``).

``weight [N, H]`` is ``Attention.qkvg_weight``: rows ``nh`` Q heads, ``nkv`` K heads, ``nkv`` V
heads (each ``head_dim`` rows), then ``gate_dim`` gate rows. Program ``p`` of the grid
``(nh + 2 nkv + ceil(gate_dim / head_dim),)`` computes ``acc [M, head_dim] = x @ W[rows of p]^T``
in fp32 (one ``tl.dot`` K loop, the skinny GEMM's ``_dot_acc``), rounds it to x's dtype ``T``
once, exactly where the GEMM's output is rounded, and then:

* Q head ``h = p``: RMSNorm with ``q_weight`` + RoPE at each token's position, the arithmetic and
  roundings of ``qk_norm_rope_cache`` (its ``_norm_rope``; the rotate-half partner comes from the
  program's registers, ``tl.gather``), stored to ``q [M, nh, head_dim]``;
* K head ``g = p - nh``: the same with ``k_weight``, cast to the cache dtype and stored to
  ``k_cache[slot_mapping[t], g]``;
* V head ``g``: cast and stored to ``v_cache[slot_mapping[t], g]``;
* gate tile: stored to ``gate [M, gate_dim]``.

So for one dot tile, the gate columns and V rows equal ``skinny_gemm`` with that tile followed
by ``qk_norm_rope_cache`` bit for bit, and q and the K rows do up to the summation order of
``mean(x^2)`` (the tile's layout against the Q/K kernel's row: about one ulp of the statistic,
which flips a rounding on well under 1% of bf16 elements; tested). With PDL a program reads positions, slots, norm
weights, cos / sin rows and its first weight tile before its wait (kernels/pdl.py rule 3), x after
it, and signals its dependents right after the wait (``PRELOAD_TILES``, ``EARLY_SIGNAL``).
Shapes alone decide the launch: CUDA-graph capturable.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import pdl
from . import qk_norm_rope_cache as _qk
from . import skinny_gemm as _sg
from .availability import interpret_mode
from .jit import DTYPE_CODE, _round_to, jit_functions
from .qk_norm_rope_cache import _norm_rope, _norm_rope_params, _rope_partner
from .skinny_gemm import _dot_acc, _dot_step, _load_w

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["HeadGemmConfig", "can_use", "qkv_norm_rope_cache"]

MAX_M = _sg.MAX_M  # tokens a launch (x is padded to 16 rows for tl.dot)
# PRELOAD_TILES: each program loads its first weight tiles (0, 1 or 2) before the PDL wait (the
# K loop's first steps peeled; the same dots in the same order), as the one-row GEMV does.
# EARLY_SIGNAL: programs signal their dependents right after the wait instead of after the K
# loop, so attention's programs become resident on the SMs the ~80-program grid leaves idle and
# load their metadata and old K/V before their own wait (kernels/pdl.py rules 2 and 3 hold:
# the signal still follows this kernel's wait, and attention reads this kernel's K/V only after
# its wait). On the H200 (XS-2.1, 1k context) the decode graph with this kernel at one token
# replayed in 2.18 ms plain, 2.07 with the early signal and 2.04-2.06 with both, against 2.11-2.12
# for the GEMV and the Q/K kernel; the 4-token verify graph in 3.77-3.79 ms every way
# (docs/PERFORMANCE.md, fifty-sixth pass). Two tiles: the input norm before this kernel leaves
# the HBM idle for ~2.5 us a layer at decode, time for a second 32 KiB tile a program (2.6 MB
# a launch at XS-2.1 size); 64 of the 8 warps' registers a thread hold both. Timed in the
# graphs, it did not pay: decode 2.04 against 2.03 ms, 4-token verify 3.69 against 3.68-3.69
# (docs/PERFORMANCE.md, fifty-ninth pass); one tile stays.
PRELOAD_TILES = 1
EARLY_SIGNAL = True


@dataclass(frozen=True)
class HeadGemmConfig:
    """The K loop's tile: ``block_k`` hidden elements a step (a power of two >= 16),
    ``num_stages`` weight tiles in flight (Triton's pipeliner), ``num_warps`` (1, 2, 4 or 8) a
    program. The H200 measured 128 x 4 stages x 4 warps best among 18 whole-head dot configs at
    1 and 4 tokens alone (``benchmarks/bench_head_tiles.py``); inside the decode graph 8 warps
    replay it in 2.03 against 2.06 ms (its span 541-551 against 582 us a step), the 4-token
    verify in 3.71 against 3.74 (docs/PERFORMANCE.md, fifty-eighth pass)."""

    block_k: int = 128
    num_stages: int = 4
    num_warps: int = 8

    def __post_init__(self) -> None:
        for name in ("block_k", "num_stages", "num_warps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"HeadGemmConfig.{name} must be a positive int, got {value!r}")
        if self.block_k & (self.block_k - 1) or self.block_k < 16:
            raise ValueError(f"HeadGemmConfig.block_k must be a power of two >= 16, got {self.block_k}")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"HeadGemmConfig.num_warps must be 1, 2, 4 or 8, got {self.num_warps}")


DEFAULT_CONFIG = HeadGemmConfig()
# fp32 operands ("ieee" dot: FMAs unrolled in the build, 4-byte tiles in shared memory) take a
# shorter K step and two stages
FP32_CONFIG = HeadGemmConfig(block_k=32, num_stages=2, num_warps=4)


def can_use(x: torch.Tensor, weight: torch.Tensor, head_dim: int) -> bool:
    """Whether :func:`qkv_norm_rope_cache` takes ``x [M, H]`` and ``weight [N, H]`` where they
    live: what :func:`skinny_gemm.can_use` accepts, ``M >= 1``, and a power-of-two ``head_dim`` of
    at least 16 (a head is one dot tile)."""
    return (
        _sg.can_use(x, weight) and x.shape[0] >= 1
        and isinstance(head_dim, int) and head_dim >= 16 and head_dim & (head_dim - 1) == 0
        and _qk.is_available(x.device)
    )


# ---- Triton kernel --------------------------------------------------------------------------------


def _qkv_norm_rope_cache_kernel(
    x_ptr, w_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, g_ptr, kc_ptr, vc_ptr,
    M, stride_xm, stride_xk, stride_wn, stride_qw, stride_kw, stride_cos, stride_sin, stride_pos,
    stride_slot, stride_qt, stride_qh, stride_gt,
    stride_kcs, stride_kch, stride_kcd, stride_vcs, stride_vch, stride_vcd,
    eps,
    N: tl.constexpr, K: tl.constexpr, GATE_DIM: tl.constexpr,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr, M_PAD: tl.constexpr, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr,
    IEEE: tl.constexpr, MASK_W: tl.constexpr, DTYPE: tl.constexpr, CACHE_DTYPE: tl.constexpr,
    PDL: tl.constexpr, PRELOAD: tl.constexpr, EARLY: tl.constexpr,
):
    # program p: rows [p HEAD_DIM, (p + 1) HEAD_DIM) of W: Q head p, K head p - NUM_HEADS, V head
    # p - NUM_HEADS - NUM_KV_HEADS, or a gate tile past them (module docstring)
    p = tl.program_id(0)
    n0 = p * HEAD_DIM
    offs_m = tl.arange(0, M_PAD)
    rows = offs_m[:, None]
    rows_ok = rows < M
    d = tl.arange(0, HEAD_DIM)[None, :]
    is_q = p < NUM_HEADS
    is_k = (p >= NUM_HEADS) & (p < NUM_HEADS + NUM_KV_HEADS)
    is_v = (p >= NUM_HEADS + NUM_KV_HEADS) & (p < NUM_HEADS + 2 * NUM_KV_HEADS)
    # positions, slots, norm weight and cos / sin: no kernel of the forward writes them, so they
    # are read before the wait, through L2 (kernels/pdl.py rule 3)
    pos = tl.load(pos_ptr + rows * stride_pos, mask=rows_ok, other=0, cache_modifier=".cg").to(tl.int64)
    slot = tl.load(slot_ptr + rows * stride_slot, mask=rows_ok & (is_k | is_v), other=0,
                   cache_modifier=".cg").to(tl.int64)
    w, wp, c, s = _norm_rope_params(tl.where(is_q, qw_ptr, kw_ptr), tl.where(is_q, stride_qw, stride_kw),
                                    cos_ptr + pos * stride_cos, sin_ptr + pos * stride_sin, rows_ok, d,
                                    HEAD_DIM, ROT_DIM, DTYPE)
    offs_n = n0 + tl.arange(0, HEAD_DIM)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    x_rows = x_ptr + rows * stride_xm
    if PRELOAD:
        # steps 0 (and 1) peeled: their weight tiles (parameters) before the wait, x (the
        # previous kernel's output) after it; then the next steps through the pipelined loop
        offs_k = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
        w0 = _load_w(w_rows + offs_k[None, :], (offs_n[:, None] < N) & (offs_k[None, :] < K), MASK_W, True)
        if PRELOAD >= 2:
            w1 = _load_w(w_rows + BLOCK_K + offs_k[None, :],
                         (offs_n[:, None] < N) & (BLOCK_K + offs_k[None, :] < K), MASK_W, True)
    if PDL:
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
    if PRELOAD:
        acc = _peeled_dot(tl.zeros([HEAD_DIM, M_PAD], dtype=tl.float32), w0, x_rows, offs_k, rows_ok, K,
                          stride_xk, IEEE)
        if PRELOAD >= 2:
            acc = _peeled_dot(acc, w1, x_rows, BLOCK_K + offs_k, rows_ok, K, stride_xk, IEEE)
        acc = _dot_acc(acc, w_rows, x_rows, offs_n, offs_m, PRELOAD * BLOCK_K, M, N, K, stride_xk,
                       K_ITERS - PRELOAD, BLOCK_K, IEEE, MASK_W, True, False)
    else:
        acc = _dot_acc(tl.zeros([HEAD_DIM, M_PAD], dtype=tl.float32), w_rows, x_rows, offs_n, offs_m,
                       0, M, N, K, stride_xk, K_ITERS, BLOCK_K, IEEE, MASK_W, True, False)
    if PDL and not EARLY:
        tl.extra.cuda.gdc_launch_dependents()  # the weight rows are read: let attention launch
    x = _round_to(tl.trans(acc), DTYPE)  # [M_PAD, HEAD_DIM]: the GEMM output, as the GEMM rounds it
    if is_q | is_k:
        # the rotate-half partner of each column, from registers (0 past ROT_DIM, as _norm_rope takes it)
        partner = tl.where(d < ROT_DIM, _rope_partner(d, ROT_DIM), d) + rows * 0
        xp = tl.where(d < ROT_DIM, tl.gather(x, partner, axis=1), 0.0)
        out = _norm_rope(x, xp, w, wp, c, s, d, eps, HEAD_DIM, ROT_DIM, DTYPE)
        if is_q:
            tl.store(q_ptr + rows * stride_qt + p * stride_qh + d, out, mask=rows_ok)
        else:
            g = p - NUM_HEADS
            tl.store(kc_ptr + slot * stride_kcs + g * stride_kch + d * stride_kcd,
                     _round_to(out, CACHE_DTYPE), mask=rows_ok)
    elif is_v:
        g = p - NUM_HEADS - NUM_KV_HEADS
        tl.store(vc_ptr + slot * stride_vcs + g * stride_vch + d * stride_vcd,
                 _round_to(x, CACHE_DTYPE), mask=rows_ok)
    else:
        col = (p - NUM_HEADS - 2 * NUM_KV_HEADS) * HEAD_DIM + d
        tl.store(g_ptr + rows * stride_gt + col, x, mask=rows_ok & (col < GATE_DIM))


def _peeled_dot(acc, w, x_rows, offs_k, rows_ok, K, stride_xk, IEEE: tl.constexpr):
    # one peeled K step: acc [HEAD_DIM, M_PAD] += w [HEAD_DIM, BLOCK_K] x[:, offs_k]^T, the dot
    # _dot_acc's loop body does (so the sums are the loop's, step for step)
    x = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=rows_ok & (offs_k[None, :] < K), other=0.0)
    return _dot_step(acc, w, x, IEEE, False)


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """The JIT kernel for one mode (``interpret`` is the cache key; triton reads the environment)."""
    del interpret
    namespace = jit_functions(__name__, (
        _round_to, _load_w, _dot_step, _dot_acc, _peeled_dot, _rope_partner, _norm_rope_params, _norm_rope,
        _qkv_norm_rope_cache_kernel))
    return namespace["_qkv_norm_rope_cache_kernel"]


def preload_tiles(k_iters: int) -> int:
    """The K steps a launch of ``k_iters`` steps peels before its PDL wait: ``PRELOAD_TILES``,
    leaving the pipelined loop at least one step."""
    if isinstance(PRELOAD_TILES, bool) or PRELOAD_TILES not in (0, 1, 2):
        raise ValueError(f"qkv_norm_rope_cache.PRELOAD_TILES must be 0, 1 or 2, got {PRELOAD_TILES!r}")
    return max(0, min(PRELOAD_TILES, k_iters - 1))


# ---- host side ------------------------------------------------------------------------------------


def qkv_norm_rope_cache(
    x: torch.Tensor,
    weight: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
    rot: int,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    config: HeadGemmConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x @ weight^T`` split into heads, Q/K normed and rotated, K/V written to the cache: one launch.

    Args:
        x: ``[M, H]`` fp32 / bf16 / fp16 (the attention input, already normed), ``M <= 16``.
        weight: ``[N, H]`` of x's dtype, unit column stride: Q heads, K heads, V heads
            (``head_dim`` rows each), then ``gate_dim = N - (num_heads + 2 num_kv_heads) head_dim``
            gate rows (0 or more).
        num_heads, num_kv_heads, head_dim: the head layout; ``head_dim`` a power of two >= 16.
        q_weight, k_weight, eps, cos_table, sin_table, positions, rot, slot_mapping, k_cache,
        v_cache: as :func:`qk_norm_rope_cache.qk_norm_rope_cache` takes them (``positions`` and
            ``slot_mapping`` ``[M]``).
        config: the K loop's tile; None: :data:`DEFAULT_CONFIG` (:data:`FP32_CONFIG` for fp32).

    Returns:
        ``(q [M, num_heads, head_dim], gate [M, gate_dim])`` contiguous in x's dtype; writes
        ``k_cache`` / ``v_cache`` at ``slot_mapping`` as ``qk_norm_rope_cache`` does: the two
        launches' results up to the norm statistic's summation order (module docstring).

    Raises:
        ValueError: on a shape, dtype, layout or device the kernel does not take.
    """
    _sg._check(x, weight)
    _qk._check_heads(num_heads, num_kv_heads, head_dim)
    m, h = x.shape
    n = weight.shape[0]
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16 (one dot tile a head), got {head_dim}; "
                         "use skinny_gemm then qk_norm_rope_cache")
    if m > MAX_M:
        raise ValueError(f"x has {m} rows; at most {MAX_M} (decode / verify sizes) are taken")
    if n < width:
        raise ValueError(f"weight must have >= (num_heads + 2 * num_kv_heads) * head_dim = {width} rows, "
                         f"got {n}")
    _qk._check_norm_rope_cache("x", x, num_kv_heads, head_dim, q_weight, k_weight, cos_table,
                               sin_table, positions, rot, slot_mapping, k_cache, v_cache)
    cfg = (FP32_CONFIG if x.dtype == torch.float32 else DEFAULT_CONFIG) if config is None else config
    if not isinstance(cfg, HeadGemmConfig):
        raise ValueError(f"config must be a HeadGemmConfig or None, got {type(cfg).__name__}")
    gate_dim = n - width
    q = torch.empty((m, num_heads, head_dim), dtype=x.dtype, device=x.device)
    gate = torch.empty((m, gate_dim), dtype=x.dtype, device=x.device)
    if m == 0:
        return q, gate
    interpret = interpret_mode()
    use_pdl = pdl.active(x.device, interpret)
    block_k = min(cfg.block_k, max(16, 1 << (h - 1).bit_length()))
    grid = (num_heads + 2 * num_kv_heads + -(-gate_dim // head_dim),)
    _kernels(interpret)[grid](
        x, weight, q_weight, k_weight, cos_table, sin_table, positions, slot_mapping, q, gate,
        k_cache, v_cache,
        m, x.stride(0), x.stride(1), weight.stride(0), q_weight.stride(0), k_weight.stride(0),
        cos_table.stride(0), sin_table.stride(0), positions.stride(0), slot_mapping.stride(0),
        q.stride(0), q.stride(1), gate.stride(0),
        *k_cache.stride(), *v_cache.stride(),
        float(eps),
        N=n, K=h, GATE_DIM=gate_dim, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, ROT_DIM=rot, M_PAD=max(16, 1 << (m - 1).bit_length()), BLOCK_K=block_k,
        K_ITERS=-(-h // block_k), IEEE=x.dtype == torch.float32 or interpret,
        MASK_W=n % head_dim != 0 or h % block_k != 0,
        DTYPE=DTYPE_CODE[x.dtype], CACHE_DTYPE=DTYPE_CODE[k_cache.dtype], PDL=use_pdl,
        PRELOAD=preload_tiles(-(-h // block_k)), EARLY=EARLY_SIGNAL,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        enable_fp_fusion=False,  # no FMA contraction in the epilogue: it rounds as qk_norm_rope_cache
        **pdl.launch_options(use_pdl),
    )
    return q, gate
