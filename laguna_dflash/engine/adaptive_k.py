"""Adaptive number of draft tokens: pick K per step from measured acceptance and step cost.

A step with K drafts emits, in expectation, ``1 + sum_{k<=K} r_k`` tokens, where ``r_k`` is the
per-position acceptance rate (fraction of drafts whose first k tokens were all accepted, the
quantity ``num_accepted_tokens_per_pos / num_drafts`` measures). It costs ``t(K)`` seconds,
measured on this engine (K = 0 is plain target-only decoding). The policy picks
``argmax_K (1 + sum_{k<=K} r_k) / t(K)``, so speculation is used only where it pays: with a weak
drafter, or a MoE target whose verify touches many experts, it falls back towards K = 0 and is
never much slower than target-only decoding. Changing K never changes the output: acceptance is
still exact.

Measuring. The first step of each power-of-two batch bucket drafts the full ``max_k`` block and
the second is a plain decode, so every K has a cost (measured, or interpolated between measured
K) and every position a rate. Rates are bias-corrected moving averages: the first observation of
a position replaces the prior, the n-th has weight ``max(ema, 1/n)``, and a position's
observation count decays by ``1 - ema`` for each step that did not draft it, so a rate last seen
long ago (a position only explorations reach) is replaced, not nudged, by a fresh observation.
Step times are averages too, robust to the one-off slow steps a CUDA-graph capture causes (the
first step at a new K, batch or key bucket): see ``_observe_time``. What keeps a wrong estimate
from locking the policy onto a bad K is in the class docstring.

Levels. The policy chooses K only among :func:`draft_levels` (0, 1, 3, 7, ... below ``max_k``,
and ``max_k``): each K is its own verify and drafter-block shape, so a K first chosen while
serving would stall that step for its CUDA-graph captures (one per batch size and key bucket,
tenths of a second to seconds each). The engine's warm-up drafts once at every level, so the
start-up capture covers them all (``LLMEngine.warmup``).

Exploring. Every ``explore_every`` steps the policy drafts one level above its current choice
``b``: ``K = min(max_k, 2 b + 1)`` (0 -> 1 -> 3 -> 7 -> 15), which measures the rates just above
``b`` and the step cost there. If longer drafts pay, the choice grows and the next exploration
reaches further. Exploration backs off while it changes nothing: an exploration after which the
best K is the one chosen before it doubles the interval, up to ``max_explore_every``; one that
changes the choice resets it, so a climb 3 -> 7 -> 15 takes one long interval and then short
ones. The price is reaction time: a change in the traffic that only longer drafts would reveal is
noticed within ``max_explore_every`` steps (a drop in acceptance shows at once, in the positions
every step drafts).

Why (measured on an H200 at Laguna-XS-2.1 size, 128-token generations, BEFORE this scheme; a
full-K step costs ~3.5x a plain decode step there, ``t(K) ~ 1 + 0.17 K`` decode steps at
batch 1): the previous policy started every rate at an optimistic 1.0 moved by an EMA of 0.1,
so with drafts never accepted it spent ~17 full-K steps before it stopped drafting, and every
exploration drafted the full ``max_k``. Against the best fixed K it reached, at batch 1, 0.94x
target-only vs 0.98x (K = 0) with no draft ever accepted and 1.79x vs 2.01x (K = 3) at
acceptance length 4; at batch 16 and length 4, 1.35x vs 1.41x. Now the first observation
settles a rate and exploring while K = 0 is best costs ~1.2x a decode step instead of 3.5x
(tests/test_engine_units.py::test_adaptive_k_simulated_time_is_close_to_the_best_fixed_k
simulates the cost model above: 1024 tokens within 0.4% / 1.5% of the best fixed K at acceptance
length 1 / 4, against 5.7% / 6.6% before). Where acceptance is random (geometric), a batch-1
step observes one request, so the rates are noisy: the same simulation over 4096 tokens and five
seeds puts the policy 0-5% behind the best fixed K at a per-draft acceptance of 0.5 and 3-6% at
0.75 (before this change: 2-6% and 5-7%).
"""

from __future__ import annotations

from bisect import insort


def draft_levels(max_k: int) -> tuple[int, ...]:
    """The K adaptive K may choose: 0, then ``2 b + 1`` from each level ``b`` below ``max_k``,
    and ``max_k`` (``max_k`` 15: 0, 1, 3, 7, 15; ``max_k`` 5: 0, 1, 3, 5)."""
    levels = [0]
    while levels[-1] < max_k:
        levels.append(min(max_k, 2 * levels[-1] + 1))
    return tuple(levels)


