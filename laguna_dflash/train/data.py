"""Training data for the demo pair: the interpreter's own standard library, and its tokenizer.

The ``test`` package and a handful of named modules are held out of training and serve as the
evaluation set. The tokenizer is a byte-level BPE (HF ``tokenizers``) with reserved special
tokens, including the DFlash mask token.
"""

from __future__ import annotations

import json
import logging
import random
import sysconfig
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

# Modules kept out of training (besides the whole ``test`` package): the held-out set.
HELD_OUT_MODULES = ("json", "csv", "heapq", "bisect", "textwrap", "fractions", "statistics",
                    "difflib", "shlex", "graphlib")
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|mask|>", "<|file|>")
PAD_ID, BOS_ID, EOS_ID, MASK_ID, FILE_ID = range(len(SPECIAL_TOKENS))


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_held_out(rel: Path) -> bool:
    top = rel.parts[0]
    name = top[:-3] if top.endswith(".py") else top
    return top == "test" or name in HELD_OUT_MODULES or "tests" in rel.parts


def stdlib_files(split: str, root: Path | None = None) -> list[Path]:
    """Sorted ``.py`` files of the standard library: ``split`` is ``train`` or ``heldout``."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = root or stdlib_root()
    out = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if "site-packages" in rel.parts or "dist-packages" in rel.parts:
            continue
        if _is_held_out(rel) == (split == "heldout"):
            out.append(f)
    return out


def read_texts(files: list[Path], max_bytes: int | None = None) -> list[str]:
    texts, total = [], 0
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if max_bytes is not None and total >= max_bytes:
            break
    return texts


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path) -> None:
    """Byte-level BPE with the special tokens first; writes ``tokenizer.json`` + config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID], "pad_token": SPECIAL_TOKENS[PAD_ID],
        "mask_token": SPECIAL_TOKENS[MASK_ID], "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")


def load_tokenizer(directory: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))


def encode_corpus(texts: list[str], tokenizer) -> np.ndarray:
    """All files as one uint16 stream: ``<|file|> tokens... <|eos|>`` per file."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.append(FILE_ID)
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return np.asarray(ids, dtype=np.uint16)


def prompts_from_texts(texts: list[str], num_prompts: int, seed: int, min_lines: int = 3) -> list[str]:
    """Code prompts: the source up to and including a ``def``/``class`` header line, taking the
    header plus up to ``min_lines`` lines of preceding context (deterministic for a seed).

    The header's newline is left off: the byte-level BPE merges a newline with the indentation
    that follows it, so a prompt ending in a bare newline would ask for a token boundary the
    model never saw in training (and its continuation would start at column 0)."""
    rng = random.Random(seed)
    candidates = []
    for text in texts:
        lines = text.splitlines(keepends=True)
        for i, line in enumerate(lines):
            stripped = line.lstrip()
            if (stripped.startswith("def ") or stripped.startswith("class ")) and line.rstrip().endswith(":"):
                start = max(0, i - min_lines)
                candidates.append("".join(lines[start : i + 1]).rstrip("\n"))
    rng.shuffle(candidates)
    return candidates[:num_prompts]


def heldout_prompts(num_prompts: int = 32, seed: int = 0) -> list[str]:
    """The default evaluation prompts, drawn from the held-out modules."""
    return prompts_from_texts(read_texts(stdlib_files("heldout")), num_prompts, seed)
