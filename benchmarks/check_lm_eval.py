"""lm-evaluation-harness against the server: its ``local-completions`` model (the OpenAI
completions API: token-id prompts in batches, ``echo`` + ``logprobs`` for loglikelihoods) must
score what the offline engine scores. A manual check, not a test: lm-eval and its API extras are
heavy, so they are not test dependencies. Run the server, then this script with lm-eval
installed (``pip install "lm-eval[api]==0.4.13"``, transformers, this package)::

    laguna-dflash serve --model DIR --port 8123 --served-model-name tiny &
    python benchmarks/check_lm_eval.py --model DIR --url http://127.0.0.1:8123/v1/completions

Prints each loglikelihood from lm-eval and from ``LLM(...).generate(prompt_logprobs=1)``; exits
non-zero when they differ by more than 1e-4.
"""

from __future__ import annotations

import argparse
import sys

PAIRS = [("def add(a, b):", " return a + b"), ("import os", " import sys"), ("class Foo:", " pass")]


def main() -> None:
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from laguna_dflash import LLM, SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="the served checkpoint (its tokenizer, the offline engine)")
    ap.add_argument("--url", default="http://127.0.0.1:8123/v1/completions")
    ap.add_argument("--served-model-name", default="tiny")
    args = ap.parse_args()
    lm = LocalCompletionsAPI(base_url=args.url, model=args.served_model_name, tokenizer_backend="huggingface",
                             tokenizer=args.model, tokenized_requests=True, max_length=256,
                             num_concurrent=1, batch_size=2)
    got = lm.loglikelihood([Instance("loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(PAIRS)])
    llm = LLM(args.model, max_model_len=256)
    worst = 0.0
    for (context, continuation), (served, _) in zip(PAIRS, got):
        ctx = llm.tokenizer.encode(context, add_special_tokens=False)
        cont = llm.tokenizer.encode(continuation, add_special_tokens=False)
        out = llm.generate(prompt_token_ids=[ctx + cont], sampling_params=SamplingParams(
            temperature=0, max_tokens=1, prompt_logprobs=1))[0]
        offline = sum(out.prompt_logprobs[len(ctx) + j][t] for j, t in enumerate(cont))
        worst = max(worst, abs(served - offline))
        print(f"{context!r} + {continuation!r}: lm-eval {served:.6f}, offline {offline:.6f}")
    sys.exit(0 if worst <= 1e-4 else 1)


if __name__ == "__main__":
    main()
