"""Token sampling: greedy, temperature, min-p, top-k, top-p; counter-based noise for seeds.

Sampling uses the exponential race (``argmax(p / E)`` with ``E ~ Exp(1)``), which draws from
``p`` exactly and needs no host sync (no ``torch.multinomial``). It runs on the scores as
``argmax(s - log E)`` over the kept tokens: ``p`` is never normalised.

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

import logging
import math
from collections.abc import Sequence

import torch

from ..config import SamplingParams
from ..kernels.argmax import argmax_rows
from ..kernels.counter_noise import counter_exponential, seed_key
from ..kernels.precompile import launches_build_only
from ..kernels.topk_values import build_ahead_ks, topk_values
from .runner import to_device_async

logger = logging.getLogger(__name__)

# top-k thresholds come from ``torch.topk`` up to this many columns, from a full sort above
TOPK_MAX_COLUMNS = 1024
# top-p's prefix sums and counts over a whole row run in chunks of this many columns
# (:func:`_prefix_sums`, :func:`_row_counts`)
ROW_CHUNK = 1024
# False: one ``cumsum`` / ``sum`` over the whole row (an A/B switch for benchmarks/profile_sampler.py)
chunk_long_rows = True
# True: a row sort over 16-bit logits sorts the logits themselves, then scales
# (:func:`_descending_scores`; the same values, half the key bits). On the H200, top-p over
# V = 100352 bf16: 114 -> 102 us at 1 row, 163 -> 146 at 4, 794 -> 684 at 64 (thirty-fifth
# pass; benchmarks/profile_sampler.py --switch laguna_dflash.engine.sampler:sort_narrow_keys=False)
sort_narrow_keys = True


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                   min_p: float = 0.0) -> torch.Tensor:
    """``logits [N, V]`` -> probabilities ``[N, V]`` float32 after temperature, min-p, top-k,
    top-p (vLLM's order), the same parameters for every row: :func:`filtered_probs_rows`."""
    n = logits.shape[0]
    return filtered_probs_rows(logits, [temperature] * n, [top_k] * n, [top_p] * n, [min_p] * n)


def filtered_probs_rows(logits: torch.Tensor, temperature: Sequence[float], top_k: Sequence[int],
                        top_p: Sequence[float], min_p: Sequence[float]) -> torch.Tensor:
    """``logits [N, V]`` -> the distribution each row samples from, ``[N, V]`` float32: the
    softmax of :func:`filtered_scores`' scores over the tokens it keeps (zeros elsewhere). The
    sampler itself never normalises (its race needs no probabilities); this is the definition
    its picks follow, for tests and callers that want the numbers."""
    scores, threshold = filtered_scores(logits, temperature, top_k, top_p, min_p)
    if threshold is not None:
        scores = scores.masked_fill(scores < threshold, float("-inf"))
    return torch.softmax(scores, dim=-1)


def filtered_scores(logits: torch.Tensor, temperature: Sequence[float], top_k: Sequence[int],
                    top_p: Sequence[float], min_p: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logits [N, V]`` (any float dtype) and each row's parameters (host lists of length N;
    ``top_k`` 0 or >= V, ``top_p`` 1 and ``min_p`` 0 turn a filter off) -> ``(scores [N, V]``
    float32, ``threshold [N, 1]`` float32 or None``)``: row ``n`` keeps exactly the tokens whose
    score is at least its threshold (None: no row filters). In vLLM's order:

    * temperature: ``s = logits * (1 / T)`` (the reciprocal in float32);
    * min-p keeps ``p >= min_p * max p``, i.e. ``s >= max s + log(min_p)``;
    * top-k keeps the scores ``>=`` the k-th largest (ties at it kept);
    * top-p then keeps, of what is left, the tokens at least as likely as the boundary token: the
      first token in descending order whose exclusive prefix mass reaches ``top_p`` of the kept
      mass (the token crossing the threshold is kept, and so are its ties). A row with a top-k of
      at most TOPK_MAX_COLUMNS finds it among its top-k's values (plus the count of ties of the
      k-th outside them), the others in a sort of the row; a batch of both selects per row.

    Every op is row-wise, and the ranked top-p runs at one width (TOPK_MAX_COLUMNS), so a row's
    threshold does not depend on the other rows (a seeded request samples the same alone or
    batched). One launch sequence for the whole batch, each filter only if some row uses it; a
    parameter every row shares is a Python scalar, the varying ones go up in one copy.
    Speculative decoding samples the target's rows through this same function, so any filter
    here keeps it lossless.
    """
    if logits.shape[0] == 0:
        return logits.float(), None  # [0, V]
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else 0 for k in top_k]
    uses_min_p, uses_top_k, uses_top_p = (any(m > 0.0 for m in min_p), any(ks),
                                          any(p < 1.0 for p in top_p))
    # rows whose top-p runs on their own top-k's values (no sort of the row): their nucleus lies
    # among at most TOPK_MAX_COLUMNS ranked values plus the ties of the k-th. The others with
    # top-p sort the row
    ranked_top_p = [0 < k <= TOPK_MAX_COLUMNS and p < 1.0 for k, p in zip(ks, top_p)]
    is_sorted_top_p = not all(r or p >= 1.0 for r, p in zip(ranked_top_p, top_p))
    is_mixed_top_p = any(ranked_top_p) and is_sorted_top_p
    # x * (1 / T) rather than x / T: a multiplier is the same float32 op as a Python scalar
    # and as a column (PyTorch's CUDA division by a host scalar multiplies by its reciprocal,
    # by a column it divides), so a row gets the same bits among equal parameters (scalars)
    # and in a mixed batch (columns). 1 / T is at least float32's smallest normal: a huge T
    # (inf is a valid temperature) would give 1 / T = 0 in float32, and a -inf logit (a token
    # banned by min_tokens) times 0 is NaN, which the race's argmax ranks first: the banned
    # token would always win. At the floor the kept scores are all ~0 (uniform, T's limit)
    # and -inf stays -inf. Every T below ~8.5e37 keeps its own 1 / T.
    inv_temperature, log_min_p, kth_index, no_top_k, top_p_bound, use_ranked = per_row_parameters(
        logits.device,
        [max(1.0 / t, _FLOAT32_TINY) for t in temperature],
        [math.log(m) if m > 0.0 else float("-inf") for m in min_p] if uses_min_p else None,
        [float(max(k - 1, 0)) for k in ks] if uses_top_k else None,
        [float(k == 0) for k in ks] if uses_top_k and not all(ks) else None,
        [p if p < 1.0 else float("inf") for p in top_p] if uses_top_p else None,
        [float(r) for r in ranked_top_p] if is_mixed_top_p else None)
    scores = logits.float() * inv_temperature
    threshold = None  # [N, 1]: the smallest kept score so far
    if uses_min_p:  # min_p 0: log 0 = -inf, no floor
        threshold = scores.amax(dim=-1, keepdim=True) + log_min_p
    ranked = None  # [N, >= max k] descending: the top-k's values, or the sorted row
    if uses_top_k:
        max_k = max(ks)
        if max_k <= TOPK_MAX_COLUMNS:  # torch.topk's values (kernels/topk_values.py: two launches)
            ranked = topk_values(scores, max_k)
        else:
            ranked = _descending_scores(logits, scores, inv_temperature, temperature)
        if isinstance(kth_index, float):
            kth = ranked[:, int(kth_index) : int(kth_index) + 1]
        else:
            kth = ranked.gather(-1, kth_index.long())
        if no_top_k is not None:  # k 0: no threshold
            kth = kth.masked_fill(no_top_k > 0.0, float("-inf"))
        threshold = kth if threshold is None else torch.maximum(threshold, kth)
    if not uses_top_p:
        return scores, threshold
    if is_sorted_top_p:  # a top-p row without a (small) top-k: the whole row, descending
        in_order = ranked if ranked is not None and ranked.shape[-1] == vocab else (
            _descending_scores(logits, scores, inv_temperature, temperature))
        boundary = _top_p_boundary(in_order, threshold, top_p_bound)
        if is_mixed_top_p:
            boundary = torch.where(use_ranked > 0.0, _ranked_top_p_boundary(
                scores, ranked, threshold, top_p_bound), boundary)
    else:
        boundary = _ranked_top_p_boundary(scores, ranked, threshold, top_p_bound)
    if isinstance(top_p_bound, torch.Tensor):
        # a row without top-p (bound +inf) counts every column as "below the bound", so its
        # boundary is its last column's score: the row's minimum on the sorted path, but on the
        # ranked path only the TOPK_MAX_COLUMNS-th largest score, which would cut a row with no
        # top-k (or one above TOPK_MAX_COLUMNS) to the top TOPK_MAX_COLUMNS tokens whenever a
        # batch mate's top-k filled the columns. Such a row has no top-p boundary at all.
        boundary = boundary.masked_fill(top_p_bound == float("inf"), float("-inf"))  # [N, 1]
    return scores, boundary if threshold is None else torch.maximum(threshold, boundary)


_FLOAT32_MAX = torch.finfo(torch.float32).max
_FLOAT32_TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32, ~1.18e-38


def _descending_scores(logits: torch.Tensor, scores: torch.Tensor,
                       inv_temperature: float | torch.Tensor,
                       temperature: Sequence[float]) -> torch.Tensor:
    """Each row of ``scores = logits.float() * inv_temperature`` (``1 / temperature``) in
    descending order, ``[N, V]`` float32. With :data:`sort_narrow_keys`, 16-bit ``logits`` and
    every ``1 / T`` positive and finite in float32 (checked here, only when a row sorts): sort
    the logits, then widen and scale. That gives the same values:
    ``x -> float(x) * c`` with ``c > 0`` is the same float32 op on the same value wherever ``x``
    stands, and it is monotone (widening is exact, rounding a product is monotone), so it maps
    the sorted logits to the sorted scores. Ties (``-0`` against ``0`` among them) compare equal
    either way. A radix sort then moves 16-bit keys, not 32-bit ones."""
    if (sort_narrow_keys and logits.dtype in (torch.bfloat16, torch.float16)
            and all(0.0 < 1.0 / t <= _FLOAT32_MAX for t in temperature)):
        return logits.sort(dim=-1, descending=True).values.float() * inv_temperature
    return scores.sort(dim=-1, descending=True).values


def _top_p_boundary(in_order: torch.Tensor, threshold: torch.Tensor | None,
                    top_p_bound: float | torch.Tensor,
                    num_outside: torch.Tensor | None = None) -> torch.Tensor:
    """The top-p boundary score of each row: ``in_order [N, W]`` float32 descending (the row's
    largest scores, ``-inf`` padding), ``threshold [N, 1]`` the kept scores' floor before top-p
    (None: all kept), ``top_p_bound`` (+inf: no top-p), ``num_outside [N, 1]`` kept tokens not
    in ``in_order`` (all scoring exactly ``threshold``) -> ``[N, 1]``: the first entry whose
    exclusive prefix mass reaches ``top_p`` of the kept mass.

    The mass is unnormalised, ``w = exp(s - max s)`` (the boundary compares ``before <
    top_p * total``), and the prefix sums are monotone under rounding, so the entries below the
    bound are a prefix and its length is a count. A count that reaches past the kept entries
    lands on a dropped one (below ``threshold``), which the caller's maximum with ``threshold``
    overrides: every kept token then stays."""
    weights = torch.exp(in_order - in_order[:, :1])  # the row's maximum is always kept
    if threshold is not None:
        weights = weights.masked_fill(in_order < threshold, 0.0)
    cumulative = _prefix_sums(weights)
    total = cumulative[:, -1:]
    if num_outside is not None:
        total = total + num_outside * torch.exp(threshold - in_order[:, :1])
    num_below = _row_counts((cumulative - weights) < top_p_bound * total).clamp_(min=1)
    return in_order.gather(-1, num_below - 1)


def _prefix_sums(weights: torch.Tensor) -> torch.Tensor:
    """Inclusive prefix sums of ``weights [N, W]`` float32 (non-negative) along each row ->
    ``[N, W]``. Rows longer than two ROW_CHUNK run as chunks: each chunk's own prefix sums,
    plus the sum of the chunks before it. PyTorch scans a few long rows slowly on CUDA (128 us
    for 4 rows of 100352 on the H200, thirty-second pass) and many short rows fast.

    Monotone along the row as one long scan is: inside a chunk, ``offset + s_j`` rounds
    monotonically in ``s_j``; across a chunk's start the sums can step back by no more than the
    rounding of the chunk totals' own scan (a parallel scan of one long row rounds that way
    too). Row-wise: a row's sums do not depend on the other rows."""
    n, w = weights.shape
    if not chunk_long_rows or w <= 2 * ROW_CHUNK:
        return weights.cumsum(-1)
    within = _chunks(weights).cumsum(-1)  # [N, C, CHUNK]
    totals = within[:, :, -1].cumsum(-1)  # [N, C]: the mass up to each chunk's end
    before = torch.nn.functional.pad(totals[:, :-1], (1, 0))  # [N, C]: before each chunk
    return (within + before.unsqueeze(-1)).view(n, -1)[:, :w]


