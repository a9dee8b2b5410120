"""Skinny GEMM ``y = x @ W^T`` (x ``[M, K]``, M = 1..16) on the GPU: cuBLAS vs the Triton kernel
(``kernels/skinny_gemm.py``) over a sweep of tile configs, in ONE run of under 4 minutes.

For each Laguna decode shape (``N x K``, bf16) and each ``M`` of ``--m`` it

1. times cuBLAS ``F.linear`` and the kernel's current :func:`default_config`;
2. phase A: sweeps ``(block_n, block_k, split_k, use_dot)`` at 4 warps (GEMV: prefetch on; dot:
   3 stages), pruned by registers (GEMV), shared memory (dot tiles), K per split and grid fill;
3. phase B: for the best ``--top-b`` of phase A, sweeps ``num_warps`` x ``num_stages`` (GEMV:
   prefetch off / on) and flips ``evict_first`` (and ``x_bcast``) on the best.

Each phase compiles all its candidates first in ``--jobs`` worker processes (they only fill
Triton's on-disk cache; the main process then loads the binaries), checks every candidate
against an fp32 reference (a wrong one is reported and skipped), and times it as a CUDA graph
of launches cycling through copies of W totalling >= 256 MiB (so W comes from HBM, not the
50 MB L2, as in a real forward), 20 replays, best of 3. ``--budget`` seconds bound the whole
run: past it, remaining candidates are skipped (the report says how many).

Prints the device-to-device copy bandwidth (4 GiB copy, read + write), a markdown table (cuBLAS
us and TB/s, default-config us, best Triton config, its us and TB/s, cuBLAS / Triton), and a
``_MEASURED = {...}`` dict of the best config per ``(m_bucket, N, K)`` to paste into
``kernels/skinny_gemm.py``. TB/s counts the bytes of W, x and y once.

    python benchmarks/bench_skinny_gemm.py                    # all shapes, M = 1, 4, 16
    python benchmarks/bench_skinny_gemm.py --quick --m 1,16   # smaller sweep
    python benchmarks/bench_skinny_gemm.py --shapes 4096x2048,2048x4096   # extra (drafter) shapes
    python benchmarks/bench_skinny_gemm.py --only --shapes 100352x2048 --m 1,4   # the lm_head alone
    python benchmarks/bench_skinny_gemm.py --fp8 --only --m 4 --shapes 100352x2048,16384x2048,2048x8192
    python benchmarks/bench_skinny_gemm.py --int8 --only --m 1,4 --shapes 100352x2048   # greedy lm_head copy
    TRITON_INTERPRET=1 python benchmarks/bench_skinny_gemm.py --device cpu --tiny   # wiring check

``--fp8``: the weights quantized to e4m3 rows with fp32 scales (``models/fp8.py``; the drafter's
``draft_quantization="fp8"``), the kernel's ``scale=`` path swept; the baselines stay bf16 (cuBLAS
on the unquantized weight, and the bf16 kernel's default config, its own column), the table's
TB/s counts one byte a weight element, and the printed dict is the fp8 configs'.
``--int8``: the same with the greedy lm_head's per-row int8 copy (``kernels/greedy_lm_head.py``
:func:`quantize`) and its table (``default_config(..., int8=True)``: ``_MEASURED_INT8``, else the
e4m3 table's configs); the printed dict is ``_MEASURED_INT8``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, wait
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from laguna_dflash.kernels import skinny_gemm as sg  # noqa: E402
from laguna_dflash.kernels.greedy_lm_head import quantize as quantize_int8  # noqa: E402
from laguna_dflash.kernels.skinny_gemm import SkinnyConfig  # noqa: E402
from laguna_dflash.models.fp8 import quantize_rows  # noqa: E402

SHAPES = [
    ("qkvg", 10304, 2048),
    ("qkvg (8240)", 8240, 2048),
    ("o_proj / mlp down", 2048, 8192),
    ("o_proj (6144)", 2048, 6144),
    ("router", 256, 2048),
    ("mlp gate_up", 16384, 2048),
]
TINY_SHAPES = [("tiny a", 40, 96), ("tiny b", 24, 160)]
NUM_SMS = 132  # H200; replaced by the device's count at run time
ROTATE_BYTES = 256 * 2**20


def quantize_weight(w: torch.Tensor, quant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(one-byte weight [N, K], fp32 row scales [N])`` of ``w`` for ``quant`` ``"fp8"`` (e4m3,
    models/fp8.py) or ``"int8"`` (the greedy lm_head's copy)."""
    if quant == "int8":
        head = quantize_int8(w)
        return head.q, head.scale
    return quantize_rows(w)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- candidates -----------------------------------------------------------------------------------


