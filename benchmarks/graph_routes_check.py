"""Which experts the decode graph's expert GEMVs read, per MoE layer, under an ablation.

The seventy-third pass found the expert GEMVs ~2x faster in the decode graph with fixed routes
(``ablations.py`` ``routing*``), and Nsight Compute (``gpu_check.sh pass128``) found them reading
one expert's bytes from DRAM a layer instead of nine. This prints the ids each layer's GEMVs got
in a replay of the captured batch-1 decode graph: a copy of them is taken inside the graph right
after the GEMVs (one more small kernel a layer), so it holds what they read. Before the
ablations' route tensors were registered with ``kernels.precompile.register_state`` every fixed
id read 0 here (docs/PERFORMANCE.md, seventy-fourth pass).

    python benchmarks/graph_routes_check.py [--layers 4] [--ablate routing ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import ablations
import torch
from bench_gpu_xs import xs_target_config
from profile_decode_xs import decode_graph, engine_step_ms, moe_layers, reset_graphs

from laguna_dflash import LLM
from laguna_dflash.kernels import moe_gemv


def captured_routes(llm: LLM, prompt: list[int], context: int) -> list[torch.Tensor]:
    """The ids ``[T, k]`` each MoE layer's GEMVs read in one replay of the decode graph
    (recaptured here), in layer order."""
    seen: list[tuple[bool, torch.Tensor]] = []
    original = moe_gemv.moe_gemv_experts

    def spy(x, ids, *rest, **kwargs):
        out = original(x, ids, *rest, **kwargs)
        seen.append((torch.cuda.is_current_stream_capturing(), ids.clone()))
        return out

    reset_graphs(llm)
    moe_gemv.moe_gemv_experts = spy
    try:
        engine_step_ms(llm, prompt, 4)
        graph = decode_graph(llm, 1, context)
    finally:
        moe_gemv.moe_gemv_experts = original
    graph.replay()
    torch.cuda.synchronize()
    captured = [ids for capturing, ids in seen if capturing]
    return captured[-len(moe_layers(llm.engine.target)):]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--ablate", action="append", default=[], help="ablations.py NAME (repeatable)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(xs_target_config(args.layers)))
        llm = LLM(tmp, dtype="bfloat16", device="cuda", load_format="dummy", max_num_seqs=1,
                  max_model_len=args.context + 256, num_kv_blocks=(args.context + 320) // 16 * 2)
        prompt = torch.randint(100, 100000, (args.context,),
                               generator=torch.Generator().manual_seed(0)).tolist()
        for spec in [None, *args.ablate]:
            undo = ablations.apply(spec) if spec else (lambda: None)
            try:
                routes = captured_routes(llm, prompt, args.context)
            finally:
                undo()
            print(f"\n## {spec or 'defaults'}: the ids each MoE layer's GEMVs read in a replay")
            for i, ids in enumerate(routes):
                row = ids.reshape(-1).tolist()
                print(f"layer {i}: {row} ({len(set(row))} distinct of {len(row)})")


if __name__ == "__main__":
    main()
