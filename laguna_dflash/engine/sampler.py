"""Token sampling: greedy, temperature, min-p, top-k, top-p; counter-based noise for seeds.

Sampling uses the exponential race (``argmax(p / E)`` with ``E ~ Exp(1)``), which draws from
``p`` exactly and needs no host sync (no ``torch.multinomial``).

Unseeded requests draw ``E`` from the engine's generator, every unseeded row of a step in one
``exponential_`` call. A seeded request's ``E`` at output position ``pos`` (0: its first
generated token) and column ``v`` is a pure function of ``(seed, pos, v)``: Philox4x32-10
counter-based noise (kernels/counter_noise.py), every seeded row of a step in one launch. A
request's rows take consecutive positions (a verify's row ``j`` is position
``num_output_tokens + j``), so an output position gets the same noise whatever the step kind
(prefill, target-only decode, a verify of any K, the recompute after a preemption), whichever
rows the verify accepted, whatever the batch and whatever the device: there is no generator state
to advance or rewind. A seed therefore gives the same tokens (given the same logits) with or
without speculation, at any K (adaptive K picks it from step timings), acceptance, and under
preemption.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..config import SamplingParams
from ..kernels.argmax import argmax_rows
from ..kernels.counter_noise import counter_exponential, seed_key
from .runner import to_device_async

# top-k thresholds come from ``torch.topk`` up to this many columns, from a full sort above
TOPK_MAX_COLUMNS = 1024
# the top-k in two stages (:func:`topk_rows`): over chunks of this many columns, then over the
# chunks' winners, on the device types listed (benchmarks/profile_sampler.py times both forms;
# on the CPU the one-stage torch.topk is ~4x faster at V = 100352)
TOPK_CHUNK_COLUMNS = 1024
two_stage_topk_devices: frozenset[str] = frozenset()


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                   min_p: float = 0.0) -> torch.Tensor:
    """``logits [N, V]`` -> probabilities ``[N, V]`` float32 after temperature, min-p, top-k,
    top-p (vLLM's order), the same parameters for every row: :func:`filtered_probs_rows`."""
    n = logits.shape[0]
    return filtered_probs_rows(logits, [temperature] * n, [top_k] * n, [top_p] * n, [min_p] * n)


def filtered_probs_rows(logits: torch.Tensor, temperature: Sequence[float], top_k: Sequence[int],
                        top_p: Sequence[float], min_p: Sequence[float]) -> torch.Tensor:
    """``logits [N, V]`` (any float dtype) -> probabilities ``[N, V]`` float32, row ``n``
    filtered by its own parameters (host lists of length N; ``top_k`` 0 or >= V, ``top_p`` 1 and
    ``min_p`` 0 turn a filter off), in vLLM's order:

    * temperature: ``s = logits * (1 / T)`` (the reciprocal in float32);
    * min-p keeps the tokens with ``p >= min_p * max p``, i.e. ``s >= max s + log(min_p)``;
    * top-k keeps the scores ``>=`` the k-th largest (ties at it kept);
    * top-p then keeps the smallest prefix of the sorted distribution whose mass reaches
      ``top_p`` (the token crossing the threshold is kept) and renormalises. A row with a top-k
      of at most TOPK_MAX_COLUMNS takes its nucleus from its top-k's ranked tokens, no sort of
      the row (:func:`_ranked_top_p`), and keeps every tie of the boundary token; the full sort
      keeps the ties it ranks first.

    One launch sequence for the whole batch, each filter only if some row uses it; a parameter
    every row shares is a Python scalar, the varying ones go up in one copy. Every op is
    row-wise, so a row's probabilities do not depend on the other rows (a seeded request samples
    the same alone or batched); a filter a row does not use leaves its values untouched.
    Speculative decoding samples the target's rows through this same function, so any filter
    here keeps it lossless.
    """
    if logits.shape[0] == 0:
        return logits.float()  # [0, V]
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else 0 for k in top_k]
    uses_min_p, uses_top_k, uses_top_p = (any(m > 0.0 for m in min_p), any(ks),
                                          any(p < 1.0 for p in top_p))
    # rows whose top-p runs on their own top-k's ranked tokens (no full sort): their k is at most
    # TOPK_MAX_COLUMNS, so the nucleus lies among at most that many ranked tokens plus the ties
    # of the k-th. The others with top-p sort the row; a batch of both selects per row
    ranked_top_p = [0 < k <= TOPK_MAX_COLUMNS and p < 1.0 for k, p in zip(ks, top_p)]
    is_sorted_top_p = not all(r or p >= 1.0 for r, p in zip(ranked_top_p, top_p))
    is_mixed_top_p = any(ranked_top_p) and is_sorted_top_p
    # x * (1 / T) rather than x / T: a multiplier is the same float32 op as a Python scalar
    # and as a column (PyTorch's CUDA division by a host scalar multiplies by its reciprocal,
    # by a column it divides), so a row gets the same bits among equal parameters (scalars)
    # and in a mixed batch (columns)
    inv_temperature, log_min_p, kth_index, no_top_k, top_p_bound, use_ranked = per_row_parameters(
        logits.device,
        [1.0 / t for t in temperature],
        [math.log(m) if m > 0.0 else float("-inf") for m in min_p] if uses_min_p else None,
        [float(max(k - 1, 0)) for k in ks] if uses_top_k else None,
        [float(k == 0) for k in ks] if uses_top_k and not all(ks) else None,
        [p if p < 1.0 else float("inf") for p in top_p] if uses_top_p else None,
        [float(r) for r in ranked_top_p] if is_mixed_top_p else None)
    scores = logits.float() * inv_temperature
    if uses_min_p:  # min_p 0: log 0 = -inf, no score below the floor
        floor = scores.amax(dim=-1, keepdim=True) + log_min_p
        scores = scores.masked_fill(scores < floor, float("-inf"))
    if uses_top_k:
        max_k = max(ks)
        # [N, >= max_k] descending, with the token ids where a ranked top-p needs them
        if max_k <= TOPK_MAX_COLUMNS:
            ranked, ranked_ids = topk_rows(scores, max_k)
        elif any(ranked_top_p):
            ranked, ranked_ids = scores.sort(dim=-1, descending=True)
        else:
            ranked, ranked_ids = scores.sort(dim=-1, descending=True).values, None
        if isinstance(kth_index, float):
            kth = ranked[:, int(kth_index) : int(kth_index) + 1]
        else:
            kth = ranked.gather(-1, kth_index.long())
        if no_top_k is not None:  # k 0: no threshold
            kth = kth.masked_fill(no_top_k > 0.0, float("-inf"))
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if not uses_top_p:
        return probs
    if is_sorted_top_p:  # a top-p row without a (small) top-k; bound +inf: nothing dropped
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p_bound  # the mass before a token
        kept = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        if is_mixed_top_p:
            kept = torch.where(use_ranked > 0.0, _ranked_top_p(probs, ranked_ids, top_p_bound), kept)
    else:
        kept = _ranked_top_p(probs, ranked_ids, top_p_bound)
    kept = kept / kept.sum(-1, keepdim=True)
    return kept if all(p < 1.0 for p in top_p) else torch.where(top_p_bound < 1.0, kept, probs)


