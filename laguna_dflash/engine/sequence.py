"""Request state: tokens, KV block table, sampling state, spec-decode counters."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity semantics: the scheduler's list membership tests stay O(1) each
class Sequence:
    """One request.

    Decode invariant: every token except the last has target KV (``num_computed ==
    len(token_ids) - 1``); the last token is the pending bonus token. The target taps
    ``[n_taps * H]`` of committed positions ``pending_start .. pending_start + num_pending - 1``
    that are not yet in the drafter's KV cache are ``pending_taps``: segments ``(source,
    first_row, num_rows)``, in position order, of a step's batch taps ``source [N, n_taps * H]``
    (rows are referenced, not sliced: no tensor op per request on the step path).
    """

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    # hybrid KV layout (kv_cache.HybridLayout): one table per sliding-window group, as long as
    # block_table; entries before swa_start are the scratch block (freed: outside the window of
    # every position still to compute), entries from it on are held
    swa_block_tables: list[list[int]] = field(default_factory=list)
    swa_start: int = 0
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    # finished on a stop token (EOS or a stop_token_ids one), whose text outputs leave out;
    # False for the other "stop", a constraint that allows nothing more
    is_stopped_on_token: bool = False
    pending_taps: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)
    pending_start: int = 0
    num_pending: int = 0
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # spec-decode counters (vLLM meaning)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    trace: list[dict] = field(default_factory=list)
    num_preemptions: int = 0
    # prefix caching: the content hashes of the full blocks of token_ids (kv_cache.block_hashes,
    # extended as tokens arrive), the leading blocks of block_table registered under them, the
    # tokens the last admission found cached, and the prompt tokens the first one found cached
    # (what clients are told, as vLLM: a preempted request's re-admission finds its own blocks)
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_admitted_cached_tokens: int = 0
    num_cached_tokens: int = 0
    # the repetition penalty's "in the prompt" mask [V] bool on the device, made on first use
    # (engine/penalties.py): the prompt goes up once, not every step
    prompt_mask: torch.Tensor | None = None
    # structured outputs: the request's place in its grammar (structured_outputs.ConstraintMatcher)
    grammar: Any = None
    # vLLM's request priority (lower first) under the priority scheduling policy
    priority: int = 0

    @property
    def num_final_positions(self) -> int:
        """Positions whose target K/V and drafter context K/V are final: computed, and not
        waiting in the pending taps (``pending_start`` on, the drafter's K/V is not written yet).
        Without a drafter nothing is pending, so it is ``num_computed``."""
        return self.pending_start if self.num_pending else self.num_computed

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def add_pending_taps(self, source: torch.Tensor, first_row: int, num_rows: int,
                         start_pos: int) -> None:
        """Queue rows ``first_row ..`` of ``source`` as the taps of positions ``start_pos ..``
        (which must follow the queued ones)."""
        if not self.pending_taps:
            self.pending_start = start_pos
        assert start_pos == self.pending_start + self.num_pending, "pending taps must be contiguous"
        self.pending_taps.append((source, first_row, num_rows))
        self.num_pending += num_rows

    def clear_pending_taps(self) -> None:
        self.pending_taps = []
        self.num_pending = 0

    def append_tokens(self, tokens: list[int], max_model_len: int) -> int:
        """Append generated tokens, applying stop ids, EOS, max_tokens, max_model_len and a
        constraint that allows nothing more (a complete structured output under ignore_eos:
        "stop", where the row after it would have no token to give).

        Returns how many were kept; sets ``finish_reason`` when the request ends.
        """
        p = self.params
        stop_ids = p.stop_token_ids or ()  # searched as they are: no set built every step
        eos_ids = () if p.ignore_eos else self.eos_token_ids
        kept = 0
        for tok in tokens:
            self.output_token_ids.append(tok)
            kept += 1
            if tok in stop_ids or tok in eos_ids:
                self.finish_reason = "stop"
                self.is_stopped_on_token = True
            elif len(self.output_token_ids) >= p.max_tokens or self.num_tokens >= max_model_len:
                self.finish_reason = "length"
            elif self.grammar is not None and self.grammar.allows_nothing(self.output_token_ids):
                self.finish_reason = "stop"
            if self.finish_reason is not None:
                self.status = Status.FINISHED
                break
        return kept
