"""How many experts a verify reads, and what that makes the DFlash step's bandwidth floor.

A batch-1 decode step reads ``top_k`` routed experts (plus the shared one) per MoE layer; a
verify of ``K + 1`` tokens reads the union of its tokens' choices, so its floor is not ``K + 1``
times anything simple. This measures the union on the engine's own routing (dummy weights, as
every GPU benchmark here uses; ``MoE.route`` recorded during a prefill of a seeded random
prompt: windows of ``w`` consecutive tokens stand for a verify of ``w`` tokens), prints it
against the uniform-routing expectation ``E (1 - (1 - k/E)^w)``, then what an XS-2.1-size
decode step and a DFlash step of ``K`` drafts must read, part by part, in the formats the engine
streams them (:class:`Formats`: the greedy lm_head's int8 copy, ``--draft-quantization fp8``,
``--speculative-token-map``; the drafter's context store runs in the verify), their bandwidth
floors (bytes / ``--bandwidth``), and the ratio L = K + 1 tokens a step give over target-only if
both steps ran at the same multiple of their floors. With ``--decode-ms`` and ``--dflash-ms``
(measured steps) it also prints each step's multiple of its floor and the DFlash step that 2x
would need at that decode step.

    python benchmarks/verify_floor.py                      # CPU: 3 layers at XS-2.1 widths, ~1 min
    python benchmarks/verify_floor.py --union 29.73 --draft-quantization fp8 --token-map-size 16384 \
        --bandwidth 3.04e12 --decode-ms 2.41 --dflash-ms 4.94   # counting only: no model run

Counting only: no kernel is timed here. The target's bytes are those of
``bench_gpu_xs.active_bytes`` (weights except the embedding, KV of the visible context) with the
expert share replaced by the union, and the lm_head in the format the step reads (with the
bf16 lm_head and ``top_k`` experts, the decode step's count is ``active_bytes``: tested).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_gpu_xs import xs_draft_config, xs_target_config

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.models import fp8
from laguna_dflash.models.layers import MoE
from laguna_dflash.models.registry import resolve_architecture


def mean_union(ids: torch.Tensor, width: int) -> float:
    """``ids [T, k]`` expert ids of T consecutive tokens -> mean number of distinct ids over the
    ``T - width + 1`` windows of ``width`` consecutive tokens."""
    windows = ids.unfold(0, width, 1)  # [T - w + 1, k, w]
    return sum(len(set(win.flatten().tolist())) for win in windows) / windows.shape[0]


def expected_union(num_experts: int, top_k: int, width: int) -> float:
    """Distinct experts of ``width`` tokens each choosing ``top_k`` of ``num_experts`` uniformly."""
    return num_experts * (1 - (1 - top_k / num_experts) ** width)


def meta_model(config: dict, **build_kwargs) -> torch.nn.Module:
    """The registered architecture of ``config`` on the meta device (shapes only, no memory)."""
    with torch.device("meta"):
        return resolve_architecture(config["architectures"][0]).from_config(config, {}, **build_kwargs)


@dataclass(frozen=True)
class Formats:
    """How the engine streams what a batch-1 step reads (bytes an element; one-byte rows carry one
    fp32 scale each).

    Attributes:
        lm_head: the target's lm_head as decode and verify read it: ``"int8"`` (the greedy copy,
            temperature 0: kernels/greedy_lm_head.py) or ``"bf16"`` (sampling).
        draft_quantization: ``"fp8"``: the drafter's :data:`fp8.QUANTIZED_PROJECTIONS` and its
            lm_head copy in e4m3 (``--draft-quantization fp8``); None: bf16.
        token_map_size: rows of the drafter's lm_head (``--speculative-token-map``); None: the
            vocabulary. Without fp8 and without a map the drafts come from the int8 copy.
    """

    lm_head: str = "int8"
    draft_quantization: str | None = None
    token_map_size: int | None = None


def _rows_bytes(rows: int, cols: int, one_byte: bool) -> int:
    # a [rows, cols] bf16 weight, or one byte an element and an fp32 scale a row
    return rows * cols + 4 * rows if one_byte else 2 * rows * cols


def kv_read_bytes(spec, context: int) -> int:
    """Bytes of K and V (bf16) a query row reads over ``spec.layers`` at ``context`` tokens."""
    per_token = 2 * spec.num_kv_heads * spec.head_dim * 2
    return sum(per_token * (min(context, layer.sliding_window) if layer.sliding_window else context)
               for layer in spec.layers)


def step_parts(target: torch.nn.Module, drafter: torch.nn.Module, context: int, union: float,
               formats: Formats) -> list[tuple[str, float, float]]:
    """(part, bytes a batch-1 decode step reads, bytes a DFlash step reads) for the meta-built
    ``target`` and ``drafter`` (bf16): a decode step reads ``top_k`` routed experts a MoE layer,
    the DFlash step's verify ``union``, then the drafter's context store (``fc``, the per-tap
    norms, every layer's K|V rows: in the verify graph), its block (every layer's weights, its
    KV) and its lm_head."""
    moe, spec = target.spec.moe, target.spec
    hidden, vocab = spec.hidden_size, spec.vocab_size
    dense = experts = 0
    for name, p in target.named_parameters():
        if name.startswith(("embed_tokens", "lm_head")):
            continue
        if "experts_" in name:
            experts += p.numel() * 2 / moe.num_experts  # per expert, over the MoE layers
        else:
            dense += p.numel() * 2
    lm_head = _rows_bytes(vocab, hidden, formats.lm_head == "int8")
    kv = kv_read_bytes(spec, context)
    fp8_on = formats.draft_quantization == "fp8"
    quantized = {f"{path}.{name}.weight" for path, name in fp8.QUANTIZED_PROJECTIONS} if fp8_on else set()
    store = block = 0
    for name, p in drafter.named_parameters():
        if name == "norm.weight":
            block += p.numel() * 2
            continue
        if not name.startswith("layers."):
            store += p.numel() * 2  # fc, hidden_norm, the per-tap norms
            continue
        local = name.split(".", 2)[2]
        if local == "self_attn.qkv_proj.weight":
            q_size = drafter.layers[int(name.split(".")[1])].self_attn.q_size
            store += (p.shape[0] - q_size) * p.shape[1] * 2  # the context K|V GEMM reads these rows
        block += _rows_bytes(p.shape[0], p.shape[1], True) if local in quantized else p.numel() * 2
    rows = formats.token_map_size or vocab
    draft_lm_head = _rows_bytes(rows, hidden, fp8_on or formats.token_map_size is None)
    return [
        ("target weights but the routed experts and the lm_head", dense, dense),
        (f"routed experts ({moe.top_k} / {union:.2f} a MoE layer)", experts * moe.top_k, experts * union),
        (f"target lm_head ({formats.lm_head})", lm_head, lm_head),
        (f"target KV read ({context}-token context)", kv, kv),
        ("drafter context store (fc, tap norms, K|V rows)", 0, store),
        ("drafter block weights" + (" (fp8 " + ", ".join(sorted(quantized)) + ")" if quantized else ""), 0, block),
        ("drafter KV read", 0, kv_read_bytes(drafter.spec, context)),
        (f"draft lm_head ({rows} rows, {'fp8' if fp8_on else 'int8' if formats.token_map_size is None else 'bf16'})",
         0, draft_lm_head),
    ]


def measured_union(layers: int, prompt_tokens: int) -> dict[int, float]:
    """Mean distinct routed experts a layer over windows of 1, 2, 4, 8 and 16 consecutive tokens
    of a seeded random prompt, on ``layers`` XS-2.1-width target layers with dummy weights (CPU)."""
    routed: list[torch.Tensor] = []
    original = MoE.route

    def recording(self, x):
        weights, ids = original(self, x)
        routed.append(ids.detach().cpu())
        return weights, ids

    MoE.route = recording
    try:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(xs_target_config(layers)))
            llm = LLM(tmp, dtype="bfloat16", device="cpu", load_format="dummy", max_num_seqs=1,
                      max_model_len=prompt_tokens + 16)
            prompt = torch.randint(100, 100000, (prompt_tokens,),
                                   generator=torch.Generator().manual_seed(0)).tolist()
            llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=1))
    finally:
        MoE.route = original
    prefill = [ids for ids in routed if ids.shape[0] == prompt_tokens]
    assert prefill, "no MoE layer routed the prompt in one forward"
    return {w: sum(mean_union(ids, w) for ids in prefill) / len(prefill) for w in (1, 2, 4, 8, 16)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=3, help="target layers built (full XS-2.1 widths)")
    ap.add_argument("--full-layers", type=int, default=40, help="layers of the model the floors are for")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens whose routing is recorded")
    ap.add_argument("--union", type=float, default=None,
                    help="routed experts a MoE layer the verify reads (e.g. 29.73, measured at 4 tokens): "
                         "skips the routing run")
    ap.add_argument("--context", type=int, default=1024, help="context of the floors' KV reads")
    ap.add_argument("--k", type=int, default=3, help="draft tokens of the DFlash step")
    ap.add_argument("--bandwidth", type=float, default=4.27e12, help="bytes/s (the H200's copy rate)")
    ap.add_argument("--lm-head", choices=("int8", "bf16"), default="int8",
                    help="the target lm_head's format (int8: the greedy copy, temperature 0)")
    ap.add_argument("--draft-quantization", choices=("none", "fp8"), default="none")
    ap.add_argument("--token-map-size", type=int, default=None, help="rows of the draft vocabulary")
    ap.add_argument("--decode-ms", type=float, default=None, help="a measured target-only decode step")
    ap.add_argument("--dflash-ms", type=float, default=None, help="a measured DFlash step of K drafts")
    args = ap.parse_args()
    if (args.decode_ms is None) != (args.dflash_ms is None):
        raise SystemExit("--decode-ms and --dflash-ms go together: give both measured steps, or neither")
    w = args.k + 1
    full = meta_model(xs_target_config(args.full_layers))
    moe = full.spec.moe
    if args.union is None:
        union = measured_union(args.layers, args.prompt)
        print(f"{args.layers} MoE-width layers, {moe.num_experts} experts, top-{moe.top_k}, {args.prompt}-token "
              "prompt (dummy weights, seed 0)\n")
        print("| tokens w | distinct routed experts, mean over windows and layers | uniform expectation |")
        print("|---:|---:|---:|")
        for width, u in union.items():
            print(f"| {width} | {u:.2f} | {expected_union(moe.num_experts, moe.top_k, width):.2f} |")
        verify_union = union.get(w) or expected_union(moe.num_experts, moe.top_k, w)
    else:
        verify_union = args.union
    # the full model's shapes (the meta device: no weights)
    drafter = meta_model(xs_draft_config(args.full_layers), target=full)
    formats = Formats(args.lm_head, None if args.draft_quantization == "none" else args.draft_quantization,
                      args.token_map_size)
    parts = step_parts(full, drafter, args.context, verify_union, formats)
    decode, step = sum(p[1] for p in parts), sum(p[2] for p in parts)
    bw = args.bandwidth
    print(f"\n{args.full_layers} layers, {args.context}-token context, {bw / 1e12:.2f} TB/s; the DFlash step: "
          f"K = {args.k}, a verify of {w} tokens reading {verify_union:.2f} routed experts a layer\n")
    print("| bytes a batch-1 step reads | decode step MB | DFlash step MB |\n|---|---:|---:|")
    for name, d, s in parts:
        print(f"| {name} | {d / 1e6:.1f} | {s / 1e6:.1f} |")
    print(f"| **total** | **{decode / 1e6:.1f}** | **{step / 1e6:.1f}** |")
    floor_d, floor_s = decode / bw, step / bw
    print(f"| floor ms | {1e3 * floor_d:.3f} | {1e3 * floor_s:.3f} |")
    print(f"\nL = {w} at equal multiples of the floors: {w * decode / step:.3f}x target-only")
    if args.decode_ms is not None:
        d_ms, s_ms = args.decode_ms, args.dflash_ms
        need = w * d_ms / 2
        print(f"measured: decode {d_ms:.3f} ms = {d_ms / (1e3 * floor_d):.3f}x its floor, DFlash step "
              f"{s_ms:.3f} ms = {s_ms / (1e3 * floor_s):.3f}x its floor: L = {w} gives {w * d_ms / s_ms:.3f}x; "
              f"2x needs a DFlash step of {need:.3f} ms = {need / (1e3 * floor_s):.3f}x its floor")


if __name__ == "__main__":
    main()