def dot_modes(m: int) -> list[bool]:
    return [False] if m <= 2 else [False, True] if m <= 4 else [True]


def gemv_regs(m: int, cfg: SkinnyConfig) -> float:
    """Estimated registers a thread on the GEMV path: the fp32 accumulators, the bf16 tiles of
    W (and of x when x_bcast) per buffer, ~16 more (within ~5 of ptxas for sm_90 at 4 warps)."""
    per = cfg.block_n * cfg.block_k / (32 * cfg.num_warps)  # tile elements a thread
    m_pad = next_pow2(m)
    bufs = 2 if cfg.num_stages > 1 else 1
    return m_pad * per + per * (1 + (m_pad if cfg.x_bcast else 0)) / 2 * bufs + 16


def fits(m: int, n: int, k: int, cfg: SkinnyConfig, use_dot: bool, weight_bytes: int = 2) -> bool:
    if use_dot:
        # W tiles of all stages in shared memory under ~200 KiB; fp8 tiles are widened in
        # registers: at most 64 x 256 of them
        if weight_bytes == 1 and cfg.block_n * cfg.block_k > 64 * 256:
            return False
        return cfg.block_n >= 16 and cfg.block_n * cfg.block_k * weight_bytes * cfg.num_stages <= 200 * 1024
    return gemv_regs(m, cfg) <= 200  # beyond: spills / one CTA an SM


def base_config(bn: int, bk: int, split: int, use_dot: bool) -> SkinnyConfig:
    # phase A: GEMV with the register prefetch (2 stages), dot with 3 cp.async stages
    return SkinnyConfig(bn, bk, split, 4, 3 if use_dot else 2, use_dot=use_dot)


