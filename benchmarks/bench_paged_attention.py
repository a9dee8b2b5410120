"""Why does attention take ~10 us a layer in the 4-token verify and ~5.5 in the 1-token decode?

The paged attention kernel (and its split merge) alone, at Laguna-XS-2.1 shapes on one GPU: a
batch-1 request of ``--context`` keys, 8 KV heads of 128, the sliding layers' 64 query heads
(window 512) and the full layers' 48, for 1 and 4 query tokens. Each variant is timed in a CUDA
graph that runs one call per layer over ``--layers`` separate K/V caches (> L2, as in the decode
graph, where other layers' weights evict a layer's cache), us per call; the output is checked
against the defaults' first.

    python benchmarks/bench_paged_attention.py                  # H200
    python benchmarks/bench_paged_attention.py --variants default,block_n=32,warps=8

Variants (``--variants``, comma-separated; ``+`` joins several into one): ``default``;
``block_n=N`` (keys a tile); ``splits=S`` (split-K factor); ``warps=W`` (every program);
``rows=R`` (``_TARGET_ROWS``: query rows a program aims at; 8 gives one query token a program
with GQA 8); ``no_preload`` (the PDL wait before the first key tile's loads,
``PRELOAD_OLD_KEYS = False``); ``preload_max=Q`` (those loads only up to ``Q`` query tokens,
``PRELOAD_MAX_QUERIES``); ``keep_empty`` (split chunks without a visible key store their acc rows
and the merge reads them, ``SKIP_EMPTY_SPLITS = False``); ``no_pdl``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemv_formulations import time_graph  # noqa: E402

from laguna_dflash.kernels import paged_attention as pa  # noqa: E402
from laguna_dflash.kernels import pdl  # noqa: E402

DEFAULT_VARIANTS = ("default,block_n=32,block_n=128,splits=8,splits=16,warps=8,rows=8+splits=32,"
                    "rows=16+splits=32,no_preload,no_pdl")


@contextlib.contextmanager
def variant(spec: str):
    """Apply one variant (``a+b``: several) for the block: yields the extra keyword arguments of
    ``paged_attention`` (module switches are set and restored around the block)."""
    saved: list[tuple[object, str, object]] = []

    def put(obj, attr, new):
        saved.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, new)

    kwargs = {}
    for part in spec.split("+"):
        name, _, value = part.partition("=")
        if name == "block_n":
            kwargs["block_n"] = int(value)
        elif name == "splits":
            kwargs["num_splits"] = int(value)
        elif name == "warps":
            put(pa, "_num_warps", lambda block_m, block_d, w=int(value): w)
        elif name == "rows":
            put(pa, "_TARGET_ROWS", int(value))
        elif name == "no_preload":
            put(pa, "PRELOAD_OLD_KEYS", False)
        elif name == "no_pdl":
            put(pdl, "USE_PDL", False)
        elif name == "keep_empty":
            put(pa, "SKIP_EMPTY_SPLITS", False)
        elif name == "preload_max":
            put(pa, "PRELOAD_MAX_QUERIES", int(value))
        elif name != "default":
            for obj, attr, old in reversed(saved):
                setattr(obj, attr, old)
            raise SystemExit(f"--variants: unknown variant {part!r}; use default, block_n=N, splits=S, "
                             "warps=W, rows=R, preload_max=Q or no_preload, no_pdl, keep_empty (joined with +)")
    try:
        yield kwargs
    finally:
        for obj, attr, old in reversed(saved):
            setattr(obj, attr, old)


def layer_inputs(num_layers: int, context: int, q_len: int, heads: int, device: str,
                 kv_heads: int = 8, head_dim: int = 128, block: int = 16, seed: int = 0) -> list[dict]:
    """Per layer: q, its own K/V cache (slots 0 .. context + q_len, paged in order) and the
    metadata of one request whose last ``q_len`` keys are the new tokens."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    seq_len = context + q_len
    num_keys = 1 << max(0, seq_len - 1).bit_length()  # the graph runner's key bucket
    num_slots = -(-num_keys // block) * block + block
    key_slots = torch.arange(num_keys, device=device).view(1, -1)
    positions = torch.arange(context, seq_len, device=device).view(1, -1)
    layers = []
    for _ in range(num_layers):
        kv = (torch.randn(2, num_slots, kv_heads, head_dim, generator=g) * 0.5).to(device, torch.bfloat16)
        layers.append(dict(
            q=torch.randn(q_len, heads, head_dim, generator=g).to(device, torch.bfloat16),
            k_cache=kv[0], v_cache=kv[1], query_index=torch.arange(q_len, device=device).view(1, -1),
            query_positions=positions, key_slots=key_slots,
            seq_lens=torch.tensor([seq_len], device=device)))
    return layers


def time_calls(layers: list[dict], kwargs: dict) -> tuple[float, torch.Tensor]:
    """(us per call in a graph of one call per layer, best of 3; the first layer's output)."""
    first = pa.paged_attention(**layers[0], **kwargs).clone()  # compiles
    return time_graph([functools.partial(pa.paged_attention, **x, **kwargs) for x in layers]), first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    args = ap.parse_args()
    specs = args.variants.split(",")
    shapes = [(64, 512, "sliding, 64 heads"), (48, None, "full, 48 heads")]
    print(f"{torch.cuda.get_device_name()}, context {args.context}, {args.layers} layers of K/V; "
          "us per attention call (+ merge)\n")
    print("| variant | " + " | ".join(f"{label}, q={q}" for _, _, label in shapes for q in (1, 4))
          + " |\n|---|" + "---:|" * (2 * len(shapes)))
    inputs = {(h, q): layer_inputs(args.layers, args.context, q, h, "cuda")
              for h, _, _ in shapes for q in (1, 4)}
    reference = {}
    for spec in specs:
        cells = []
        for heads, window, _ in shapes:
            for q in (1, 4):
                kw = dict(scale=128 ** -0.5, causal=True, sliding_window=window)
                try:
                    with variant(spec) as extra:
                        us, out = time_calls(inputs[heads, q], {**kw, **extra})
                except Exception as e:  # noqa: BLE001 - one failing variant must not lose the rest
                    cells.append(f"failed: {type(e).__name__}")
                    continue
                ref = reference.setdefault((heads, q), out)
                ok = torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
                cells.append(f"{us:.2f}" if ok else f"{us:.2f} (WRONG)")
        print(f"| {spec} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
