"""What a structured-output constraint costs the host at a Laguna-size vocabulary: compile time
and the time to give one verify row's allowed-token bit set (ConstraintMatcher.row_bits over a
block of drafts), per backend.

No Laguna tokenizer is reachable here, so a byte-level BPE of ``--vocab`` ids (Laguna's 100352 by
default) is trained on the Python sources of the installed packages (~``--corpus-mb`` MB, a few
seconds) and wrapped as a transformers fast tokenizer. Each constraint of bench_guided_drafts.py
(a function as a regex and as the same language in GBNF, a JSON schema) walks a matching text
token by token, asking for the rows after the outputs so far and the next ``--drafts`` tokens as
drafts (what a DFlash step asks for). The regex automaton caches each state's bit set, so its
second walk is the steady state; llguidance computes every row.

    python benchmarks/bench_constraint_rows.py
    python benchmarks/bench_constraint_rows.py --vocab 4000 --corpus-mb 2   # a quick look
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import sysconfig
import tempfile
import time

from bench_guided_drafts import CONSTRAINTS

from laguna_dflash.structured_outputs import StructuredOutputCompiler

TEXTS = {"JSON schema": '{"name": "parse", "args": ["text", "sep"], "returns": "list"}'}
FUNCTION_TEXT = "def parse_args(text, sep):\n    return text.split(sep)\n    pass\n"


def train_tokenizer(vocab_size: int, corpus_mb: float, out_dir: str):
    """A byte-level BPE of ``vocab_size`` ids (3 special) over installed Python sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = sysconfig.get_paths()["purelib"]  # the installed packages
    files, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        try:
            total += os.path.getsize(path)
        except OSError:
            continue
        files.append(path)
        if total > corpus_mb * 1e6:
            break
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>"]
    bpe.train(files, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = os.path.join(out_dir, "tokenizer.json")
    bpe.save(path)
    return PreTrainedTokenizerFast(tokenizer_file=path, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=100352, help="the model's vocabulary (Laguna's)")
    ap.add_argument("--corpus-mb", type=float, default=40.0)
    ap.add_argument("--drafts", type=int, default=15, help="drafts a row block holds (Laguna's K)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        tokenizer = train_tokenizer(args.vocab, args.corpus_mb, tmp)
        trained = time.perf_counter() - t
    compiler = StructuredOutputCompiler(tokenizer, max(args.vocab, len(tokenizer)))
    print(f"\na byte-level BPE of {len(tokenizer)} ids (trained in {trained:.1f} s), blocks of "
          f"{args.drafts} drafts + 1\n")
    print("| constraint | compile s | text tokens | rows | us a row, first walk | us a row, second walk |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, params in CONSTRAINTS.items():
        if params is None:
            continue
        t = time.perf_counter()
        grammar = compiler.compile(params)
        compile_s = time.perf_counter() - t
        ids = tokenizer.encode(TEXTS.get(name, FUNCTION_TEXT), add_special_tokens=False)
        walks = []
        for _ in range(2):
            matcher = grammar.matcher((tokenizer.eos_token_id,))
            num_rows, t = 0, time.perf_counter()
            for i in range(len(ids)):
                num_rows += len(matcher.row_bits(ids[:i], ids[i : i + args.drafts]))
            walks.append((time.perf_counter() - t) / num_rows * 1e6)
        print(f"| {name} | {compile_s:.2f} | {len(ids)} | {num_rows} | {walks[0]:.0f} | {walks[1]:.0f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
