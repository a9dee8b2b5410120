"""Go / no-go for a persistent decode kernel: one layer's MoE half as ONE launch.

The forty-first pass (docs/PERFORMANCE.md) left the batch-1 floor goal to a persistent kernel and
named its first measurement: a layer's MoE half, from o_proj to the down projection, as one
persistent kernel against today's five launches. This script builds that kernel and times both.

What the engine runs at batch 1 (``DecoderLayer.forward_normed`` then ``MoE.fused_forward``)::

    o     = T(W_o a)                                  staged o_proj GEMV         [H]
    s, y  = T(r + o), RMSNorm(s) w                    add + RMSNorm kernel       [H], [H]
    ids,w = top-8(sigmoid(T(W_r y)) + b), shared      fused router + routing     [9], [9]
    h_p   = T(silu(Wg_p y) * (Wu_p y))                GEMV MoE gate_up           [9, I]
    d_p   = T(w_p (Wd_p h_p))                         GEMV MoE down              [9, H]

(``T``: a rounding to bf16; the pairs ``d_p`` stay unsummed, the next layer's norm adds them.)
The persistent kernel computes the same five steps with ``G`` resident programs (one an SM) and a
grid barrier where a kernel boundary was:

* phase 0: o_proj, ``O_BN``-row blocks of ``W_o``, whole rows a program (its first tile loaded
  before the PDL wait);
* barrier; phase 1: every program adds and normalises the whole row itself (no norm kernel, no
  one-program hop) and computes ``E / G`` router logits (their weight rows loaded before the
  barrier);
* barrier; phase 2: every program selects the top-8 itself from the 256 logits (no last-program
  hop) with the routing kernel's own helpers (``moe_routing._select_top_k`` / ``_route_weights``),
  then computes ``GU_BN``-row blocks of gate_up for the 9 pairs, shared expert first (its block is
  loaded before the barrier: a weight known early);
* barrier; phase 3: ``D_BN``-row blocks of down for all 9 pairs (the first pairs' tiles loaded
  before the barrier: the experts are known since phase 2).

The barrier is one acq_rel arrival on a counter that only grows (episode ``n`` spans
``[nG, (n + 1)G)``, so nothing is reset between barriers or replays) and a spin on acquire
loads; it gives up after ``--timeout-us`` and counts an error instead of hanging a machine when
the grid is not resident. ``PHASE >= 0`` builds one phase alone: the CPU interpreter, which runs
programs one after another and so cannot pass a grid barrier, checks the math that way, and on
the GPU the four phases as four PDL launches (``split``) separate what the barriers cost from
what the phases cost.

Timing (CUDA-graph replays, us a layer): each layer is a one-program "window" kernel that holds
the GPU ``W`` us with its dependents launched (attention's place: the HBM idle, the next kernel's
pre-wait loads in flight), then the MoE half; weights rotate over ``--layers`` copies (more than
L2). The window's own time, measured alone, is subtracted. The floor is the bytes of o_proj, the
router and the 9 experts hit over the copy rate of the same call. Every variant's outputs are
first checked against the torch reference (:func:`reference`: the residual bitwise, the pairs in
bf16 ulps; the engine's routed ids too).

Measured on the H200 (docs/PERFORMANCE.md, forty-second pass): 40-44 us a layer against 32.5
for the engine's five launches (floor 21.3); the barriers saved 2.4-5.9 us a layer against the
same phases as four launches, at most 0.09-0.23 ms a decode step even at the engine kernels'
speed: no-go for goal 1.

    python benchmarks/bench_persistent_moe.py                       # H200, XS-2.1 shapes
    python benchmarks/bench_persistent_moe.py --windows 0,8 --configs 1x8,2x4:8/1024/4/8 --phase-times
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from laguna_dflash.kernels.jit import _round_to, jit_functions  # noqa: E402

if TYPE_CHECKING:
    import triton.language as tl

@dataclass(frozen=True)
class Shapes:
    """One layer's MoE half: attention width ``a`` (o_proj's input), hidden ``h``, ``e`` routed
    experts of width ``inter``, ``top_k`` of them a token plus one shared expert."""

    a: int = 8192
    h: int = 2048
    e: int = 256
    inter: int = 512
    top_k: int = 8
    scale: float = 2.5  # moe_routed_scaling_factor (Laguna-XS-2.1)
    eps: float = 1e-6


@dataclass(frozen=True)
class Tiles:
    """``g`` programs; o_proj ``o_bn`` rows by ``o_bk`` columns a tile; gate_up ``gu_bn`` gate rows
    (and as many up rows) over the whole hidden width; down ``d_bn`` rows over the whole
    intermediate width; ``num_warps`` a program."""

    g: int = 132
    o_bn: int = 16
    o_bk: int = 1024
    gu_bn: int = 4
    d_bn: int = 16
    num_warps: int = 8


def _grid_barrier(count_ptr, err_ptr, G: tl.constexpr, TIMEOUT_NS: tl.constexpr):
    # every thread's stores done, one acq_rel arrival, then acquire loads until the G arrivals of
    # this episode are in (the counter only grows: episode n spans [n G, (n + 1) G))
    tl.debug_barrier()
    old = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    target = (old // G + 1) * G
    seen = old + 1
    t0 = tl.extra.cuda.globaltimer()
    late = 0
    while (seen < target) & (late == 0):
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        late = (tl.extra.cuda.globaltimer() - t0 > TIMEOUT_NS).to(tl.int32)
    if late != 0:
        tl.atomic_add(err_ptr, 1, sem="relaxed", scope="gpu")
    tl.debug_barrier()


def _sync(count_ptr, err_ptr, ALL: tl.constexpr, PDL: tl.constexpr, G: tl.constexpr,
          TIMEOUT_NS: tl.constexpr):
    # the hand-off into a phase: a grid barrier inside the persistent kernel, the PDL wait (then
    # the next launch may start its pre-wait loads) when the phase is a launch of its own
    if ALL:
        _grid_barrier(count_ptr, err_ptr, G, TIMEOUT_NS)
    elif PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def _routes(logit_ptr, bias, offs_e, scale, E: tl.constexpr, TOP_K: tl.constexpr,
            K_PAD: tl.constexpr, SEL_K: tl.constexpr):
    # the 256 logits (other programs wrote them: through L2) -> (ids [1, K_PAD] with the shared
    # expert E in column TOP_K, weights [1, K_PAD] fp32 holding bf16 values), as the routing
    # kernel computes them (its helpers are bound into this kernel's globals by _kernel)
    valid = offs_e < E
    z = tl.load(logit_ptr + offs_e, mask=valid, other=0.0, cache_modifier=".cg")
    s = _scores(z, 0.0, False, False)  # noqa: F821
    ids, z_sel = _select_top_k(s + bias, z, valid, offs_e, E, TOP_K, K_PAD, 1, True, SEL_K)  # noqa: F821
    w, ids = _route_weights(z_sel, ids, 0.0, scale, E, TOP_K, 1, K_PAD, False, False, True, 1)  # noqa: F821
    return ids, w


def _pick(v, kk, p):
    # column p of a [1, K_PAD] row as a scalar
    return tl.sum(tl.sum(tl.where(kk == p, v, 0), axis=1), axis=0)


def _moe_half_kernel(
    xa_ptr, res_ptr, wo_ptr, nw_ptr, wr_ptr, bias_ptr, wgu_ptr, wd_ptr,
    o_ptr, logit_ptr, act_ptr, res_out_ptr, pairs_ptr, count_ptr, err_ptr,
    eps, scale,
    A: tl.constexpr, H: tl.constexpr, E: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr,
    G: tl.constexpr, O_BN: tl.constexpr, O_BK: tl.constexpr, O_ITEMS: tl.constexpr,
    R_PAD: tl.constexpr, GU_BN: tl.constexpr, GU_ITEMS: tl.constexpr, D_BN: tl.constexpr,
    D_ITEMS: tl.constexpr, K_PAD: tl.constexpr, SEL_K: tl.constexpr, PHASE: tl.constexpr,
    PDL: tl.constexpr, TIMEOUT_NS: tl.constexpr,
):
    # PHASE -1: all four phases with grid barriers; 0..3: that phase alone (module docstring)
    ALL: tl.constexpr = PHASE < 0
    NUM_PAIRS: tl.constexpr = TOP_K + 1
    O_KSTEPS: tl.constexpr = A // O_BK
    GU_BLOCKS: tl.constexpr = INTER // GU_BN
    pid = tl.program_id(0)
    offs_h = tl.arange(0, H)
    offs_e = tl.arange(0, E)[None, :]
    kk = tl.arange(0, K_PAD)[None, :]

    # ---- phase 0: o = T(W_o a); program pid: row blocks pid, pid + G, ...
    if ALL or PHASE == 0:
        rows_in = tl.arange(0, O_BN)
        offs_k = tl.arange(0, O_BK)
        zero_n = rows_in[:, None] * 0
        w_rows = wo_ptr + (pid * O_BN + rows_in)[:, None].to(tl.int64) * A
        w_next = tl.load(w_rows + offs_k[None, :], mask=pid < H // O_BN, other=0.0,
                         eviction_policy="evict_first")  # a weight: before the wait
        if PDL:
            tl.extra.cuda.gdc_wait()  # a is the previous kernel's output
            if not ALL:
                tl.extra.cuda.gdc_launch_dependents()
        for i in range(O_ITEMS):
            blk = pid + i * G
            ok = blk < H // O_BN
            w_rows = wo_ptr + (blk * O_BN + rows_in)[:, None].to(tl.int64) * A
            acc = tl.zeros([O_BN, O_BK], dtype=tl.float32)
            for kstep in range(O_KSTEPS):
                w = w_next
                k0 = kstep * O_BK
                xs = tl.load(xa_ptr + k0 + offs_k[None, :] + zero_n)
                w_next = tl.load(w_rows + k0 + O_BK + offs_k[None, :], mask=ok & (kstep + 1 < O_KSTEPS),
                                 other=0.0, eviction_policy="evict_first")
                acc += w.to(tl.float32) * xs.to(tl.float32)
            if i + 1 < O_ITEMS:  # the next block's first tile
                nrows = wo_ptr + ((blk + G) * O_BN + rows_in)[:, None].to(tl.int64) * A
                w_next = tl.load(nrows + offs_k[None, :], mask=blk + G < H // O_BN, other=0.0,
                                 eviction_policy="evict_first")
            o = _round_to(tl.sum(acc, axis=1), 1)
            tl.store(o_ptr + blk * O_BN + rows_in, o.to(o_ptr.dtype.element_ty),
                     mask=ok & (rows_in < O_BN))

    # ---- phase 1 (and phase 2 alone, which needs y): s = T(r + o), y = RMSNorm; the logits
    if ALL or PHASE == 1 or PHASE == 2:
        nw = tl.load(nw_ptr + offs_h).to(tl.float32)  # weights: before the barrier
        if ALL or PHASE == 1:
            er = pid + tl.arange(0, R_PAD)[:, None] * G  # this program's experts [R_PAD, 1]
            wr = tl.load(wr_ptr + er.to(tl.int64) * H + offs_h[None, :], mask=er < E, other=0.0,
                         eviction_policy="evict_first")
        if ALL or PHASE == 2:
            bias = tl.load(bias_ptr + offs_e, mask=offs_e < E, other=0.0).to(tl.float32)
            # gate_up's first item is a block of the shared expert (id E): known, load it now
            g_rows0 = wgu_ptr + E * (2 * INTER * H) + (pid * GU_BN + tl.arange(0, GU_BN))[:, None].to(tl.int64) * H
            ok0 = pid < GU_BLOCKS  # (G > I / GU_BN: the others' first items are routed)
            wg_next = tl.load(g_rows0 + offs_h[None, :], mask=ok0, other=0.0, eviction_policy="evict_first")
            wu_next = tl.load(g_rows0 + INTER * H + offs_h[None, :], mask=ok0, other=0.0,
                              eviction_policy="evict_first")
        _sync(count_ptr, err_ptr, ALL, PDL, G, TIMEOUT_NS)
        s = tl.load(res_ptr + offs_h).to(tl.float32) + tl.load(o_ptr + offs_h, cache_modifier=".cg").to(tl.float32)
        s = _round_to(s, 1)
        if ALL or PHASE == 1:
            tl.store(res_out_ptr + offs_h, s.to(res_out_ptr.dtype.element_ty), mask=(offs_h < H) & (pid == 0))
        mean_sq = tl.math.div_rn(tl.sum(s * s, axis=0), H * 1.0)
        inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_sq + eps))
        y = _round_to(nw * _round_to(s * inv, 1), 1)  # [H], bf16 values in fp32
        if ALL or PHASE == 1:
            logits = _round_to(tl.sum(wr.to(tl.float32) * y[None, :], axis=1), 1)  # [R_PAD]
            er1 = pid + tl.arange(0, R_PAD) * G
            tl.store(logit_ptr + er1, logits, mask=er1 < E)

    # ---- phase 2: every program routes, then gate_up blocks item = pid + i G (shared first)
    if ALL or PHASE == 2:
        if ALL:
            _grid_barrier(count_ptr, err_ptr, G, TIMEOUT_NS)
        ids, rw = _routes(logit_ptr, bias, offs_e, scale, E, TOP_K, K_PAD, SEL_K)
        r_in = tl.arange(0, GU_BN)
        # a program whose first item is not the shared expert's (G > I / GU_BN) loads it now
        pair0 = (pid // GU_BLOCKS + TOP_K) % NUM_PAIRS
        fix = (pair0 != TOP_K) & (pid < GU_BLOCKS * NUM_PAIRS)
        rows0 = wgu_ptr + _pick(ids, kk, pair0).to(tl.int64) * (2 * INTER * H) + (
            (pid % GU_BLOCKS) * GU_BN + r_in)[:, None].to(tl.int64) * H
        wg_next = tl.where(fix, tl.load(rows0 + offs_h[None, :], mask=fix, other=0.0), wg_next)
        wu_next = tl.where(fix, tl.load(rows0 + INTER * H + offs_h[None, :], mask=fix, other=0.0), wu_next)
        for i in range(GU_ITEMS):
            item = pid + i * G
            ok = item < GU_BLOCKS * NUM_PAIRS
            pair = (item // GU_BLOCKS + TOP_K) % NUM_PAIRS  # shared (column TOP_K) first
            rows = (item % GU_BLOCKS) * GU_BN + r_in
            wg = wg_next
            wu = wu_next
            if i + 1 < GU_ITEMS:  # the next item's tiles, before this one's math
                nitem = item + G
                npair = (nitem // GU_BLOCKS + TOP_K) % NUM_PAIRS
                nexp = _pick(ids, kk, npair).to(tl.int64)
                nrows = wgu_ptr + nexp * (2 * INTER * H) + ((nitem % GU_BLOCKS) * GU_BN + r_in)[:, None].to(tl.int64) * H
                nok = nitem < GU_BLOCKS * NUM_PAIRS
                wg_next = tl.load(nrows + offs_h[None, :], mask=nok, other=0.0, eviction_policy="evict_first")
                wu_next = tl.load(nrows + INTER * H + offs_h[None, :], mask=nok, other=0.0,
                                  eviction_policy="evict_first")
            g = tl.sum(wg.to(tl.float32) * y[None, :], axis=1)
            u = tl.sum(wu.to(tl.float32) * y[None, :], axis=1)
            h = _round_to(g * tl.sigmoid(g) * u, 1)
            tl.store(act_ptr + pair * INTER + rows, h.to(act_ptr.dtype.element_ty), mask=ok & (rows < INTER))

    # ---- phase 3: down, D_BN rows of all 9 pairs a block
    if ALL or PHASE == 3:
        offs_i = tl.arange(0, INTER)
        d_in = tl.arange(0, D_BN)
        zero_d = d_in[:, None] * 0
        if PHASE == 3:  # alone: route again from the logits
            bias = tl.load(bias_ptr + offs_e, mask=offs_e < E, other=0.0).to(tl.float32)
            if PDL:
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
            ids, rw = _routes(logit_ptr, bias, offs_e, scale, E, TOP_K, K_PAD, SEL_K)
        d_rows = (pid * D_BN + d_in)[:, None].to(tl.int64) * INTER
        dok = pid < H // D_BN
        # the first pair's tile: its expert is known since the routing
        wd_next = tl.load(wd_ptr + _pick(ids, kk, 0).to(tl.int64) * (H * INTER) + d_rows + offs_i[None, :],
                          mask=dok, other=0.0, eviction_policy="evict_first")
        if ALL:
            _grid_barrier(count_ptr, err_ptr, G, TIMEOUT_NS)
            if PDL:
                tl.extra.cuda.gdc_launch_dependents()
        for i in range(D_ITEMS):
            blk = pid + i * G
            ok = blk < H // D_BN
            rows_off = (blk * D_BN + d_in)[:, None].to(tl.int64) * INTER
            for p in tl.static_range(NUM_PAIRS):
                wd = wd_next
                if p + 1 < NUM_PAIRS:
                    nexp = _pick(ids, kk, p + 1).to(tl.int64)
                    wd_next = tl.load(wd_ptr + nexp * (H * INTER) + rows_off + offs_i[None, :], mask=ok,
                                      other=0.0, eviction_policy="evict_first")
                elif i + 1 < D_ITEMS:
                    nrows = ((blk + G) * D_BN + d_in)[:, None].to(tl.int64) * INTER
                    wd_next = tl.load(wd_ptr + _pick(ids, kk, 0).to(tl.int64) * (H * INTER) + nrows
                                      + offs_i[None, :], mask=blk + G < H // D_BN, other=0.0,
                                      eviction_policy="evict_first")
                hs = tl.load(act_ptr + p * INTER + offs_i[None, :] + zero_d, cache_modifier=".cg")
                d = tl.sum(wd.to(tl.float32) * hs.to(tl.float32), axis=1) * _pick(rw, kk, p)
                out_rows = blk * D_BN + d_in
                tl.store(pairs_ptr + p * H + out_rows, _round_to(d, 1).to(pairs_ptr.dtype.element_ty),
                         mask=ok & (out_rows < H))


@functools.cache
def _kernel():
    from laguna_dflash.kernels import moe_routing

    ns = jit_functions(__name__, (_round_to, _grid_barrier, _sync, _routes, _pick, _moe_half_kernel))
    # the routing kernel's own math (already triton.jit functions of that module)
    ns.update(_scores=moe_routing._scores, _select_top_k=moe_routing._select_top_k,
              _route_weights=moe_routing._route_weights)
    return ns["_moe_half_kernel"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def launch_meta(s: Shapes, tiles: Tiles, pdl: bool, timeout_us: float = 20000.0) -> dict:
    """The kernel's constexpr arguments and ``num_warps`` for ``s`` and ``tiles``."""
    if s.e & (s.e - 1) or s.h & (s.h - 1) or s.inter & (s.inter - 1) or s.top_k > s.e:
        raise ValueError(f"E, H and I must be powers of two and top_k <= E: {s}")
    if s.h % tiles.o_bn or s.a % tiles.o_bk or s.inter % tiles.gu_bn or s.h % tiles.d_bn:
        raise ValueError(f"tiles {tiles} do not divide the shapes {s}")
    g = tiles.g
    return dict(
        A=s.a, H=s.h, E=s.e, INTER=s.inter, TOP_K=s.top_k, G=g, O_BN=tiles.o_bn, O_BK=tiles.o_bk,
        O_ITEMS=_cdiv(s.h // tiles.o_bn, g), R_PAD=_next_pow2(_cdiv(s.e, g)),
        GU_BN=tiles.gu_bn, GU_ITEMS=_cdiv((s.inter // tiles.gu_bn) * (s.top_k + 1), g),
        D_BN=tiles.d_bn, D_ITEMS=_cdiv(s.h // tiles.d_bn, g), K_PAD=_next_pow2(s.top_k + 1),
        SEL_K=_next_pow2(s.top_k), PDL=pdl, TIMEOUT_NS=int(timeout_us * 1000),
        num_warps=tiles.num_warps)


class Weights:
    """One layer's weights and inputs, bf16 on ``device`` (the shared expert stacked as expert
    ``E``, as ``MoE.fold_shared_expert`` does)."""

    def __init__(self, shapes: Shapes, device: torch.device | str, seed: int = 0) -> None:
        s = shapes
        gen = torch.Generator(device=device).manual_seed(seed)

        def rand(*shape, std=0.02):
            return (torch.randn(*shape, generator=gen, device=device) * std).to(torch.bfloat16)

        self.shapes = s
        self.xa = rand(s.a, std=1.0)
        self.res = rand(s.h, std=1.0)
        self.wo = rand(s.h, s.a)
        self.nw = (1.0 + rand(s.h, std=0.1).float()).to(torch.bfloat16)
        self.wr = rand(s.e, s.h, std=0.05)
        self.bias = rand(s.e, std=0.01).float()
        self.wgu = rand(s.e + 1, 2 * s.inter, s.h)
        self.wd = rand(s.e + 1, s.h, s.inter)


class PersistentMoEHalf:
    """The persistent kernel (``phase`` -1) or its four phases as launches (``phase`` "split")
    on one layer's :class:`Weights`; call -> ``(residual [H], pairs [9, H], ids [9])``."""

    def __init__(self, w: Weights, tiles: Tiles, split: bool = False, pdl: bool | None = None,
                 timeout_us: float = 20000.0) -> None:
        s = w.shapes
        dev = w.xa.device
        self.w, self.tiles, self.split = w, tiles, split
        self.pdl = (dev.type == "cuda") if pdl is None else pdl
        self.o = torch.empty(s.h, device=dev, dtype=torch.bfloat16)
        self.logits = torch.empty(s.e, device=dev, dtype=torch.float32)
        self.act = torch.empty(s.top_k + 1, s.inter, device=dev, dtype=torch.bfloat16)
        self.res_out = torch.empty(s.h, device=dev, dtype=torch.bfloat16)
        self.pairs = torch.empty(s.top_k + 1, s.h, device=dev, dtype=torch.bfloat16)
        self.count = torch.zeros(1, device=dev, dtype=torch.int32)
        self.err = torch.zeros(1, device=dev, dtype=torch.int32)
        self.meta = launch_meta(s, tiles, self.pdl, timeout_us)

    def launch(self, phase: int) -> None:
        """One launch of the kernel: ``phase`` -1 the persistent kernel, 0..3 that phase alone
        (which reads what the earlier phases last wrote)."""
        w, s = self.w, self.w.shapes
        extra = {"launch_pdl": True} if self.pdl else {}
        _kernel()[(self.tiles.g,)](
            w.xa, w.res, w.wo, w.nw, w.wr, w.bias, w.wgu, w.wd, self.o, self.logits, self.act,
            self.res_out, self.pairs, self.count, self.err, s.eps, s.scale, PHASE=phase,
            **self.meta, **extra)

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        for phase in (0, 1, 2, 3) if self.split else (-1,):
            self.launch(phase)
        return self.res_out, self.pairs


def reference(w: Weights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The five steps in torch (fp32 math, the engine's bf16 roundings) -> ``(residual [H],
    pairs [9, H], ids [9])``; the shared expert is pair 8 (id E), weight 1."""
    from laguna_dflash.models import fusion

    s = w.shapes
    bf = torch.bfloat16
    o = (w.wo.float() @ w.xa.float()).to(bf)
    res = (w.res.float() + o.float()).to(bf)
    r = res.float()
    inv = 1.0 / torch.sqrt((r * r).mean() + s.eps)
    y = (w.nw.float() * (r * inv).to(bf).float()).to(bf)
    logits = (w.wr.float() @ y.float()).to(bf)
    weights, ids = fusion.moe_route(logits[None].float(), w.bias, s.top_k, 0.0, "sigmoid", True)
    weights = (weights[0] * s.scale).to(bf).float()
    ids = torch.cat([ids[0], torch.tensor([s.e], device=ids.device)])
    weights = torch.cat([weights, torch.ones(1, device=weights.device)])
    pairs = []
    for e, wt in zip(ids.tolist(), weights.tolist()):
        gu = w.wgu[e].float() @ y.float()
        g, u = gu[:s.inter], gu[s.inter:]
        h = (g * torch.sigmoid(g) * u).to(bf).float()
        pairs.append((wt * (w.wd[e].float() @ h)).to(bf))
    return res, torch.stack(pairs), ids


class EngineMoEHalf:
    """The engine's five launches on one layer's :class:`Weights` (CUDA): the staged o_proj GEMV,
    add + RMSNorm, the fused router, the GEMV MoE's gate_up and down; call -> ``(residual [H],
    pairs [9, H])``."""

    def __init__(self, w: Weights) -> None:
        self.w = w

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        from laguna_dflash.kernels import add_rms_norm, moe_gemv, moe_routing, staged_gemv

        w, s = self.w, self.w.shapes
        o = staged_gemv.staged_gemv(w.xa[None], w.wo)
        res, y = add_rms_norm.add_rms_norm(w.res[None], o, w.nw, s.eps)
        weights, ids = moe_routing.fused_router_route(y, w.wr, w.bias, s.top_k, 0.0, "sigmoid", True,
                                                      scale=s.scale, num_shared=1)
        pairs = moe_gemv.moe_gemv_experts(y, ids, weights, w.wgu, w.wd)
        self.ids = ids[0]
        return res[0], pairs[0]


@functools.cache
def _window_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def window(ns):
        # attention's place in the layer: the next kernel's programs may start (and load their
        # weights) at once, while this one holds the GPU ns nanoseconds with the HBM idle
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        t0 = tl.extra.cuda.globaltimer()
        t = t0
        while t - t0 < ns:
            t = tl.extra.cuda.globaltimer()

    return window


def layer_chain(halves: list, window_us: float) -> list:
    """One callable a layer: the window kernel, then that layer's MoE half (None: window only)."""
    window = _window_kernel()

    def step(half):
        window[(1,)](int(window_us * 1000), num_warps=1, launch_pdl=True)
        if half is not None:
            half()
    return [functools.partial(step, h) for h in halves]


def check(half, w: Weights) -> str:
    """How ``half``'s outputs compare with :func:`reference` (ids, residual, pairs in bf16 ulps)."""
    res, pairs = half()
    want_res, want_pairs, want_ids = reference(w)
    ids = getattr(half, "ids", None)
    ulp = want_pairs.float().abs().clamp_min(2.0**-20) * 2.0**-7
    worst = ((pairs.float() - want_pairs.float()).abs() / ulp).max().item()
    same_ids = "" if ids is None else f", ids {'equal' if torch.equal(ids.cpu(), want_ids.cpu()) else 'DIFFER'}"
    return (f"residual {'bitwise' if torch.equal(res, want_res) else 'DIFFERS'}{same_ids}, "
            f"pairs within {worst:.1f} ulp")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8, help="weight copies to rotate (more than L2)")
    ap.add_argument("--windows", default="0,8", help="HBM-idle us before each MoE half (attention)")
    ap.add_argument("--configs", default="1x8,1x4,2x4",
                    help="persistent kernels: programs an SM x num_warps, optionally :O_BN/O_BK/"
                         "GU_BN/D_BN (Tiles), e.g. 2x4:8/1024/4/8 (158 registers a thread at 8 "
                         "warps: one program an SM; more than fit co-resident time out)")
    ap.add_argument("--phase-times", action="store_true",
                    help="also each phase alone, launched over the layers (us a layer)")
    ap.add_argument("--timeout-us", type=float, default=20000.0, help="a grid barrier's spin limit")
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    from bench_skinny_gemm import copy_bandwidth, time_graph

    dev = torch.device("cuda")
    shapes = Shapes()
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    weights = [Weights(shapes, dev, seed=i) for i in range(args.layers)]
    rate = copy_bandwidth(dev)
    s = shapes
    floor_bytes = 2 * (s.h * s.a + s.e * s.h + (s.top_k + 1) * 3 * s.inter * s.h)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.layers} layer copies, "
          f"{num_sms} SMs; copy {rate / 1e12:.2f} TB/s; floor {floor_bytes / 2**20:.1f} MiB = "
          f"{floor_bytes / rate * 1e6:.2f} us a layer\n")
    variants = [("engine: 5 launches (staged o_proj, norm, router, gate_up, down)",
                 [EngineMoEHalf(w) for w in weights])]
    for text in args.configs.split(","):
        grid, _, sizes = text.partition(":")
        per_sm, nw = (int(v) for v in grid.split("x"))
        tile_kw = dict(zip(("o_bn", "o_bk", "gu_bn", "d_bn"), (int(v) for v in sizes.split("/")))) if sizes else {}
        tiles = Tiles(g=per_sm * num_sms, num_warps=nw, **tile_kw)
        variants.append((f"persistent, {tiles.g} programs x {nw} warps{(', tiles ' + sizes) if sizes else ''}, 3 grid barriers",
                         [PersistentMoEHalf(w, tiles, timeout_us=args.timeout_us) for w in weights]))
        variants.append((f"the same 4 phases as 4 PDL launches ({tiles.g} x {nw})",
                         [PersistentMoEHalf(w, tiles, split=True) for w in weights]))
    windows = [float(v) for v in args.windows.split(",")]
    print("| MoE half | check | " + " | ".join(f"W = {w:g} us: us a layer" for w in windows) + " |")
    print("|---|---|" + "---:|" * len(windows))
    alone = {w: time_graph(layer_chain([None] * args.layers, w), args.replays) for w in windows}
    for label, halves in variants:
        try:
            verdict = check(halves[0], weights[0])
            torch.cuda.synchronize()
            cells = [time_graph(layer_chain(halves, w), args.replays) - alone[w] for w in windows]
            errors = sum(int(h.err.item()) for h in halves if hasattr(h, "err"))
        except Exception as e:  # noqa: BLE001 - one failing variant must not lose the others
            print(f"| {label} | failed: {type(e).__name__}: {str(e)[:120]} |")
            continue
        if errors:
            verdict += f"; {errors} barrier timeouts (grid not resident: times meaningless)"
        print(f"| {label} | {verdict} | " + " | ".join(f"{us:.2f}" for us in cells) + " |")
        if args.phase_times and getattr(halves[0], "split", False):
            phases = [time_graph([functools.partial(h.launch, p) for h in halves], args.replays)
                      for p in range(4)]
            print("|   each phase alone (o_proj, norm + router, routing + gate_up, down) | | "
                  + " / ".join(f"{us:.2f}" for us in phases) + " | |")
    print("\nwindow kernel alone, us a layer: " + ", ".join(f"W = {w:g}: {alone[w]:.2f}" for w in windows))


if __name__ == "__main__":
    main()