def _row_counts(mask: torch.Tensor) -> torch.Tensor:
    """``mask [N, W]`` bool -> ``[N, 1]`` int64: the true entries of each row (exact). Rows
    longer than two ROW_CHUNK count by chunk, then sum the chunks' counts: PyTorch reduces a
    few long rows on CUDA in 12-17 us a call at one row (thirty-third pass, item 2)."""
    if not chunk_long_rows or mask.shape[1] <= 2 * ROW_CHUNK:
        return mask.sum(-1, keepdim=True)
    return _chunks(mask).sum(-1).sum(-1, keepdim=True)


def _chunks(x: torch.Tensor) -> torch.Tensor:
    """``x [N, W]`` -> ``[N, C, ROW_CHUNK]`` with ``C = ceil(W / ROW_CHUNK)``, padded at the end
    with zeros (False): nothing to a sum or a count."""
    n, w = x.shape
    num_chunks = -(-w // ROW_CHUNK)
    return torch.nn.functional.pad(x, (0, num_chunks * ROW_CHUNK - w)).view(n, num_chunks, ROW_CHUNK)


def _ranked_top_p_boundary(scores: torch.Tensor, ranked: torch.Tensor, threshold: torch.Tensor,
                           top_p_bound: float | torch.Tensor) -> torch.Tensor:
    """:func:`_top_p_boundary` of rows with a top-k of ``k <= TOPK_MAX_COLUMNS``, from their
    top-k's values ``ranked [N, >= k]`` descending (no sort of the row): padded to
    TOPK_MAX_COLUMNS columns, so the prefix sums have one shape whatever the batch's largest k
    (a row's bits do not depend on its batch mates). The k-th's ties outside the columns are
    counted over the row (``threshold [N, 1]``: at least the k-th; kept tokens outside the
    columns all score exactly the k-th, so they add ``count * exp(threshold - max)``)."""
    columns = ranked[:, :TOPK_MAX_COLUMNS]
    columns = torch.nn.functional.pad(columns, (0, TOPK_MAX_COLUMNS - columns.shape[-1]),
                                      value=float("-inf"))
    num_outside = (_row_counts(scores >= threshold) - (columns >= threshold).sum(-1, keepdim=True)).float()
    return _top_p_boundary(columns, threshold, top_p_bound, num_outside)


def build_ahead(num_cols: int, device: torch.device) -> int:
    """Build the Triton kernels that sampled rows of ``num_cols`` columns launch and greedy rows
    do not, so that the first sampled request does not wait for them (0.66 s a variant on average
    on the H200's host: 147 in 97.1 s, twenty-fourth pass): the seeded rows' counter noise,
    the race's argmax over float32 scores (greedy's runs on the logits' dtype) and the top-k
    values kernels of every ``k <= TOPK_MAX_COLUMNS`` (:func:`build_ahead_ks`).
    On a thread pool (:func:`kernels.precompile.launches_build_only`); CUDA only. Only a
    speed-up: an error is logged, and the first sampled request builds what is missing. -> the
    variants submitted (0 when all were built or loaded already)."""
    if device.type != "cuda":
        return 0
    rows = torch.zeros(1, num_cols, dtype=torch.float32, device=device)
    try:
        with launches_build_only() as builds:
            for seeds, positions, out in noise_build_arguments(num_cols, device):
                counter_exponential(seeds, positions, num_cols, device, out=out)
            argmax_rows(rows)
            for k in build_ahead_ks(num_cols, TOPK_MAX_COLUMNS):
                topk_values(rows, k)
    except Exception as e:  # noqa: BLE001 - only a speed-up: the launches still build
        logger.warning("building the sampling kernels ahead failed (the first sampled request "
                       "builds them): %s", e)
        return 0
    return builds.num_submitted


def noise_build_arguments(num_cols: int, device: torch.device | str
                          ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(seeds, positions, out)`` for :func:`counter_exponential` launches that build every
    variant :func:`sample_rows` can launch at ``num_cols`` columns. Triton specialises a
    pointer on its 16-byte alignment: the sampler's seeds and positions are the rows of one
    ``[2, S]`` int64 table (the positions aligned only for even ``S``), and its noise rows start
    after the unseeded rows (aligned for any offset only when ``num_cols % 4 == 0``)."""
    out = []
    for num_rows in (1, 2):
        table = torch.zeros(2, num_rows, dtype=torch.int64, device=device)
        for first_row in (0, 1) if num_cols % 4 else (0,):
            noise = torch.empty(first_row + num_rows, num_cols, dtype=torch.float32, device=device)
            out.append((table[0], table[1], noise[first_row:]))
    return out


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
    scores, threshold = filtered_scores(x, [p.temperature for p in per_row], [p.top_k for p in per_row],
                                        [p.top_p for p in per_row], [p.min_p for p in per_row])
    noise = torch.empty_like(scores)
    num_global = (len(sampled) - len(seeded)) * rows
    if num_global:
        noise[:num_global].exponential_(generator=global_generator)
        # a draw of exactly 0 would make a -inf score's race -inf - log 0 a NaN, which the
        # argmax ranks first (a suppressed token, e.g. EOS under min_tokens); the counter noise
        # is never 0
        noise[:num_global].clamp_(min=torch.finfo(noise.dtype).tiny)
    if seeded:  # each seeded row's key and output position: [2, S * rows], one upload
        keys = [seed_key(params[i].seed) for i in seeded for _ in range(rows)]
        rows_at = [positions[i] + j for i in seeded for j in range(rows)]
        table = to_device_async(torch.tensor([keys, rows_at], dtype=torch.int64), logits.device)
        counter_exponential(table[0], table[1], noise.shape[-1], logits.device, out=noise[num_global:])
    # argmax p / E = argmax s - log E (p = exp(s) / Z): no normalisation; the filtered tokens
    # are -inf whatever their noise
    dropped = None if threshold is None else scores < threshold
    race = scores.sub_(noise.log_())  # [R', V] in place: scores are not read again
    if dropped is not None:
        race.masked_fill_(dropped, float("-inf"))
    picks = argmax_rows(race)
    if in_order:
        return picks
    return out.index_copy_(0, row_index, picks)


class Logprob(float):
    """A token's log-probability: a ``float`` (so ``entry[token]`` is the number) carrying
    vLLM's ``Logprob`` fields: ``logprob`` (the same value), ``rank`` (1 = the most likely token;
    a token tied with it counts as ahead, as vLLM's ``>=`` count) and ``decoded_token`` (its text;
    None where nothing decoded it: the engine and the server leave it None, ``LLM`` fills it)."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None):
        value = super().__new__(cls, logprob)
        value.rank, value.decoded_token = rank, decoded_token
        return value

    @property
    def logprob(self) -> float:
        return float(self)

    __str__ = float.__repr__  # str() and f"{x}" print the number, as for a float

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"

    def __reduce__(self):  # pickles (tensor-parallel ranks, multiprocessing) with its fields
        return (Logprob, (float(self), self.rank, self.decoded_token))


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                 n: int | Sequence[int]) -> list[dict[int, Logprob]]:
    """Per row of ``logits [N, V]``: ``{token: logprob}`` for the chosen token ``tokens [N]``
    plus the ``n`` most likely ones (``n``: one count for every row, or one a row), as
    :class:`Logprob` values with their ``rank`` (the top ones 1..n in order).

    Log-probabilities of the raw model distribution (before temperature / top-k / top-p). All
    rows in one pass and one device-to-host copy (``[N, 2 + 2 max n]`` float32: the chosen
    logprob, its rank, the top values, the top ids, exact below 2^24), however many requests
    they hold.
    """
    counts = [min(c, logits.shape[-1]) for c in ([n] * logits.shape[0] if isinstance(n, int) else n)]
    max_n = max(counts, default=0)
    logp = torch.log_softmax(logits.float(), dim=-1)
    # the engine builds ``tokens`` on the host; gathering with it on a GPU needs it there
    chosen = logp.gather(-1, to_device_async(tokens, logp.device).view(-1, 1))
    # rank = #{v : logp_v >= logp_chosen} (vLLM's count: 1 for the argmax; ties count as ahead)
    parts = [chosen, (logp >= chosen).sum(-1, keepdim=True).float()]
    if max_n > 0:
        # one top-k per distinct count: which of tied tokens a row reports depends on k, so a
        # row's entries must not depend on the counts its batch mates asked for
        if set(counts) == {max_n}:  # one count for every row (batch 1 always): one top-k, no buffers
            top = torch.topk(logp, max_n, dim=-1)
            return _logprob_entries(torch.cat([*parts, top.values, top.indices.float()], dim=1),
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
                     max_n: int) -> list[dict[int, Logprob]]:
    """``table [N, 2 + 2 max_n]`` (chosen logprob and rank, top values, top ids as floats),
    brought to the host in one copy -> one ``{token: Logprob}`` dict a row, the chosen token
    first, then ``counts[r]`` top entries (ranks 1..) not already there."""
    result = []
    for row, tok, count in zip(table.tolist(), tokens.tolist(), counts):
        entry = {int(tok): Logprob(row[0], int(row[1]))}
        for rank, (v, t) in enumerate(zip(row[2 : 2 + count], row[2 + max_n : 2 + max_n + count]), 1):
            if int(t) not in entry:
                entry[int(t)] = Logprob(v, rank)
        result.append(entry)
    return result