def batch_bucket(batch_size: int) -> int:
    """Step costs are kept per power-of-two batch size (cost ratios change with batch)."""
    return 1 << max(0, (batch_size - 1).bit_length())


class AdaptiveK:
    """Per-step K from measured acceptance and step cost (see the module docstring).

    Estimates can be wrong in two directions, and only one of them is dangerous:

    * Optimistic (a K looks better than it is: a stale high rate, an interpolated cost that is
      too low) corrects itself: choosing K drafts positions 1..K and times a K-step, exactly the
      quantities that made K look good, so the next ``best_k`` sees the truth (a few steps).
    * Pessimistic (a K looks worse than it is) persists as long as K is not run, so every
      source of it is bounded: costs are made non-decreasing in K from above (``_points``), a
      first step time at a new K does not count until a second one confirms it, a K = 0 time
      that a drafting step undercuts is measured again (``choose``), an observation can raise
      a step time by at most ``ema * (max_jump - 1)``, the level above the choice is re-measured
      by every exploration, and a rate not drafted for a while is replaced by its next
      observation (time-decayed counts, ``_observe_rates``). So a K that pays is found within
      one exploration interval per level, and no single slow or unlucky step locks it out.
    """

    def __init__(self, max_k: int, explore_every: int = 16, ema: float = 0.1,
                 max_explore_every: int = 256, max_jump: float = 2.0) -> None:
        self.max_k = max_k
        self.levels = draft_levels(max_k)
        self.explore_every = explore_every
        self.max_explore_every = max(max_explore_every, explore_every)
        self.ema = ema
        self.max_jump = max_jump  # a step-time observation counts as at most this x the estimate
        self.rates = [1.0] * max_k  # prior only: the first observation of a position replaces it
        self._rate_n = [0.0] * max_k  # effective observation count per position (<= 1 / ema)
        self._rate_seen = [0] * max_k  # observed-step index of each position's last observation
        self.step_time: dict[tuple[int, int], float] = {}  # (K, batch bucket) -> seconds
        self._time_n: dict[tuple[int, int], int] = {}  # (K, batch bucket) -> observations
        self._usable: dict[int, list[int]] = {}  # bucket -> sorted K whose step time counts
        self._best: dict[int, int] = {}  # bucket -> best K; cleared by every observe()
        self.num_steps = 0
        self._num_observed = 0
        self.explore_interval = explore_every  # current; backs off while the best K stays
        self.steps_since_explore = 0
        self.num_explorations = 0
        self._exploring_bucket: int | None = None  # set by choose() for an exploration step
        self._best_before_exploring = 0  # the choice the exploration step interrupted

    # ---- estimates ---------------------------------------------------------------------------

    def expected_tokens(self, k: int) -> float:
        """``1 + sum_{j<=k} r_j`` with each rate capped by the rates before it (``_best_of``)."""
        total, cap = 1.0, 1.0
        for r in self.rates[:k]:
            cap = min(cap, r)
            total += cap
        return total

    def _points(self, bucket: int) -> tuple[list[int], list[float]]:
        """Measured K (sorted) and their step times, made non-decreasing in K from above.

        Drafting more never makes a step cheaper, so the true ``t`` is non-decreasing in K, and
        timing noise is one-sided (captures, allocator, host hiccups only ever add time). Hence
        ``min_{K' >= K} t_meas(K')`` is still an upper bound on ``t(K)`` and at least as
        accurate as ``t_meas(K)``. This matters for the K nobody runs any more: a K = 0 time
        measured once while a decode graph was being captured would otherwise make target-only
        decoding look expensive for good, and the policy would keep drafting at zero acceptance.
        With ``t`` non-decreasing and ``expected_tokens`` non-decreasing, a K whose extra
        positions add no tokens never beats a smaller one (ties keep the smaller K).
        """
        ks = self._usable.get(bucket, [])
        ts = [self.step_time[(k, bucket)] for k in ks]
        for i in range(len(ts) - 2, -1, -1):
            if ts[i] > ts[i + 1]:
                ts[i] = ts[i + 1]
        return ks, ts

    def cost(self, k: int, bucket: int) -> float | None:
        """Seconds per step at K: measured (see ``_points``), or linear between the measured K
        around it; None outside the measured range."""
        ks, ts = self._points(bucket)
        for i, x in enumerate(ks):
            if x == k:
                return ts[i]
            if x > k:
                if i == 0:
                    return None
                a = ks[i - 1]
                return ts[i - 1] + (ts[i] - ts[i - 1]) * (k - a) / (x - a)
        return None

    def best_k(self, bucket: int) -> int:
        """``argmax_K`` expected tokens per second at this batch bucket (0 without a K = 0 cost).
        Computed once per observed step and cached until the next ``observe``."""
        best = self._best.get(bucket)
        if best is None:
            best = self._best[bucket] = self._best_of(bucket)
        return best

    def _best_of(self, bucket: int) -> int:
        """The argmax over the levels (:func:`draft_levels`) in one pass over K = 0..max_k.

        Rates: the true ``r_k`` is non-increasing in k (accepting k+1 drafts needs the first
        k), but the estimates need not be, because positions are refreshed at different times:
        a position past what recent steps drafted may hold a high rate from the bucket's first
        full-K step. Each rate is therefore capped by the rates before it, which are fresher
        (drafted at least as often) and are upper bounds of it. Whatever optimism is left is
        the self-correcting kind (see the class docstring).

        Costs: only measured K and linear interpolation between them (``cost``); with the
        full-K block measured first in every bucket there is no extrapolation. Only levels are
        ever run, so interpolation fills in a level not measured yet (the true curve has steps,
        e.g. at GEMM tiles); the level above the choice is measured by every exploration (from
        its second one on, see ``_observe_time``), and a cost too low is the self-correcting
        kind.
        """
        ks, ts = self._points(bucket)
        if not ks or ks[0] != 0:
            return 0  # K = 0 not measured yet in this bucket
        best, best_rate = 0, 1.0 / ts[0]
        tokens, cap, seg = 1.0, 1.0, 0
        rates, levels = self.rates, self.levels
        for k in range(1, ks[-1] + 1):
            r = rates[k - 1]
            if r < cap:
                cap = r
            if cap <= 0.0:
                break  # no more tokens from longer drafts, and costs do not decrease
            tokens += cap
            if k not in levels:
                continue
            while ks[seg + 1] < k:
                seg += 1
            a, b = ks[seg], ks[seg + 1]
            t = ts[seg] + (ts[seg + 1] - ts[seg]) * (k - a) / (b - a)
            if tokens > best_rate * t:
                best, best_rate = k, tokens / t
        return best

    # ---- policy ------------------------------------------------------------------------------

    def choose(self, batch_size: int) -> int:
        """K for the next step of ``batch_size`` requests (0 = target-only decode)."""
        self.num_steps += 1
        self.steps_since_explore += 1
        bucket = batch_bucket(batch_size)
        if (self.max_k, bucket) not in self.step_time:
            return self.max_k  # measure every position and the full-block cost once
        n0 = self._time_n.get((0, bucket))
        if n0 is None:
            return 0  # measure plain decode once
        best = self.best_k(bucket)
        if n0 == 1 and best and self.step_time[(0, bucket)] > self.cost(best, bucket):
            # The one K = 0 time exceeds a drafting step's: it caught a graph capture. _points
            # caps it at t(best), which only makes K = 0 tie with ``best``, and near-zero
            # acceptance would keep drafting on that tie; one more decode step settles it.
            return 0
        if self.steps_since_explore >= self.explore_interval:
            self.steps_since_explore = 0
            self.num_explorations += 1
            self._exploring_bucket = bucket
            self._best_before_exploring = best
            return min(self.max_k, 2 * best + 1)  # one level up (at max_k: the choice itself)
        return best

    def expects_target_only(self, batch_size: int) -> bool:
        """Whether the next :meth:`choose` for ``batch_size`` requests is expected to return 0,
        from the state before this step's :meth:`observe` (no side effects): K = 0 is the best
        choice now and no measurement or exploration is due. The engine queues a target-only
        forward ahead only then (a wrong guess wastes that forward, nothing else)."""
        bucket = batch_bucket(batch_size)
        if (self.max_k, bucket) not in self.step_time or self._time_n.get((0, bucket)) is None:
            return False
        if self.steps_since_explore + 1 >= self.explore_interval:
            return False
        return self.best_k(bucket) == 0

    def observe(self, k: int, batch_size: int, accepted: list[int], seconds: float) -> None:
        """After a step at K: each request's accepted-draft count and the step's wall time."""
        self._num_observed += 1
        bucket = batch_bucket(batch_size)
        self._observe_time(k, bucket, seconds)
        if k and accepted:
            self._observe_rates(k, accepted)
        self._best.clear()  # rates are shared by all buckets
        bucket_explored = self._exploring_bucket
        if bucket_explored is not None:  # the outcome of an exploration step: back off or reset
            self._exploring_bucket = None
            if self.best_k(bucket_explored) == self._best_before_exploring:
                self.explore_interval = min(2 * self.explore_interval, self.max_explore_every)
            else:
                self.explore_interval = self.explore_every
        self.best_k(bucket)  # computed here, once; choose() reads the cache

    def _observe_time(self, k: int, bucket: int, seconds: float) -> None:
        """Step times: the first step at a new (K, bucket) often includes a CUDA-graph capture
        (eager warm-up runs and the capture: several times a replayed step). So it only counts where
        nothing else would (K = 0 and the full K, which anchor the interpolation); any other K
        keeps its interpolated cost until a second step confirms it. The estimate after two
        steps is the smaller one (noise only adds time), then a bias-corrected mean (weight
        ``max(ema, 1/(n-1))``) of observations capped at ``max_jump`` x the estimate, so a
        capture at a key-length boundary later on moves it by at most ``ema * (max_jump - 1)``
        (10%) instead of making the K look several times slower and locking it out."""
        key = (k, bucket)
        n = self._time_n.get(key, 0) + 1
        self._time_n[key] = n
        prev = self.step_time.get(key)
        if prev is None:
            self.step_time[key] = seconds
        elif n == 2:
            self.step_time[key] = min(prev, seconds)
        else:
            w = max(self.ema, 1.0 / (n - 1))
            self.step_time[key] = prev + w * (min(seconds, self.max_jump * prev) - prev)
        usable = self._usable.setdefault(bucket, [])
        if k not in usable and (n >= 2 or k == 0 or k == self.max_k):
            insort(usable, k)

    def _observe_rates(self, k: int, accepted: list[int]) -> None:
        """Per position p < K: the fraction of requests that accepted more than p drafts.

        Weight ``1/n`` with ``n`` the position's observation count capped at ``1/ema`` (the
        bias-corrected EMA: the first observation replaces the prior, then a running mean until
        the weight reaches ``ema``). ``n`` decays by ``1 - ema`` per observed step that did not
        draft the position: the weight an every-step EMA gives a value that old. Positions
        every step drafts keep ``n = 1/ema`` (weight ``ema``); positions only explorations reach
        (every 16..256 steps) get weight ~0.3..1, so after a change in the traffic one
        exploration at the level above the choice shows it. With the plain count, weight 0.1
        after ten explorations, a climb 3 -> 7 -> 15 took ~9 explorations, ~2300 steps at the
        256-step interval, instead of ~50 (test_adaptive_k_climbs_level_by_level_...).
        Noise in a one-request exploration is tolerable: a high reading is optimistic (runs,
        corrects), a low one waits for the next exploration.
        """
        m = len(accepted)
        hist = [0] * (k + 1)
        for a in accepted:
            hist[a if a < k else k] += 1
        now, decay, n_max = self._num_observed, 1.0 - self.ema, 1.0 / self.ema
        rates, counts, seen = self.rates, self._rate_n, self._rate_seen
        above = m  # requests that accepted more than ``pos`` drafts
        for pos in range(k):
            above -= hist[pos]
            n = counts[pos]
            gap = now - seen[pos]
            if gap > 1:
                n *= decay ** (gap - 1)
            n = min(n + 1.0, n_max)
            counts[pos], seen[pos] = n, now
            rates[pos] += (above / m - rates[pos]) / n