def phase_a(m: int, n: int, k: int, quick: bool, weight_bytes: int = 2) -> list[SkinnyConfig]:
    """(block_n, block_k, split_k, use_dot) at 4 warps, pruned; the default config first."""
    out = []
    for use_dot in dot_modes(m):
        if use_dot:
            bns = (16, 32, 64) if quick else (16, 32, 64, 128)
        else:
            bns = (16, 32) if quick else (8, 16, 32, 64)
        bks = (128, 256) if quick else (64, 128, 256, 512)
        for bn in bns:
            tiles = cdiv(n, bn)
            for bk in bks:
                # split-K 8 only where even 4 leaves most SMs without a program (the router)
                for split in (1, 2, 4, 8) if tiles * 4 < NUM_SMS // 2 else (1, 2, 4):
                    cfg = base_config(bn, bk, split, use_dot)
                    if not fits(m, n, k, cfg, use_dot, weight_bytes) or bk * split > k:
                        continue
                    if not use_dot and next_pow2(m) * bn * bk > 64 * 32 * 4:  # accumulators
                        continue
                    if split > 1 and tiles >= 2 * NUM_SMS:  # enough programs without splitting
                        continue
                    out.append(cfg)
    # drop grids that leave most SMs idle, unless nothing else is left; small weights (the
    # router: ~1 MiB, launch-latency bound) keep every candidate
    if n * k * 2 < 16 * 2**20:
        return out
    filled = [c for c in out if cdiv(n, c.block_n) * c.split_k >= NUM_SMS // 2]
    return filled or out


def phase_b(m: int, n: int, k: int, best: list[SkinnyConfig], weight_bytes: int = 2) -> list[SkinnyConfig]:
    """Warps x stages around the best phase-A configs; evict_first (and x_bcast) flipped on the
    best one."""
    out = []
    for base in best:
        use_dot = bool(base.use_dot)
        for warps in (2, 4, 8):
            for stages in ((2, 3, 4) if use_dot else (1, 2)):  # GEMV: prefetch off / on
                cfg = dataclasses.replace(base, num_warps=warps, num_stages=stages)
                if fits(m, n, k, cfg, use_dot, weight_bytes):
                    out.append(cfg)
    if best:
        out.append(dataclasses.replace(best[0], evict_first=not best[0].evict_first))
        if not best[0].use_dot:
            out.append(dataclasses.replace(best[0], x_bcast=not best[0].x_bcast))
    return out


def explicit(cfg: SkinnyConfig, m: int) -> SkinnyConfig:
    """``cfg`` with use_dot resolved (the printed table must not depend on the auto rule)."""
    return cfg if cfg.use_dot is not None else dataclasses.replace(cfg, use_dot=m > 4)


# ---- timing ---------------------------------------------------------------------------------------


def copy_bandwidth(device: torch.device, gib: float = 4.0) -> float:
    """Bytes per second (read + write) of a ``gib`` GiB device-to-device copy."""
    src = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * int(gib * 2**30) / best


def time_graph(fns: list[Callable[[], object]], replays: int = 20, repeats: int = 3) -> float:
    """Microseconds per call: ``fns`` captured in one CUDA graph, ``replays`` replays, best of
    ``repeats``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    if start.elapsed_time(end) > 2.0:  # a slow candidate: fewer replays
        replays = 3
    best = float("inf")
    for _ in range(repeats):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (replays * len(fns)))
    del graph
    return best


def time_cpu(fns: list[Callable[[], object]], reps: int = 2) -> float:
    for fn in fns:
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        for fn in fns:
            fn()
    return (time.perf_counter() - t0) * 1e6 / (reps * len(fns))


# ---- parallel compilation -------------------------------------------------------------------------


def _compile_worker(tasks: list[tuple[int, int, int, dict]], quant: str = "") -> int:
    """Runs each ``(m, n, k, config fields)`` once on same-shaped bf16 CUDA tensors (a one-byte
    weight and scales with ``quant`` "fp8" / "int8"): Triton compiles it into its on-disk cache,
    which the parent then hits. Returns the failures."""
    torch.cuda.init()
    weights: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
    failed = 0
    for m, n, k, fields in tasks:
        if (n, k) not in weights:
            w = torch.zeros(n, k, dtype=torch.bfloat16, device="cuda")
            weights[(n, k)] = quantize_weight(w, quant) if quant else (w, None)
        x = torch.zeros(m, k, dtype=torch.bfloat16, device="cuda")
        try:
            w, scale = weights[(n, k)]
            sg.skinny_gemm(x, w, SkinnyConfig(**fields), scale=scale)
        except Exception:  # compile errors (e.g. out of resources): the parent reports them
            failed += 1
    torch.cuda.synchronize()
    return failed


def precompile(tasks: list[tuple[int, int, int, SkinnyConfig]], jobs: int, deadline: float,
               quant: str = "") -> str:
    """Compile the distinct candidates in ``jobs`` processes; returns a one-line summary."""
    seen, uniq = set(), []
    for m, n, k, cfg in tasks:
        key = (m, n, k, cfg)
        if key not in seen:
            seen.add(key)
            uniq.append((m, n, k, dataclasses.asdict(cfg)))
    if jobs <= 1 or not uniq:
        return f"{len(uniq)} candidates, compiled on first use"
    jobs = min(jobs, len(uniq))
    chunks = [uniq[i::jobs] for i in range(jobs)]
    t0 = time.time()
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"))
    futures = [pool.submit(_compile_worker, chunk, quant) for chunk in chunks]
    done, pending = wait(futures, timeout=max(1.0, deadline - time.time()))
    if pending:  # out of time: stop the workers (our own children, by pid); the rest compiles lazily
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.terminate()
    pool.shutdown(wait=not pending, cancel_futures=True)
    failed = sum(f.result() for f in done if f.exception() is None)
    crashed = sum(f.exception() is not None for f in done)
    note = f", {len(pending)} workers stopped at the budget" if pending else ""
    note += f", {crashed} workers crashed: {next(f.exception() for f in done if f.exception())!r}" if crashed else ""
    return (f"{len(uniq)} candidates compiled in {time.time() - t0:.0f} s on {jobs} processes "
            f"({failed} failed to compile{note})")


# ---- one case -------------------------------------------------------------------------------------


class Case:
    """One (shape, M): inputs, the W copies to rotate through, the reference, the results."""

    def __init__(self, name: str, n: int, k: int, m: int, device: torch.device, tiny: bool,
                 quant: str = ""):
        self.name, self.n, self.k, self.m, self.quant = name, n, k, m, quant
        self.fp8 = fp8 = bool(quant)  # a one-byte weight with row scales (e4m3 or int8)
        g = torch.Generator(device=device).manual_seed(n * 31 + k + m)
        dtype = torch.bfloat16
        self.x = torch.randn(m, k, generator=g, device=device).to(dtype)
        w0 = (torch.randn(n, k, generator=g, device=device) * k**-0.5).to(dtype)
        weight_bytes = 1 if fp8 else 2
        copies = 1 if tiny else max(2, min(128, cdiv(ROTATE_BYTES, n * k * weight_bytes)))
        self.bf16_weights = [w0] + [w0.clone() for _ in range(copies - 1)]  # cuBLAS's, the bf16 kernel's
        if fp8:  # (Wq, scale) copies; the reference multiplies out the dequantized weight
            q, scale = quantize_weight(w0, quant)
            self.weights = [(q, scale)] + [(q.clone(), scale.clone()) for _ in range(copies - 1)]
            w_ref = q.float() * scale[:, None]
        else:
            self.weights = [(w, None) for w in self.bf16_weights]
            w_ref = w0.float()
        ref = self.x.float() @ w_ref.T
        absprod = self.x.float().abs() @ w_ref.abs().T
        self.ref, self.tol = ref, 2.0**-7 * ref.abs() + 1e-5 * absprod + 1e-6
        self.bytes = n * k * weight_bytes + (m * k + m * n) * 2 + (4 * n if fp8 else 0)
        self.bf16_default_us = float("nan")
        self.results: dict[SkinnyConfig, float] = {}
        self.wrong: list[str] = []
        self.skipped = 0
        self.cublas_us = self.default_us = float("nan")

    def correct(self, y: torch.Tensor) -> bool:
        return bool(((y.float() - self.ref).abs() <= self.tol).all())

    def timer(self) -> Callable[[list[Callable[[], object]]], float]:
        return time_graph if self.x.is_cuda else time_cpu

    def time_cublas(self) -> None:
        if not self.fp8:  # the unquantized product: the fp8 reference is another weight
            assert self.correct(F.linear(self.x, self.bf16_weights[0])), f"{self.name} M={self.m}: cuBLAS wrong?"
        self.cublas_us = self.timer()([lambda w=w: F.linear(self.x, w) for w in self.bf16_weights])
        if self.fp8:  # the bf16 kernel at its default config, for the fp8 one to beat
            cfg = sg.default_config(self.m, self.n, self.k)
            self.bf16_default_us = self.timer()([lambda w=w: sg.skinny_gemm(self.x, w, cfg)
                                                 for w in self.bf16_weights])

    def time_config(self, cfg: SkinnyConfig) -> float | None:
        if cfg in self.results:
            return self.results[cfg]
        try:
            y = sg.skinny_gemm(self.x, self.weights[0][0], cfg, scale=self.weights[0][1])
        except Exception as exc:  # compile failure (resources): not a candidate
            self.wrong.append(f"{cfg}: {type(exc).__name__}: {str(exc)[:120]}")
            return None
        if not self.correct(y):
            err = ((y.float() - self.ref).abs() / self.tol).max().item()
            self.wrong.append(f"{cfg}: WRONG RESULT ({err:.3g} x tolerance)")
            return None
        try:
            us = self.timer()([lambda w=w, s=s: sg.skinny_gemm(self.x, w, cfg, scale=s) for w, s in self.weights])
        except Exception as exc:
            self.wrong.append(f"{cfg}: timing failed: {type(exc).__name__}: {str(exc)[:120]}")
            return None
        # after many replays: still the same bits (split-K sums in a fixed order; a race in the
        # in-kernel reduction would show here)
        if not torch.equal(sg.skinny_gemm(self.x, self.weights[0][0], cfg, scale=self.weights[0][1]), y):
            self.wrong.append(f"{cfg}: NOT REPRODUCIBLE after the timing replays")
            return None
        self.results[cfg] = us
        return us

    def ranked(self) -> list[tuple[float, SkinnyConfig]]:
        return sorted(((us, cfg) for cfg, us in self.results.items()), key=lambda t: t[0])


def run_phase(cases: list[Case], lists: list[list[SkinnyConfig]], args, deadline: float, label: str) -> None:
    tasks = [(c.m, c.n, c.k, cfg) for c, cfgs in zip(cases, lists) for cfg in cfgs if cfg not in c.results]
    if args.device == "cuda":
        try:
            summary = precompile(tasks, args.jobs, deadline - 20, args.quant)
        except Exception as exc:  # the timing loop compiles whatever is missing
            summary = f"parallel compile failed ({type(exc).__name__}: {exc}); compiling on first use"
        print(f"{label}: {summary}", flush=True)
    for case, cfgs in zip(cases, lists):
        for cfg in cfgs:
            if time.time() > deadline:
                case.skipped += 1
                continue
            case.time_config(cfg)


def fmt_cfg(cfg: SkinnyConfig) -> str:
    dot = "dot" if cfg.use_dot else "gemv"
    ev = "" if cfg.evict_first else " keep"
    return f"{dot} {cfg.block_n}x{cfg.block_k} sk{cfg.split_k} w{cfg.num_warps} s{cfg.num_stages}{ev}"


def main(argv: list[str] | None = None) -> int:
    global NUM_SMS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", default="1,4,16", help="rows of x to measure (comma list, each <= 16)")
    ap.add_argument("--shapes", default="", help="extra NxK shapes, comma list (e.g. drafter)")
    ap.add_argument("--only", action="store_true", help="only the --shapes shapes (e.g. the lm_head)")
    ap.add_argument("--quick", action="store_true", help="smaller phase A, top-1 phase B")
    ap.add_argument("--top-b", type=int, default=2, help="phase-A configs refined in phase B")
    ap.add_argument("--budget", type=float, default=200.0, help="seconds for the whole run")
    ap.add_argument("--jobs", type=int, default=min(16, max(1, (os.cpu_count() or 2) - 1)),
                    help="compile processes (1: compile in this process)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, 2 configs each (CPU wiring check)")
    ap.add_argument("--json", default="", help="also write every timing to this file")
    quant = ap.add_mutually_exclusive_group()
    quant.add_argument("--fp8", action="store_true",
                       help="e4m3 weights with row scales (the kernel's scale= path; module docstring)")
    quant.add_argument("--int8", action="store_true",
                       help="the greedy lm_head's int8 rows with scales (module docstring)")
    args = ap.parse_args(argv)
    args.quant = "int8" if args.int8 else "fp8" if args.fp8 else ""
    args.fp8 = bool(args.quant)  # one byte a weight element: the e4m3 table's configs
    weight_bytes = 1 if args.fp8 else 2
    t_start = time.time()
    deadline = t_start + args.budget
    device = torch.device(args.device)
    if not sg.is_available(device):
        print(f"skinny_gemm cannot run on {device} (needs CUDA sm80+ with triton, or "
              "TRITON_INTERPRET=1 for --device cpu)", file=sys.stderr)
        return 2
    ms = [int(s) for s in args.m.split(",") if s]
    if not ms or not all(1 <= m <= sg.MAX_M for m in ms):
        ap.error(f"--m values must be in 1..{sg.MAX_M}")
    shapes = TINY_SHAPES if args.tiny else [] if args.only else list(SHAPES)
    for s in filter(None, args.shapes.split(",")):
        n, k = (int(v) for v in s.lower().split("x"))
        shapes.append((f"extra {n}x{k}", n, k))

    if device.type == "cuda":
        NUM_SMS = torch.cuda.get_device_properties(device).multi_processor_count
        bw = copy_bandwidth(device)
        print(f"device {torch.cuda.get_device_name(device)}, {NUM_SMS} SMs, copy bandwidth "
              f"{bw / 1e12:.2f} TB/s (4 GiB device-to-device copy, read + write)", flush=True)
    else:
        bw = float("nan")
        print("device cpu (Triton interpreter): wiring check only, times are meaningless", flush=True)

    cases = [Case(name, n, k, m, device, args.tiny, args.quant) for name, n, k in shapes for m in ms]
    for case in cases:
        case.time_cublas()

    def default(c: Case) -> SkinnyConfig:
        return explicit(sg.default_config(c.m, c.n, c.k, fp8=args.fp8, int8=args.int8), c.m)

    if args.tiny:
        lists = [[default(c), SkinnyConfig(16, 32, 2, 2, 1, use_dot=True)] for c in cases]
    else:
        lists = [[default(c)] + phase_a(c.m, c.n, c.k, args.quick, weight_bytes) for c in cases]
    run_phase(cases, lists, args, deadline, "phase A")
    for case in cases:
        case.default_us = case.results.get(default(case), float("nan"))
    if not args.tiny:
        top = 1 if args.quick else args.top_b
        lists = [phase_b(c.m, c.n, c.k, [cfg for _, cfg in c.ranked()[:top]], weight_bytes) for c in cases]
        run_phase(cases, lists, args, deadline, "phase B")

    # ---- report ----
    if args.fp8:
        kind = "int8" if args.int8 else "fp8"
        rows = "int8 rows" if args.int8 else "e4m3 rows"
        print(f"\n{kind} weights ({rows}, fp32 scales) against the bf16 kernel's default config (us):")
        for c in cases:
            ranked = c.ranked()
            best_us = ranked[0][0] if ranked else float("nan")
            print(f"  {c.name} {c.n} x {c.k} M={c.m}: bf16 default {c.bf16_default_us:.2f}, {kind} default "
                  f"{c.default_us:.2f}, {kind} best {best_us:.2f} ({c.bf16_default_us / best_us:.2f}x)")
    print(f"\n{sum(len(c.results) for c in cases)} configs timed in {time.time() - t_start:.0f} s "
          f"(budget {args.budget:.0f} s, {sum(c.skipped for c in cases)} skipped at it); "
          "times in us per call (CUDA graph replay, W cycling through > L2); TB/s over W + x + y\n")
    print("| shape | N x K | M | cuBLAS us | cuBLAS TB/s | default us | best Triton config | Triton us "
          "| Triton TB/s | % of copy bw | cuBLAS / Triton |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    best: dict[tuple[int, int, int], tuple[SkinnyConfig, float, float]] = {}
    for c in cases:
        ranked = c.ranked()
        cub_tbs = c.bytes / c.cublas_us / 1e6
        if not ranked:
            print(f"| {c.name} | {c.n} x {c.k} | {c.m} | {c.cublas_us:.2f} | {cub_tbs:.2f} | - | (none) | - | - | - | - |")
            continue
        us, cfg = ranked[0]
        tbs = c.bytes / us / 1e6
        print(f"| {c.name} | {c.n} x {c.k} | {c.m} | {c.cublas_us:.2f} | {cub_tbs:.2f} | {c.default_us:.2f} "
              f"| {fmt_cfg(cfg)} | {us:.2f} | {tbs:.2f} | {100 * tbs * 1e12 / bw:.0f} | {c.cublas_us / us:.2f} |")
        key = (next_pow2(c.m), c.n, c.k)
        if key not in best or us < best[key][1]:
            best[key] = (cfg, us, c.cublas_us)
    print("\nrunners-up (us):")
    for c in cases:
        print(f"  {c.name} M={c.m}: " + "; ".join(f"{fmt_cfg(cfg)} {us:.2f}" for us, cfg in c.ranked()[1:5])
              + (f"  [{c.skipped} skipped at the budget]" if c.skipped else ""))
    wrong = [(c, w) for c in cases for w in c.wrong]
    if wrong:
        print(f"\n{len(wrong)} candidates failed (compile error or wrong result):")
        for c, w in wrong[:40]:
            print(f"  {c.name} M={c.m}: {w}")

    print("\n# paste into laguna_dflash/kernels/skinny_gemm.py (keys: (next_pow2(M), N, K))")
    print("_MEASURED_INT8 = {" if args.int8 else "_MEASURED_FP8 = {" if args.fp8 else "_MEASURED = {")
    for (mb, n, k), (cfg, us, cub) in sorted(best.items()):
        fields = ", ".join(f"{f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg))
        print(f"    ({mb}, {n}, {k}): SkinnyConfig({fields}),  # {us:.2f} us, cuBLAS {cub:.2f} us")
    print("}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "copy_bandwidth": bw,
            "cases": [{"name": c.name, "n": c.n, "k": c.k, "m": c.m, "cublas_us": c.cublas_us,
                       "results": [[us, dataclasses.asdict(cfg)] for us, cfg in c.ranked()],
                       "failed": c.wrong, "skipped": c.skipped} for c in cases],
        }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
