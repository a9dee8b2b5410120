"""Adaptive number of draft tokens: pick K per step from measured acceptance and step cost.

A step with K drafts emits, in expectation, ``1 + sum_{k<=K} r_k`` tokens, where ``r_k`` is the
per-position acceptance rate (fraction of drafts whose first k tokens were all accepted, the
quantity ``num_accepted_tokens_per_pos / num_drafts`` measures). It costs ``t(K)`` seconds,
measured on this engine (K = 0 is plain target-only decoding). The policy picks
``argmax_K (1 + sum_{k<=K} r_k) / t(K)``, so speculation is used only where it pays: with a weak
drafter, or a MoE target whose verify touches many experts, it falls back towards K = 0 and is
never much slower than target-only decoding. Acceptance rates are exponential moving averages;
every ``explore_every`` steps the full K runs so the estimates for long drafts stay fresh.

Exploration backs off while it changes nothing: an exploration step after which the best K is
the one chosen before it doubles the interval, up to ``max_explore_every``; one that changes
the choice resets it. A full-K step is expensive: with a drafter that never helps it costs about
3.5x a decode step at Laguna-XS-2.1 size on an H200, so exploring every 16 steps would alone
cost ~15% of throughput; and where drafting pays at a short K, exploring K = 15 every 16 steps
took the adaptive engine to 1.41x target-only at batch 16 against 1.61x for the best fixed K
(docs/PERFORMANCE.md). At the 256-step cap exploration costs ~1%. The price is reaction time: a
change in the traffic that only longer drafts would reveal is noticed within
``max_explore_every`` steps (a drop in acceptance shows at once, in the positions every step
drafts). Changing K never changes the output: acceptance is still exact.
"""

from __future__ import annotations


def batch_bucket(batch_size: int) -> int:
    """Step costs are kept per power-of-two batch size (cost ratios change with batch)."""
    return 1 << max(0, (batch_size - 1).bit_length())


class AdaptiveK:
    def __init__(self, max_k: int, explore_every: int = 16, ema: float = 0.1,
                 max_explore_every: int = 256) -> None:
        self.max_k = max_k
        self.explore_every = explore_every
        self.max_explore_every = max(max_explore_every, explore_every)
        self.ema = ema
        self.rates = [1.0] * max_k  # optimistic start: first steps draft the full block
        self.step_time: dict[tuple[int, int], float] = {}  # (K, batch bucket) -> seconds
        self.num_steps = 0
        self.explore_interval = explore_every  # current; backs off while K = 0 stays best
        self.steps_since_explore = 0
        self.num_explorations = 0
        self._exploring_bucket: int | None = None  # set by choose() for an exploration step
        self._best_before_exploring = 0  # the choice the exploration step interrupted

    def expected_tokens(self, k: int) -> float:
        return 1.0 + sum(self.rates[:k])

    def cost(self, k: int, bucket: int) -> float | None:
        """Measured seconds per step at K, interpolated linearly between measured K values."""
        if (k, bucket) in self.step_time:
            return self.step_time[(k, bucket)]
        known = sorted(x for x, b in self.step_time if b == bucket)
        lower = [x for x in known if x < k]
        upper = [x for x in known if x > k]
        if lower and upper:
            a, b = lower[-1], upper[0]
            w = (k - a) / (b - a)
            return self.step_time[(a, bucket)] * (1 - w) + self.step_time[(b, bucket)] * w
        return None

    def choose(self, batch_size: int) -> int:
        """K for the next step of ``batch_size`` requests (0 = target-only decode)."""
        self.num_steps += 1
        self.steps_since_explore += 1
        bucket = batch_bucket(batch_size)
        if (self.max_k, bucket) not in self.step_time:
            return self.max_k
        if self.steps_since_explore >= self.explore_interval:
            self.steps_since_explore = 0
            self.num_explorations += 1
            self._exploring_bucket = bucket
            self._best_before_exploring = self.best_k(bucket)
            return self.max_k
        if (0, bucket) not in self.step_time:
            return 0  # measure plain decode once
        return self.best_k(bucket)

    def best_k(self, bucket: int) -> int:
        """``argmax_K`` expected tokens per second at this batch bucket (0 without a K = 0 cost)."""
        if (0, bucket) not in self.step_time:
            return 0
        best, best_rate = 0, self.expected_tokens(0) / self.step_time[(0, bucket)]
        for k in range(1, self.max_k + 1):
            cost = self.cost(k, bucket)
            if cost is not None and self.expected_tokens(k) / cost > best_rate:
                best, best_rate = k, self.expected_tokens(k) / cost
        return best

    def observe(self, k: int, batch_size: int, accepted: list[int], seconds: float) -> None:
        """After a step at K: each request's accepted-draft count and the step's wall time."""
        key = (k, batch_bucket(batch_size))
        prev = self.step_time.get(key)
        self.step_time[key] = seconds if prev is None else (1 - self.ema) * prev + self.ema * seconds
        if k == 0 or not accepted:
            return
        for pos in range(k):
            rate = sum(a > pos for a in accepted) / len(accepted)
            self.rates[pos] = (1 - self.ema) * self.rates[pos] + self.ema * rate
        bucket = self._exploring_bucket
        if bucket is not None:  # the outcome of an exploration step: back off or reset
            self._exploring_bucket = None
            if self.best_k(bucket) == self._best_before_exploring:
                self.explore_interval = min(2 * self.explore_interval, self.max_explore_every)
            else:
                self.explore_interval = self.explore_every