class FixedK:
    """A policy that always drafts ``k``: the warm-up's steps at each level of :class:`AdaptiveK`
    (``LLMEngine.warmup``), with the engine's calls to a policy and no state."""

    def __init__(self, k: int) -> None:
        self.k = k

    def choose(self, batch_size: int) -> int:
        return self.k

    def observe(self, k: int, batch_size: int, accepted: list[int], seconds: float) -> None:
        pass

    def expects_target_only(self, batch_size: int) -> bool:
        return self.k == 0


class BatchSizeK:
    """vLLM's ``num_speculative_tokens_per_batch_size``: K fixed by the step's batch size, from
    ``schedule`` (``(lo, hi, k)`` ranges, inclusive, sorted, covering every batch size the engine
    runs: config.k_schedule and ``LLMEngine`` check it). Deterministic, so a benchmark or a
    tensor-parallel group sees the same K for the same batch; ``levels`` are its distinct K (the
    warm-up drafts at each, as at adaptive K's)."""

    def __init__(self, schedule: tuple[tuple[int, int, int], ...]) -> None:
        self.schedule = schedule
        self.levels = tuple(sorted({k for _, _, k in schedule}))

    def choose(self, batch_size: int) -> int:
        for lo, hi, k in self.schedule:
            if lo <= batch_size <= hi:
                return k
        raise AssertionError(f"batch size {batch_size} is in no range of {self.schedule}")

    def observe(self, k: int, batch_size: int, accepted: list[int], seconds: float) -> None:
        pass

    def expects_target_only(self, batch_size: int) -> bool:
        return self.choose(batch_size) == 0