def topk_rows(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores [N, V]`` float32 -> the ``k`` largest of each row, ``(values [N, k]`` descending,
    ``ids [N, k]`` int64``)``: ``torch.topk``'s values bit for bit (they are copies of entries).
    Which of several tied entries an id names may differ from ``torch.topk``'s, and no caller
    reads it: the top-k threshold is a value, and the ranked top-p gathers tied ids' equal
    probabilities. Hence a row's bits do not depend on which form ran.

    On a device type in ``two_stage_topk_devices`` (and with ``V`` a multiple of
    TOPK_CHUNK_COLUMNS, above it, ``k`` at most it): the top ``k`` of each chunk of
    TOPK_CHUNK_COLUMNS columns, then the top ``k`` of those ``V / chunk * k`` candidates. A row's top ``k`` are among its chunks' top ``k`` (an entry
    that is not in its chunk's top k has k larger ones). One long row is then many short slices
    (Laguna's 100352 = 98 x 1024), not one slice for the device to split.
    """
    n, vocab = scores.shape
    chunk = TOPK_CHUNK_COLUMNS
    if scores.device.type not in two_stage_topk_devices or vocab % chunk or vocab <= chunk or k > chunk:
        return torch.topk(scores, k, dim=-1)
    local, local_ids = torch.topk(scores.reshape(n, vocab // chunk, chunk), k, dim=-1)  # [N, V / chunk, k]
    local_ids = local_ids + torch.arange(0, vocab, chunk, device=scores.device).view(1, -1, 1)
    values, where = torch.topk(local.reshape(n, -1), k, dim=-1)
    return values, local_ids.reshape(n, -1).gather(-1, where)


def _ranked_top_p(probs: torch.Tensor, ranked_ids: torch.Tensor, top_p_bound: float | torch.Tensor) -> torch.Tensor:
    """Top-p of rows filtered by a top-k of ``k <= TOPK_MAX_COLUMNS`` from their ranked tokens,
    without sorting the row: ``probs [N, V]`` float32 (after top-k: the ranked tokens, the ties
    of the k-th, zeros), ``ranked_ids [N, >= k]`` the top-k's token ids in descending order ->
    ``[N, V]`` float32, not renormalised: the tokens at least as likely as the boundary token
    (the first ranked token whose exclusive prefix mass reaches ``top_p``'s, or the k-th),
    ties of it included, and zeros elsewhere.

    The ranked probabilities are padded to TOPK_MAX_COLUMNS columns, so the prefix sums have one
    shape whatever the batch's largest k (a row's bits do not depend on its batch mates); the
    ids of tied scores may differ between ``torch.topk`` and a sort, their probabilities do not.
    """
    width = min(ranked_ids.shape[1], TOPK_MAX_COLUMNS)
    ranked_p = probs.gather(-1, ranked_ids[:, :width])  # [N, width], descending
    ranked_p = torch.nn.functional.pad(ranked_p, (0, TOPK_MAX_COLUMNS - width))
    # exclusive prefix sums, non-decreasing (monotone rounding): the ranked tokens below the bound
    # are a prefix, its length the count. A count past the row's k lands on a tie of the k-th
    # (the same probability) or on a token the top-k dropped (0): either way every token the
    # top-k kept stays
    before = torch.nn.functional.pad(ranked_p.cumsum(-1)[:, :-1], (1, 0))
    num_kept = (before < top_p_bound).sum(-1, keepdim=True).clamp_(min=1)  # [N, 1] int64
    tau = ranked_p.gather(-1, num_kept - 1)
    return probs.masked_fill(probs < tau, 0.0)


def per_row_parameters(device: torch.device,
                        *values: list[float] | None) -> list[float | torch.Tensor | None]:
    """Each list of per-row values -> a Python float when every row has the same value (no
    upload), else a ``[N, 1]`` float32 column on ``device``; the columns go up in ONE copy.
    ``None`` (a filter no row uses) stays ``None``."""
    varying = [v for v in values if v is not None and any(x != v[0] for x in v)]
    columns = iter(to_device_async(torch.tensor(varying, dtype=torch.float32), device)
                   .view(len(varying), -1, 1).unbind(0) if varying else ())
    return [None if v is None else next(columns) if any(x != v[0] for x in v) else v[0]
            for v in values]


def sample_rows(
    logits: torch.Tensor,
    params: list[SamplingParams],
    positions: Sequence[int] | None = None,
    rows_per_request: int = 1,
    replaced: dict[int, torch.Tensor] | None = None,
    global_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample one token per row of ``logits [R * rows_per_request, V]`` (any float dtype: greedy
    rows take the argmax as given, sampled rows widen to float32 first) -> ``[R * rows]`` int64.

    Rows are request-major; request ``i`` owns rows ``i*rows .. (i+1)*rows - 1`` and uses its
    own params. ``replaced[i]`` ``[rows, V]``: the logits request ``i`` samples from instead of
    its rows (its penalised rows, engine/penalties.py).

    Noise: a sampled request with ``params[i].seed`` set takes the counter-based noise of its
    seed at output positions ``positions[i], positions[i] + 1, ..`` for its rows
    (``positions[i]``: the tokens it generated before this step; required when a sampled
    request has a seed); the others draw from ``global_generator`` (the engine's; torch's
    default when None).

    The sampled rows of all requests are filtered and raced in one batch (a fixed number of
    launches, not a number per request): the unseeded rows' noise is one ``exponential_`` call,
    the seeded rows' one :func:`counter_exponential` launch (their seeds and positions go up in
    one copy).
    """
    rows = rows_per_request
    replaced = replaced or {}
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    if len(sampled) == len(params) and not replaced:
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    else:  # torch.argmax's indices; chunked over the vocabulary on CUDA
        out = argmax_rows(logits)
        for i, own in replaced.items():
            if params[i].is_greedy:
                out[i * rows : (i + 1) * rows] = argmax_rows(own)
    if not sampled:
        return out
    # the global-RNG requests first: their rows' noise is one contiguous draw, the seeded
    # requests' rows one contiguous block of counter noise after it
    sampled.sort(key=lambda i: params[i].seed is not None)
    seeded = [i for i in sampled if params[i].seed is not None]
    if seeded and positions is None:
        raise ValueError("sample_rows: seeded requests need their output positions")
    row_ids = [i * rows + j for i in sampled for j in range(rows)]
    in_order = sampled == list(range(len(params)))  # every request samples, none seeded first
    row_index = None if in_order else to_device_async(torch.tensor(row_ids), logits.device)
    if any(i in replaced for i in sampled):
        x = torch.cat([replaced[i] if i in replaced else logits[i * rows : (i + 1) * rows] for i in sampled])
    else:
        x = logits if in_order else logits.index_select(0, row_index)
    per_row = [params[i] for i in sampled for _ in range(rows)]
    probs = filtered_probs_rows(x, [p.temperature for p in per_row], [p.top_k for p in per_row],
                                [p.top_p for p in per_row], [p.min_p for p in per_row])
    noise = torch.empty_like(probs)
    num_global = (len(sampled) - len(seeded)) * rows
    if num_global:
        noise[:num_global].exponential_(generator=global_generator)
        # a draw of exactly 0 would make a filtered token's 0 / 0 a NaN, which the argmax ranks
        # first: it has probability 0, but nothing else may then pick a filtered token (the
        # counter noise is never 0)
        noise[:num_global].clamp_(min=torch.finfo(noise.dtype).tiny)
    if seeded:  # each seeded row's key and output position: [2, S * rows], one upload
        keys = [seed_key(params[i].seed) for i in seeded for _ in range(rows)]
        rows_at = [positions[i] + j for i in seeded for j in range(rows)]
        table = to_device_async(torch.tensor([keys, rows_at], dtype=torch.int64), logits.device)
        counter_exponential(table[0], table[1], noise.shape[-1], logits.device, out=noise[num_global:])
    picks = argmax_rows(probs / noise)
    if in_order:
        return picks
    return out.index_copy_(0, row_index, picks)


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                 n: int | Sequence[int]) -> list[dict[int, float]]:
    """Per row of ``logits [N, V]``: ``{token: logprob}`` for the chosen token ``tokens [N]``
    plus the ``n`` most likely ones (``n``: one count for every row, or one a row).

    Log-probabilities of the raw model distribution (before temperature / top-k / top-p). All
    rows in one pass and one device-to-host copy (``[N, 1 + 2 max n]`` float32: the chosen
    logprob, the top values, the top ids, exact below 2^24), however many requests they hold.
    """
    counts = [min(c, logits.shape[-1]) for c in ([n] * logits.shape[0] if isinstance(n, int) else n)]
    max_n = max(counts, default=0)
    logp = torch.log_softmax(logits.float(), dim=-1)
    # the engine builds ``tokens`` on the host; gathering with it on a GPU needs it there
    parts = [logp.gather(-1, to_device_async(tokens, logp.device).view(-1, 1))]
    if max_n > 0:
        # one top-k per distinct count: which of tied tokens a row reports depends on k, so a
        # row's entries must not depend on the counts its batch mates asked for
        if set(counts) == {max_n}:  # one count for every row (batch 1 always): one top-k, no buffers
            top = torch.topk(logp, max_n, dim=-1)
            return _logprob_entries(torch.cat([parts[0], top.values, top.indices.float()], dim=1),
                                    tokens, counts, max_n)
        vals = torch.zeros(logp.shape[0], max_n, device=logp.device)
        ids = torch.zeros(logp.shape[0], max_n, device=logp.device)
        for count in sorted(set(counts) - {0}):
            index = to_device_async(torch.tensor([r for r, c in enumerate(counts) if c == count]), logp.device)
            top = torch.topk(logp.index_select(0, index), count, dim=-1)
            vals[index, :count], ids[index, :count] = top.values, top.indices.float()
        parts += [vals, ids]
    return _logprob_entries(torch.cat(parts, dim=1), tokens, counts, max_n)


def _logprob_entries(table: torch.Tensor, tokens: torch.Tensor, counts: list[int],
                     max_n: int) -> list[dict[int, float]]:
    """``table [N, 1 + 2 max_n]`` (chosen logprob, top values, top ids as floats), brought to the
    host in one copy -> one ``{token: logprob}`` dict a row, ``counts[r]`` top entries each."""
    result = []
    for row, tok, count in zip(table.tolist(), tokens.tolist(), counts):
        entry = {int(tok): row[0]}
        for v, t in zip(row[1 : 1 + count], row[1 + max_n : 1 + max_n + count]):
            entry.setdefault(int(t), v)
        result.append(entry)
    return result
