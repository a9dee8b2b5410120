"""DFlash under structured outputs: guided drafts (the drafter's likeliest tokens the grammar
allows, ``spec_decode.num_draft_candidates`` of them looked at) against the drafter's argmax.

The embedded demo pair (a 4096-token byte-level BPE, a trained drafter) decodes the same
prompts greedily free, under a regex, under the same language as a context-free grammar (GBNF,
through llguidance: masks computed per row, not cached per state) and under a JSON schema; per
constraint and drafting mode:
the mean acceptance length, decode tokens per second (the best of ``--rounds`` runs after a
warm-up run) and whether the tokens equal the argmax mode's (they must: drafting changes what is
proposed, never what is accepted).

    python benchmarks/bench_guided_drafts.py --device cuda --rounds 3
    python benchmarks/bench_guided_drafts.py --device cpu --rounds 1 --new-tokens 48
"""

from __future__ import annotations

import argparse

from laguna_dflash import LLM, SamplingParams, StructuredOutputsParams
from laguna_dflash.demo import demo_pair
from laguna_dflash.engine import spec_decode

PROMPTS = ["def add(a, b):\n", "import os\n", "class Point:\n", "def parse(text):\n"]
SCHEMA = {"type": "object", "required": ["name", "args", "returns"], "properties": {
    "name": {"type": "string", "maxLength": 40},
    "args": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    "returns": {"type": "string", "maxLength": 30}}}
CONSTRAINTS = {
    "free": None,
    "regex (a function)": StructuredOutputsParams(
        regex=r"def [a-z_]{1,30}\(([a-z_]{1,10}(, [a-z_]{1,10}){0,3})?\):\n(    [^\n]{0,60}\n){1,6}"),
    "grammar (the same function, GBNF)": StructuredOutputsParams(grammar=r'''
root ::= "def " name "(" args? "):\n" line{1,6}
name ::= [a-z_]{1,30}
args ::= arg (", " arg){0,3}
arg ::= [a-z_]{1,10}
line ::= "    " [^\n]{0,60} "\n"
'''),
    "JSON schema": StructuredOutputsParams(json=SCHEMA),
}


def run(llm: LLM, params: SamplingParams) -> tuple[float, float, list]:
    """One greedy run of PROMPTS -> (mean acceptance length, decode tok/s, tokens)."""
    before = llm.get_metrics()
    out = llm.generate(PROMPTS, params)
    after = llm.get_metrics()
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    rate = (after["num_decode_tokens"] - before["num_decode_tokens"]) / (after["decode_s"] - before["decode_s"])
    return 1 + accepted / max(drafts, 1), rate, [o.token_ids for o in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=3, help="timed runs after a warm-up run")
    ap.add_argument("--new-tokens", type=int, default=96)
    args = ap.parse_args()
    target, draft = demo_pair()
    llm = LLM(str(target), draft=str(draft), device=args.device)
    guided_candidates = spec_decode.num_draft_candidates
    rows = []
    for name, constraint in CONSTRAINTS.items():
        params = SamplingParams(temperature=0, max_tokens=args.new_tokens, structured_outputs=constraint)
        cells = {}
        for mode, count in (("argmax", 0), (f"guided (top {guided_candidates})", guided_candidates)):
            spec_decode.num_draft_candidates = count
            run(llm, params)  # warm-up: graphs, grammar caches
            best = max((run(llm, params) for _ in range(args.rounds)), key=lambda r: r[1])
            cells[mode] = best
        spec_decode.num_draft_candidates = guided_candidates
        (a_len, a_rate, a_tok), (g_len, g_rate, g_tok) = cells.values()
        rows.append(f"| {name} | {a_len:.2f} | {g_len:.2f} | {a_rate:.1f} | {g_rate:.1f} | "
                    f"{g_rate / a_rate:.2f} | {'yes' if a_tok == g_tok else 'NO'} |")
    print(f"\ndemo pair on {args.device}, {len(PROMPTS)} prompts, greedy, {args.new_tokens} new tokens at most\n")
    print("| constraint | acceptance length, argmax | guided | tok/s, argmax | guided | ratio | same tokens |")
    print("|---|---:|---:|---:|---:|---:|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
