"""Token sampling: greedy, temperature, min-p, top-k, top-p; per-request seeded generators.

Sampling uses the exponential race (``argmax(p / E)`` with ``E ~ Exp(1)``), which draws from
``p`` exactly and needs no host sync (no ``torch.multinomial``).

Seeded requests: every output position consumes exactly one ``[V]`` draw of the request's
generator, in order, whatever the step kind (prefill, target-only decode, a verify of any K,
the recompute after a preemption). A verify draws one row at a time and records the generator
state after each (``states``); the engine rewinds to the state after the last row it emits, so
the draws of rejected rows are the next positions' draws. A seed therefore gives the same tokens
(given the same logits) with or without speculation, at any K (adaptive K picks it from step
timings), acceptance, and under preemption.
"""

from __future__ import annotations

import math

import torch

from ..config import SamplingParams
from ..kernels.argmax import argmax_rows


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                   min_p: float = 0.0) -> torch.Tensor:
    """``logits [N, V]`` -> probabilities ``[N, V]`` float32 after temperature, min-p, top-k,
    top-p (vLLM's order).

    min-p keeps the tokens with ``p >= min_p * max p``, i.e. scores within ``log(min_p)`` of
    the largest; top-k keeps the k largest logits; top-p then keeps the smallest prefix of the
    sorted distribution whose mass reaches ``top_p`` (the token crossing the threshold is kept).
    Speculative decoding samples the target's rows through this same function, so any filter
    here keeps it lossless.
    """
    scores = logits.float() / temperature
    vocab = scores.shape[-1]
    if min_p > 0.0:
        floor = scores.max(dim=-1, keepdim=True).values + math.log(min_p)
        scores = scores.masked_fill(scores < floor, float("-inf"))
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_rows(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    rows_per_request: int = 1,
    replaced: dict[int, torch.Tensor] | None = None,
    states: dict[int, list[torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Sample one token per row of ``logits [R * rows_per_request, V]`` (any float dtype: greedy
    rows take the argmax as given, sampled rows widen to float32 first) -> ``[R * rows]`` int64.

    Rows are request-major; request ``i`` owns rows ``i*rows .. (i+1)*rows - 1`` and uses its
    own params and generator (``None`` = the global RNG). ``replaced[i]`` ``[rows, V]``: the
    logits request ``i`` samples from instead of its rows (its penalised rows,
    engine/penalties.py). ``states[i]`` (an empty list, for sampled requests with their own
    generator): filled with the generator's state after each of request ``i``'s rows, drawn one
    row at a time (``states[i][j]``: rows ``0..j`` consumed; the verify rewinds to it).
    """
    out = argmax_rows(logits)  # torch.argmax's indices; chunked over the vocabulary on CUDA
    for i, (p, gen) in enumerate(zip(params, generators)):
        rows = slice(i * rows_per_request, (i + 1) * rows_per_request)
        own = replaced.get(i) if replaced else None
        if p.is_greedy:
            if own is not None:
                out[rows] = argmax_rows(own)
            continue
        probs = filtered_probs(logits[rows] if own is None else own, p.temperature, p.top_k, p.top_p,
                               p.min_p)
        noise = torch.empty_like(probs)
        own_states = states.get(i) if states else None
        if own_states is None:
            noise.exponential_(generator=gen)
        else:  # row by row: a row's draw is what a one-row step would draw at that position
            for r in range(noise.shape[0]):
                noise[r].exponential_(generator=gen)
                own_states.append(gen.get_state())
        # a draw of exactly 0 would make a filtered token's 0 / 0 a NaN, which the argmax ranks
        # first: it has probability 0, but nothing else may then pick a filtered token
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        out[rows] = argmax_rows(probs / noise)
    return out


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, n: int) -> list[dict[int, float]]:
    """Per row: ``{token: logprob}`` for the chosen token plus the ``n`` most likely ones.

    Log-probabilities of the raw model distribution (before temperature / top-k / top-p).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    # the engine builds ``tokens`` on the host; gathering with it on a GPU needs it there
    chosen = logp.gather(-1, tokens.to(logp.device).view(-1, 1)).squeeze(-1).tolist()
    result = []
    if n > 0:
        vals, ids = torch.topk(logp, min(n, logp.shape[-1]), dim=-1)
        vals, ids = vals.tolist(), ids.tolist()
    for r, tok in enumerate(tokens.tolist()):
        entry = {int(tok): float(chosen[r])}
        if n > 0:
            for v, t in zip(vals[r], ids[r]):
                entry.setdefault(int(t), float(v))
        result.append(entry)
    return result
