"""One Laguna-XS-2.1 MoE layer's routed experts at decode / verify sizes: fused Triton vs torch.

Shapes (reference/laguna.md section 6.1): hidden 2048, 256 experts of intermediate 512, top-8,
bf16; ``gate_up [256, 1024, 2048]`` + ``down [256, 2048, 512]`` = 6 MiB per expert. For T = 1, 2,
4, 8, 16 tokens (uniform random routing, fixed seed) it times

* ``fused``: ``kernels.fused_moe.fused_moe_experts`` (what ``MoE.forward`` runs on a GPU with ``MoE.use_fused_moe``);
* ``gather``: ``MoE.experts_forward_gather`` (the previous GPU path: one expert copy per pair);
* ``loop``: ``MoE.experts_forward`` (grouped loop over the experts hit, one host sync);
* ``gemv`` (T <= 4): ``kernels.moe_gemv.moe_gemv_experts`` (per-pair GEMVs, ``MoE.use_moe_gemv``
  up to ``MoE.moe_gemv_max_tokens``), replayed, with ``--sweep`` over its tile configs at T = 1
  (``--sweep-gemv 1,4``: at those T; the best pair is printed as module switches, which
  ``profile_decode_xs.py --switch`` takes: an isolated sweep did not rank the T = 4 tiles as the
  verify graph does, docs/PERFORMANCE.md fifty-fifth pass);
* ``sorted``: ``kernels.grouped_moe.sorted_moe_experts`` (pairs sorted by expert once, fixed
  16-row tiles: the batch-invariant mode's and the float32 path's kernels past
  ``MoE.fused_moe_max_pairs``), replayed;
* ``grouped``: ``MoE.experts_forward_grouped`` (``torch._grouped_mm``: what a bf16 engine on sm90
  runs past ``MoE.fused_moe_max_pairs`` pairs, batch-64 decode and batch-16 verify among them),
  replayed;

eagerly, and the first two also replayed from a CUDA graph (``graph``), against the bandwidth
floor: bytes of the distinct experts hit over the device-to-device copy bandwidth measured in the
same run. Weights rotate over ``--layers`` copies so the experts are not already in L2 (50 MB),
as in a real forward where every layer has its own experts. Checks every path against the fp32
reference before timing. Prints a markdown table.

    python benchmarks/bench_fused_moe.py
    python benchmarks/bench_fused_moe.py --sweep   # also try kernel tile configs at T=1 and T=16
    python benchmarks/bench_fused_moe.py --tokens 16,32,64,128,256 --top-k 9 --paths fused,sorted,grouped

``--paths`` picks the columns (default: fused, gather, loop, gemv); every path timed is checked
against the fp32 reference first.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from laguna_dflash.kernels import fused_moe, grouped_moe, moe_gemv
from laguna_dflash.models.layers import MoE

E, K, H, INTER = 256, 8, 2048, 512
EXPERT_BYTES = (2 * INTER * H + H * INTER) * 2  # bf16
GEMV_MAX_TOKENS = 4  # per-pair GEMVs re-read an expert per pair: only small T is worth timing
# the fused kernels group the pairs inside every program over a P-wide vector: past this many
# pairs their build and their per-program scan grow (the engine stops them at 256 pairs)
FUSED_MAX_PAIRS = 1024
PATHS = ("fused", "gather", "loop", "gemv", "sorted", "grouped")


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Bytes moved per second (read + write) by a large device-to-device copy."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 10
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 2 * reps / (start.elapsed_time(end) / 1e3)


def time_per_call(fns: list[Callable[[], object]], reps: int) -> float:
    """Microseconds per call, cycling through ``fns`` (one per layer copy) ``reps`` times."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        for fn in fns:
            fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(fns))


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """Capture ``fn`` (static inputs) into a CUDA graph; returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def path_call(name: str, moe: MoE, x: torch.Tensor, ids: torch.Tensor,
              w: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Path ``name`` over ``moe``'s experts for ``x [T, H]`` routed to ``ids [T, k]`` with weights
    ``w [T, k]``: a callable returning ``[T, H]``, or the weighted pairs ``[T, k, H]`` unsummed."""
    base, _, rows = name.partition(":")  # sorted:N = the sorted kernels at block_m N
    block_m = int(rows) if rows else grouped_moe.DEFAULT_BLOCK_M
    gate_up, down = moe.experts_gate_up, moe.experts_down
    return {
        "fused": lambda: fused_moe.fused_moe_experts(x, ids, w, gate_up, down),
        "gather": lambda: moe.experts_forward_gather(x, w, ids),
        "loop": lambda: moe.experts_forward(x, w, ids),
        "gemv": lambda: moe_gemv.moe_gemv_experts(x, ids, w, gate_up, down),
        "sorted": lambda: grouped_moe.sorted_moe_experts(x, ids, w, gate_up, down, block_m=block_m),
        "grouped": lambda: moe.experts_forward_grouped(x, w, ids),
    }[base]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--layers", type=int, default=8, help="weight copies to rotate (> L2)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also time kernel tile configs")
    ap.add_argument("--sweep-gemv", default="",
                    help="token counts (comma-separated) at which to sweep the per-pair GEMVs' tile "
                         "configs (--sweep sweeps them at 1)")
    ap.add_argument("--top-k", type=int, default=K,
                    help="pairs per token (9: top-8 plus the folded shared expert, as the engine runs it)")
    ap.add_argument("--sweep-sorted", default="",
                    help="comma list of T at which to time the sorted kernels' tile configs")
    ap.add_argument("--paths", default="fused,gather,loop,gemv",
                    help=f"comma list of the paths to time, of {','.join(PATHS)}; sorted:N times "
                         "the sorted kernels at block_m N")
    args = ap.parse_args()
    paths = [s for s in args.paths.split(",") if s]
    unknown = sorted({p for p in paths if p.partition(":")[0] not in PATHS
                      or (p.partition(":")[2] and not p.startswith("sorted:"))})
    if unknown:
        raise SystemExit(f"--paths: unknown {unknown}; choose from {','.join(PATHS)}")
    k_top = args.top_k
    device = torch.device("cuda")
    assert fused_moe.is_available(device), "needs a CUDA GPU (sm80+) with triton"
    torch.manual_seed(0)
    bw = copy_bandwidth(device)
    layers = []
    for _ in range(args.layers):
        moe = MoE(H, E, K, INTER, 0).to(device=device, dtype=torch.bfloat16).eval()
        with torch.no_grad():
            moe.experts_gate_up.normal_(0, H**-0.5)
            moe.experts_down.normal_(0, INTER**-0.5)
        layers.append(moe)
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e9:.0f} GB/s, "
          f"{args.layers} layer copies of {E * EXPERT_BYTES / 2**30:.2f} GiB\n")
    rows = []
    g = torch.Generator().manual_seed(1)
    for t in [int(s) for s in args.tokens.split(",")]:
        ids = torch.stack([torch.randperm(E, generator=g)[:k_top] for _ in range(t)]).to(device)
        w = torch.rand(t, k_top, generator=g)
        w = (w / w.sum(-1, keepdim=True)).to(device=device, dtype=torch.bfloat16)
        x = torch.randn(t, H, generator=g).to(device=device, dtype=torch.bfloat16)
        timed = [p for p in paths if (p != "gemv" or t <= GEMV_MAX_TOKENS)
                 and (p != "fused" or t * k_top <= FUSED_MAX_PAIRS)]
        m0 = layers[0]
        row = {"T": t, "pairs": t * k_top, "experts hit": int(ids.unique().numel())}
        row["floor"] = row["experts hit"] * EXPERT_BYTES / bw * 1e6
        with torch.no_grad():
            ref = fused_moe.moe_experts_reference(
                x.float(), ids, w.float(), m0.experts_gate_up.float(), m0.experts_down.float())
            scale = ref.abs().max().item()
            for name in timed:
                out = path_call(name, m0, x, ids, w)()
                out = out.sum(1) if out.dim() == 3 else out  # the pairs, unsummed
                err = (out.float() - ref).abs().max().item() / scale
                assert err < 3e-2, f"T={t} {name}: relative error {err:.3g} vs the fp32 reference"
            for name in timed:
                fns = [path_call(name, m, x, ids, w) for m in layers]
                if name in ("fused", "gather"):  # the eager launches too (host overhead)
                    row[name] = time_per_call(fns, args.reps)
                if name == "loop":  # syncs the host: no graph
                    row[name] = time_per_call(fns, max(2, args.reps // 4))
                else:
                    row[f"{name} graph"] = time_per_call([graphed(f) for f in fns], args.reps)
            if "gemv graph" in row and ((args.sweep and t == 1) or str(t) in args.sweep_gemv.split(",")):
                sweep_gemv(row, [path_call("gemv", m, x, ids, w) for m in layers], args.reps)
            if str(t) in args.sweep_sorted.split(","):
                sweep_sorted(row, [path_call("sorted", m, x, ids, w) for m in layers], args.reps)
            if args.sweep and t in (1, 16) and "fused" in paths:
                sweep(row, [path_call("fused", m, x, ids, w) for m in layers], args.reps)
        rows.append(row)
    cols = ["T", "pairs", "experts hit", "floor", "fused", "fused graph", "gather", "gather graph",
            "loop", "gemv graph", "sorted graph", "grouped graph"]
    cols += sorted({c for r in rows for c in r if c.startswith("sorted:")})
    cols = [c for c in cols if any(c in r for r in rows)]
    graphs = [c for c in cols if c.endswith(" graph")]
    print("times in microseconds per layer; floor = bytes of the experts hit / copy bandwidth\n")
    print("| " + " | ".join(cols + [f"{c} / floor" for c in graphs]) + " |")
    print("|" + "---|" * (len(cols) + len(graphs)))
    for r in rows:
        cells = ["" if c not in r else str(r[c]) if isinstance(r[c], int) else f"{r[c]:.1f}" for c in cols]
        cells += ["" if c not in r else f"{r[c] / r['floor']:.2f}" for c in graphs]
        print("| " + " | ".join(cells) + " |")


def sweep_configs(label: str, row: dict, calls: list[Callable[[], object]], reps: int, module,
                  names: tuple[str, str], gate_up_cfgs: list[tuple], down_cfgs: list[tuple]) -> None:
    """Time every (gate_up config, down config) pair: ``module``'s two config attributes
    ``names`` set to each in turn (graph replays of ``calls``), then restored; prints the best
    six and the current configs' time."""
    base = tuple(getattr(module, n) for n in names)
    results = []
    try:
        for gu in gate_up_cfgs:
            for dn in down_cfgs:
                for n, cfg in zip(names, (gu, dn), strict=True):
                    setattr(module, n, cfg)
                results.append((time_per_call([graphed(f) for f in calls], reps), gu, dn))
    finally:
        for n, cfg in zip(names, base, strict=True):
            setattr(module, n, cfg)
    results.sort()
    current = next(t for t, a, b in results if (a, b) == base)
    print(f"T={row['T']} {label} sweep (graph us, gate_up cfg, down cfg), best 6 of {len(results)}, "
          f"floor {row['floor']:.1f}, current {current:.1f}: "
          + "; ".join(f"{t:.1f} {a} {b}" for t, a, b in results[:6]), flush=True)
    # the best pair as module switches (JSON values), for profile_decode_xs.py / bench_gpu_xs.py
    print(f"T={row['T']} {label} best: " + " ".join(
        f"{module.__name__}:{n}={json.dumps(list(cfg), separators=(',', ':'))}"
        for n, cfg in zip(names, results[0][1:], strict=True)), flush=True)


def sweep(row: dict, fused: list[Callable[[], object]], reps: int) -> None:
    """The fused kernels' (BLOCK_N, BLOCK_K, warps, stages) per kernel."""
    sweep_configs("fused", row, fused, reps, fused_moe, ("_GATE_UP_CFG", "_DOWN_CFG"),
                  [(16, 128, 4, 4), (16, 256, 4, 3), (16, 128, 2, 4), (32, 128, 4, 4), (32, 256, 4, 3),
                   (64, 128, 4, 4), (32, 64, 2, 6)],
                  [(16, 128, 4, 4), (16, 256, 2, 3), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4),
                   (64, 256, 4, 3), (128, 128, 4, 4), (32, 256, 2, 3)])


def sweep_sorted(row: dict, calls: list[Callable[[], object]], reps: int) -> None:
    """The sorted kernels' (BLOCK_N, BLOCK_K, warps, stages) per kernel."""
    sweep_configs("sorted", row, calls, reps, grouped_moe, ("_GATE_UP_CFG", "_DOWN_CFG"),
                  [(64, 128, 4, 3), (32, 128, 4, 4), (16, 128, 4, 4), (32, 256, 4, 3), (64, 64, 4, 4),
                   (128, 64, 8, 3)],
                  [(128, 64, 4, 4), (64, 128, 4, 4), (32, 128, 4, 4), (64, 64, 4, 4), (128, 128, 8, 3),
                   (32, 256, 4, 3)])


def sweep_gemv(row: dict, gemv: list[Callable[[], object]], reps: int) -> None:
    """The per-pair GEMVs' (BLOCK_N, BLOCK_K, warps) per kernel, at ``row``'s T."""
    sweep_configs("gemv", row, gemv, reps, moe_gemv, ("GATE_UP_CONFIG", "DOWN_CONFIG"),
                  [(8, 256, 4), (16, 256, 4), (8, 128, 4), (16, 128, 8), (4, 512, 4), (8, 512, 8),
                   (32, 128, 4), (16, 512, 8)],
                  [(16, 256, 4), (32, 256, 4), (64, 256, 8), (32, 128, 4), (16, 512, 4), (64, 128, 4),
                   (128, 128, 8), (8, 512, 4)])


if __name__ == "__main__":
    main()
