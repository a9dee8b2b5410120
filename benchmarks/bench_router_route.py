"""Router GEMM + routing on the GPU: the fused one-launch kernel (``moe_routing.fused_router_route``)
against the two-launch paths it replaces, per sparse layer of a batch-1..16 decode.

For Laguna's router (``E = 256`` experts, ``H = 2048``, bf16, top-8, sigmoid, renormalised, one
shared column) and each ``T`` of ``--t`` it times, per layer:

* ``skinny+route``: the Triton skinny GEMM (``kernels/skinny_gemm.py``, what ``models.layers.linear``
  runs inside CUDA graphs) then ``fused_moe_route``: the path ``MoE.use_fused_router = False`` takes;
* ``cublas+route``: ``F.linear`` then ``fused_moe_route``;
* ``fused``: ``fused_router_route`` with its default config for ``T`` and a few others.

Each variant is captured in ONE CUDA graph of ``--layers`` calls, each with its own router weight
(``--layers`` x 1 MiB, more than the 60 MB L2, so the weights come from HBM as in a forward);
consecutive calls chain through programmatic dependent launch as the layers of a forward do
(``kernels/pdl.py``). Timed: 20 replays, best of 3, microseconds per layer. Every variant's output
is checked bitwise against ``fused_moe_route(F.linear(x, W))`` on inputs whose logits are exact
in fp32 (so any summation order gives the same bits).

    python benchmarks/bench_router_route.py            # T = 1, 2, 3, 4, 8, 16; default + sweep
    python benchmarks/bench_router_route.py --t 1 --no-sweep
    python benchmarks/bench_router_route.py --t 1 --no-sweep --top-k 1   # the top-k rounds' cost
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from laguna_dflash.kernels import moe_routing, skinny_gemm  # noqa: E402
from laguna_dflash.kernels.moe_routing import RouterConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_skinny_gemm import time_graph  # noqa: E402  (one CUDA-graph timer for the benchmarks)

E, H, TOP_K = 256, 2048, 8
SWEEP = [RouterConfig(bn, w, p, ks, xe) for bn, w, p, ks, xe in (
    (8, 4, 128, 4, 128), (8, 8, 128, 4, 256), (8, 8, 128, 4, 128), (4, 4, 256, 4, 128),
)]


def problem(t: int, layers: int, device: torch.device):
    g = torch.Generator().manual_seed(0)
    x = (torch.randint(-8, 9, (t, H), generator=g) / 8).to(device, torch.bfloat16)
    w = (torch.randint(-8, 9, (layers, E, H), generator=g) / 32).to(device, torch.bfloat16)
    bias = (torch.rand(E, generator=g) - 0.5).to(device)
    return x, w, bias


ROUTE = (TOP_K, 0.0, "sigmoid", True)


def two_kernels(gemm, x, w, bias):
    return moe_routing.fused_moe_route(gemm(x, w), bias, *ROUTE, scale=2.5, num_shared=1)


def fused(cfg, x, w, bias):
    return moe_routing.fused_router_route(x, w, bias, *ROUTE, scale=2.5, num_shared=1, config=cfg)


def run_t(t: int, layers: int, sweep: bool, device: torch.device) -> None:
    x, w, bias = problem(t, layers, device)
    want = [two_kernels(F.linear, x, w[i], bias) for i in range(2)]
    variants: dict[str, Callable] = {
        "skinny+route": functools.partial(two_kernels, skinny_gemm.skinny_gemm),
        "cublas+route": functools.partial(two_kernels, F.linear),
    }
    default = moe_routing.default_router_config(t)
    for cfg in [default] + [c for c in SWEEP if sweep and c != default]:
        name = ("fused default " if cfg == default else "fused ") + (
            f"bn={cfg.block_n} w={cfg.num_warps} p={cfg.programs} ks={cfg.max_k_steps} xe={cfg.x_elems}")
        variants[name] = functools.partial(fused, cfg)
    rows = []
    for name, fn in variants.items():
        try:
            for i in range(2):
                got = fn(x, w[i], bias)
                if not (torch.equal(got[0], want[i][0]) and torch.equal(got[1], want[i][1])):
                    raise AssertionError("output differs from the two-kernel path")
            us = time_graph([functools.partial(fn, x, w[i], bias) for i in range(layers)])
        except Exception as exc:  # a config that fails is reported, the rest still run
            print(f"  T={t} {name}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
            continue
        rows.append((us, name))
    base = next(us for us, name in rows if name == "skinny+route")
    print(f"\nT={t}")
    for us, name in sorted(rows):
        print(f"  {us:7.2f} us  x{base / us:4.2f} vs skinny+route   {name}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--t", default="1,2,3,4,8,16", help="token counts, comma-separated (1..16)")
    ap.add_argument("--layers", type=int, default=128, help="router weights cycled through (1 MiB each)")
    ap.add_argument("--no-sweep", action="store_true", help="default config only")
    ap.add_argument("--top-k", type=int, default=TOP_K,
                    help="experts chosen a token (8 is Laguna's; fewer times the selection's rounds)")
    ap.add_argument("--max-rounds", action="store_true",
                    help="select the top-k by max-reduction rounds (moe_routing.TOPK_BITONIC = False)")
    args = ap.parse_args(argv)
    if args.max_rounds:
        moe_routing.TOPK_BITONIC = False
    global ROUTE
    ROUTE = (args.top_k, *ROUTE[1:])
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(device)}; E={E} H={H} bf16 top-{ROUTE[0]}, "
          f"TOPK_BITONIC={moe_routing.TOPK_BITONIC}; us per layer "
          f"(CUDA graph of {args.layers} layers, weights from HBM)")
    for t in (int(v) for v in args.t.split(",")):
        run_t(t, args.layers, not args.no_sweep, device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
