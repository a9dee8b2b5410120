"""How many vocabulary rows the greedy lm_head's exact pass reads on a trained model.

``kernels/greedy_lm_head.py`` streams an int8 copy of the lm_head and then reads the
full-precision rows of the tokens its error bounds cannot rule out (the candidates). Random
Gaussian weights (``bench_greedy_lm_head.py``) leave tens of candidates a row; a trained head's
peaked logits should leave fewer. This script counts them on a real checkpoint (the embedded demo
target by default): it generates greedily with transformers' own model, takes each step's
final-normed hidden state, and counts the candidates of :func:`greedy_lm_head.candidates_reference`
(checking that the exact argmax is among them and is the generated token).

    python benchmarks/count_greedy_candidates.py                      # the demo target, CPU
    python benchmarks/count_greedy_candidates.py --model DIR --prompts 16 --new-tokens 64

Prints one line per prompt and a summary (median, mean, max candidates a step, and the share of
the vocabulary), then the same counts for Gaussian weights and activations of the same shape (the
GPU benchmarks' kind) over as many rows: the baseline. Runs on the CPU; the model's weights in
bf16.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from laguna_dflash.demo import demo_pair, heldout_prompts  # noqa: E402
from laguna_dflash.kernels import greedy_lm_head as glh  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="a checkpoint directory (default: the demo target)")
    ap.add_argument("--prompts", type=int, default=8, help="held-out demo prompts to run")
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.new_tokens < 1:
        ap.error("--prompts and --new-tokens must be at least 1")

    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    model_dir = args.model or demo_pair()[0]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    weight = model.get_output_embeddings().weight.detach().contiguous()
    head = glh.quantize(weight)
    vocab, hidden = weight.shape
    print(f"{model_dir}: lm_head {vocab} x {hidden} bf16, {args.prompts} prompts x {args.new_tokens} greedy tokens")
    counts: list[int] = []

    def summary(values: list[int]) -> str:
        return (f"median {statistics.median(values):g}, mean {statistics.fmean(values):.2f}, max {max(values)} "
                f"({100 * max(values) / vocab:.2f}% of {vocab}); one candidate in {sum(c == 1 for c in values)} "
                f"of {len(values)} steps")

    for n, prompt in enumerate(heldout_prompts()[: args.prompts]):
        ids = torch.tensor([tokenizer.encode(prompt).ids])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, min_new_tokens=args.new_tokens,
                                 output_hidden_states=True, return_dict_in_generate=True)
        generated = out.sequences[0, ids.shape[1]:]
        row = []
        for step, states in enumerate(out.hidden_states):
            x = states[-1][:, -1, :].to(torch.bfloat16)  # the final-normed hidden state [1, H]
            mask = glh.candidates_reference(x, head)[0]
            best = int(glh.greedy_tokens_reference(x, weight)[0])
            if not bool(mask[best]) or best != int(generated[step]):
                print(f"prompt {n} step {step}: the argmax {best} is not a candidate or not the generated "
                      f"token {int(generated[step])}", file=sys.stderr)
                return 1
            row.append(int(mask.sum()))
        counts += row
        print(f"prompt {n}: candidates a step {row}")
    print(f"\ncandidates a step, this model: {summary(counts)}")
    g = torch.Generator().manual_seed(0)
    gaussian = (torch.randn(vocab, hidden, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(len(counts), hidden, generator=g).to(torch.bfloat16)
    baseline = glh.candidates_reference(x, glh.quantize(gaussian)).sum(dim=1).tolist()
    print(f"candidates a step, Gaussian weights of the same shape: {summary([int(c) for c in baseline])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
