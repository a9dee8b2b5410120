"""A reduced draft vocabulary: the drafter picks its draft tokens among a fixed list of frequent
token ids instead of the whole vocabulary (FR-Spec, arXiv 2502.14856; SGLang's
``--speculative-token-map``).

A DFlash drafter shares the target's lm_head ``W [V, H]`` (100352 rows at Laguna size), and at
batch 1 its draft logits stream all of it every step (~72 us of a ~5 ms DFlash step on an H100
with the fp8 copy: docs/PERFORMANCE.md). With a token map ``ids [V_d]`` (``V_d`` < ``V``) the
drafter keeps ``W_d = W[ids]`` and drafts::

    d = ids[argmax_j (h @ W_d^T)[j]]

which reads ``V_d / V`` of those bytes. Only the drafts change: the verify is the target's over
the whole vocabulary, and a draft is one token whichever list it came from, so the output is the
target's, token for token at temperature 0 and in distribution above it (engine/spec_decode.py).
A token outside the map is never drafted; a map of the tokens that make up most of a corpus
costs little acceptance (FR-Spec: 32k of Llama-3's 128k). ``laguna-dflash token-map`` counts a
corpus and writes one.

The file is SGLang's format: a ``torch.save`` of a 1-D integer tensor (or list) of token ids,
``.pt``; a JSON list of integers (``.json``) is read too. The ids must be distinct and inside the
target's vocabulary; their order is the order of ``W_d``'s rows (a tie between two rows' logits
drafts the earlier one, as ``argmax`` does).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

__all__ = ["TOKEN_MAP_FLAG", "load_token_map", "most_frequent_tokens", "restrict_rows", "save_token_map"]

# how users name the file (cli, server); the engine's errors point there
TOKEN_MAP_FLAG = "--speculative-token-map"


def load_token_map(path: str | Path, vocab_size: int) -> torch.Tensor:
    """The token ids of a token map file -> ``[V_d]`` int64 (CPU), checked against the target's
    ``vocab_size``; a ``ValueError`` naming the flag and the fix otherwise."""
    path = Path(path)
    where = f"{TOKEN_MAP_FLAG} {path}"
    if not path.is_file():
        raise ValueError(f"{where}: no such file; pass a .pt file of token ids (torch.save of a 1-D "
                         "tensor, SGLang's format) or a .json list, e.g. from `laguna-dflash token-map`")
    if path.suffix == ".json":
        try:
            raw = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{where}: not valid JSON ({e}); a .json token map is a list of token ids") from None
    else:
        try:
            raw = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - pickle / zip errors of many kinds
            raise ValueError(f"{where}: torch.load failed ({type(e).__name__}: {e}); a token map is a "
                             "torch.save of a 1-D tensor of token ids (.pt) or a JSON list (.json)") from None
    ids = _as_ids(raw, where)
    if ids.numel() == 0:
        raise ValueError(f"{where}: the token map is empty; it must list at least one token id")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"{where}: token id {bad} is outside the target's vocabulary [0, {vocab_size}); "
                         "was the map built with another tokenizer?")
    if torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"{where}: the token map lists some ids more than once; each id must appear once")
    return ids


def _as_ids(raw: object, where: str) -> torch.Tensor:
    """A tensor or list of integers -> 1-D int64 tensor, else a ValueError."""
    if isinstance(raw, dict) and len(raw) == 1:  # a state dict of one tensor
        raw = next(iter(raw.values()))
    if isinstance(raw, (list, tuple)):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
            raise ValueError(f"{where}: the token map must hold integers only (token ids)")
        return torch.tensor(list(raw), dtype=torch.int64)
    if not isinstance(raw, torch.Tensor):
        raise ValueError(f"{where}: expected a 1-D tensor or list of token ids, got {type(raw).__name__}")
    if raw.dtype.is_floating_point or raw.dtype.is_complex or raw.dtype == torch.bool:
        raise ValueError(f"{where}: expected integer token ids, got a {raw.dtype} tensor")
    if raw.dim() != 1:
        raise ValueError(f"{where}: expected a 1-D tensor of token ids, got shape {tuple(raw.shape)}")
    return raw.to(torch.int64)


def most_frequent_tokens(counts: torch.Tensor, num_tokens: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The ``num_tokens`` ids of the largest ``counts [V]`` -> ``[num_tokens]`` int64, the most
    frequent first (ties: the smaller id first), with every id of ``always`` (e.g. the
    end-of-sequence tokens, which a corpus of documents rarely holds) in place of the least
    frequent others where they did not make the list. Ids never counted still fill the list
    when ``num_tokens`` exceeds the ids that were (the smallest ids first)."""
    vocab_size = counts.numel()
    if not 1 <= num_tokens <= vocab_size:
        raise ValueError(f"--num-tokens must be between 1 and the vocabulary size {vocab_size}, got {num_tokens}")
    forced = sorted({int(t) for t in always if 0 <= int(t) < vocab_size})
    if len(forced) > num_tokens:
        raise ValueError(f"--num-tokens {num_tokens} is fewer than the {len(forced)} tokens always kept "
                         "(the end-of-sequence ids); ask for more")
    # stable sort on -count: equal counts keep id order
    order = torch.sort(-counts.to(torch.int64), stable=True).indices
    is_forced = torch.zeros(vocab_size, dtype=torch.bool)
    is_forced[forced] = True
    rest = order[~is_forced[order]][: num_tokens - len(forced)]
    chosen = torch.sort(torch.cat([rest, torch.tensor(forced, dtype=torch.int64)])).values
    # the list in frequency order (by id among equal counts), the forced ids by their own counts
    return chosen[torch.sort(-counts.to(torch.int64)[chosen], stable=True).indices]


def save_token_map(token_ids: torch.Tensor | list[int], path: str | Path) -> Path:
    """Write ``token_ids`` as SGLang's format (``.pt``: ``torch.save`` of an int64 tensor) or a
    JSON list (``.json``) -> the path."""
    path = Path(path)
    ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        path.write_text(json.dumps(ids.tolist()) + "\n")
    else:
        torch.save(ids.clone(), path)
    return path


def restrict_rows(weight: torch.Tensor, token_ids: torch.Tensor, tp) -> torch.Tensor:
    """The rows ``token_ids [V_d]`` of the lm_head ``weight`` -> ``[V_d, H]``, contiguous, the same
    on every rank: with tensor parallelism each rank holds rows ``[r V / n, (r + 1) V / n)``, fills
    those it has into zeros and one sum over the ranks completes the table (each row is nonzero
    on one rank only, so the sum is exact)."""
    ids = token_ids.to(weight.device)
    if not tp.is_parallel:
        return weight[ids].contiguous()
    start = tp.rank * weight.shape[0]
    local = (ids >= start) & (ids < start + weight.shape[0])
    rows = torch.zeros((ids.numel(), weight.shape[1]), dtype=weight.dtype, device=weight.device)
    rows[local] = weight[ids[local] - start]
    return tp.all_reduce(rows)
