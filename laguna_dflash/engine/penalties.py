"""Logit bias, presence / frequency / repetition penalties and min_tokens, per generated position.

For request ``i`` with :attr:`SamplingParams.has_penalties` (or fewer than ``min_tokens``
outputs), the logits row that scores output position ``n`` (``n`` tokens generated before it)
becomes, in float32 (vLLM's order)::

    z = where(n < min_tokens and t is a stop token (EOS unless ignore_eos, stop_token_ids), -inf, logits)
    z = z + logit_bias
    z = where(seen, where(z > 0, z / rep, z * rep), z)       seen: in the prompt or the n outputs
    z = z - frequency * count - presence * (count > 0)       count: occurrences in the n outputs

A verify forward scores ``K + 1`` positions at once: its row ``j`` follows the bonus token and
drafts ``d_1 .. d_j``, which are the request's outputs there if row ``j`` is reached at all (a
row is used only when every earlier draft was accepted). So row ``j`` counts the outputs so far
plus ``d_1 .. d_j``, and the verify samples every row from the distribution target-only decoding
would sample that position from: speculation stays lossless with penalties, greedy and sampled.
The drafter proposes without them (they change acceptance, never the output).

Only the rows of requests with penalties are processed (copies, so logprobs stay the model's
raw ones, as vLLM reports them by default); the counts are built on the device from one upload
of the request's token ids per step, with no host sync.
"""

from __future__ import annotations

import torch

from .runner import to_device_async
from .sequence import Sequence


def penalized_rows(logits: torch.Tensor, seqs: list[Sequence], rows_per_request: int = 1,
                   drafts: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
    """``{i: rows [rows_per_request, V] float32}`` for each request ``i`` of ``seqs`` with
    penalties, from its rows of ``logits [R * rows_per_request, V]`` (request-major).
    ``drafts [R, rows_per_request - 1]`` (on the device): the verify's draft tokens, counted as
    outputs by the rows after them. Empty when no request has penalties."""
    out: dict[int, torch.Tensor] = {}
    for i, seq in enumerate(seqs):
        if seq.params.has_penalties or len(seq.output_token_ids) < seq.params.min_tokens:
            rows = logits[i * rows_per_request : (i + 1) * rows_per_request].to(torch.float32, copy=True)
            out[i] = apply_penalties(rows, seq, drafts[i] if drafts is not None else None)
    return out


def apply_penalties(rows: torch.Tensor, seq: Sequence, drafts: torch.Tensor | None = None) -> torch.Tensor:
    """``rows [n, V]`` float32 (modified in place and returned): row ``j`` scores the output
    position after ``seq``'s outputs so far and ``drafts[:j]`` (``drafts [n - 1]`` int64 on the
    device, or None when ``n == 1``)."""
    p = seq.params
    n, vocab = rows.shape
    device = rows.device
    num_banned = min(n, p.min_tokens - len(seq.output_token_ids))  # rows j < min_tokens - outputs
    stops = sorted({t for t in (p.stop_token_ids or []) + ([] if p.ignore_eos else list(seq.eos_token_ids))
                    if 0 <= t < vocab})
    if num_banned > 0 and stops:
        rows[:num_banned, to_device_async(torch.tensor(stops, dtype=torch.long), device)] = float("-inf")
    if p.logit_bias:
        ids = to_device_async(torch.tensor(list(p.logit_bias), dtype=torch.long), device)
        bias = to_device_async(torch.tensor(list(p.logit_bias.values()), dtype=torch.float32), device)
        rows.index_add_(1, ids, bias.expand(n, -1))
    if not (p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0):
        return rows
    # the prompt, then the outputs so far: one upload
    tokens = to_device_async(torch.tensor(seq.prompt_token_ids + seq.output_token_ids, dtype=torch.long), device)
    num_prompt = len(seq.prompt_token_ids)
    counts = torch.zeros(n, vocab, dtype=torch.float32, device=device)
    counts.index_add_(1, tokens[num_prompt:], torch.ones(1, tokens.numel() - num_prompt, device=device).expand(n, -1))
    if drafts is not None and n > 1:  # row j also counts d_1 .. d_j
        one_hot = torch.zeros(n - 1, vocab, dtype=torch.float32, device=device)
        one_hot.scatter_(1, drafts[: n - 1].view(-1, 1).to(torch.long), 1.0)
        counts[1:] += one_hot.cumsum(0)
    if p.repetition_penalty != 1.0:
        seen = counts > 0
        seen[:, tokens[:num_prompt]] = True
        rep = p.repetition_penalty
        rows.copy_(torch.where(seen, torch.where(rows > 0, rows / rep, rows * rep), rows))
    if p.frequency_penalty:
        rows -= p.frequency_penalty * counts
    if p.presence_penalty:
        rows -= p.presence_penalty * (counts > 0).float()
    return rows
