"""allowed_token_ids, logit bias, presence / frequency / repetition penalties and min_tokens, per
generated position.

For request ``i`` with :attr:`SamplingParams.has_penalties` (or fewer than ``min_tokens``
outputs), the logits row that scores output position ``n`` (``n`` tokens generated before it)
becomes, in float32 (vLLM's order: the allowed-token mask first)::

    z = where(t in allowed_token_ids (every t when None), logits, -inf)
    z = where(n < min_tokens and t is a stop token (EOS unless ignore_eos, stop_token_ids), -inf, z)
    z = z + logit_bias
    z = where(seen, where(z > 0, z * (1 / rep), z * rep), z)   seen: in the prompt or the n outputs
    z = z - frequency * count - presence * (count > 0)       count: occurrences in the n outputs

A masked token stays -inf through every later line (-inf plus a finite bias or minus a finite
penalty, times a positive 1 / rep or rep), so the mask's place in the order changes no output:
it goes first as in vLLM. The sampler's filters and its race keep -inf tokens unpicked, greedy
and sampled; ``allowed_token_ids`` is never empty and lies in the vocabulary (checked when the
request is added, as is a list min_tokens would ban whole), so every row keeps a finite logit.

A verify forward scores ``K + 1`` positions at once: its row ``j`` follows the bonus token and
drafts ``d_1 .. d_j``, which are the request's outputs there if row ``j`` is reached at all (a
row is used only when every earlier draft was accepted). So row ``j`` counts the outputs so far
plus ``d_1 .. d_j``, and the verify samples every row from the distribution target-only decoding
would sample that position from: speculation stays lossless with penalties, greedy and sampled.
The drafter proposes without them (they change acceptance, never the output).

Only the rows of requests with penalties are processed (copies, so logprobs stay the model's
raw ones, as vLLM reports them by default), all of a step's at once; the counts and the allowed
mask are built on the device from one upload of the token ids per step, with no host sync. The
mask is per request, not per row: its ``K + 1`` verify rows share it (allowed_token_ids does not
depend on the outputs), so the upload carries each request's list once.
"""

from __future__ import annotations

import torch

from .runner import to_device_async
from .sampler import per_row_parameters
from .sequence import Sequence


def penalized_rows(logits: torch.Tensor, seqs: list[Sequence], rows_per_request: int = 1,
                   drafts: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
    """``{i: rows [rows_per_request, V] float32}`` for each request ``i`` of ``seqs`` with
    penalties, from its rows of ``logits [R * rows_per_request, V]`` (request-major; left
    unchanged). ``drafts [R, rows_per_request - 1]`` (on the device): the verify's draft tokens,
    counted as outputs by the rows after them. Empty when no request has penalties.

    All the penalised requests of a step at once: their index tables go up in one int64 copy,
    the bias values and the penalties that differ between requests in a float32 copy each, and
    every op covers all their rows; per-row parameters that a request does not use are neutral
    (repetition 1, frequency and presence 0, no allowed list: exact no-ops).

    allowed_token_ids: a ``[M, V]`` bool ``banned`` (``M`` chosen requests) starts all True,
    the flat entries ``pos * V + t`` of each request's allowed ids (int64, computed on the host)
    and the whole rows of the chosen requests without a list are cleared, and ``banned``
    broadcast over each request's ``rows_per_request`` rows fills them with -inf: a ``where``,
    exact, so a request's rows are the same bits alone and batched.
    """
    n = rows_per_request
    chosen = [i for i, s in enumerate(seqs)
              if s.params.has_penalties or len(s.output_token_ids) < s.params.min_tokens]
    if not chosen:
        return {}
    vocab, device = logits.shape[-1], logits.device
    tables: dict[str, list] = {name: [] for name in (
        "rows", "ban_row", "ban_token", "bias_row", "bias_token", "bias_value", "out_token",
        "draft_row", "draft_index", "allow_index", "allow_free")}
    tables["out_length"] = [0] * len(chosen)
    rep, freq, pres = [], [], []
    for pos, i in enumerate(chosen):
        seq, p = seqs[i], seqs[i].params
        tables["rows"] += range(i * n, (i + 1) * n)
        num_banned = min(n, p.min_tokens - len(seq.output_token_ids))  # rows j < min_tokens - outputs
        stops = sorted({t for t in (p.stop_token_ids or []) + ([] if p.ignore_eos else list(seq.eos_token_ids))
                        if 0 <= t < vocab})
        for j in range(max(num_banned, 0) if stops else 0):
            tables["ban_row"] += [pos * n + j] * len(stops)
            tables["ban_token"] += stops
        # ids were checked against the vocabulary at add_request; a flat index past a row's end
        # would land in the next row
        assert all(0 <= t < vocab for t in p.logit_bias or ()), "logit_bias id past the vocabulary"
        for j in range(n) if p.logit_bias else ():
            tables["bias_row"] += [pos * n + j] * len(p.logit_bias)
            tables["bias_token"] += list(p.logit_bias)
            tables["bias_value"] += list(p.logit_bias.values())
        # the same check for the allowed ids (add_request refuses ids past the vocabulary)
        assert all(0 <= t < vocab for t in p.allowed_token_ids or ()), "allowed id past the vocabulary"
        if p.allowed_token_ids:  # entry (pos, t) of the [M, V] mask, flattened
            tables["allow_index"] += [pos * vocab + t for t in p.allowed_token_ids]
        else:
            tables["allow_free"].append(pos)
        rep.append(p.repetition_penalty)
        freq.append(p.frequency_penalty)
        pres.append(p.presence_penalty)
        if not (p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0):
            continue
        tables["out_token"] += seq.output_token_ids
        tables["out_length"][pos] = len(seq.output_token_ids)
        if drafts is not None and n > 1:  # row j also counts d_1 .. d_j
            for j in range(1, n):
                tables["draft_row"] += [pos * n + j] * j
                tables["draft_index"] += range(i * (n - 1), i * (n - 1) + j)
    if not tables["allow_index"]:
        tables["allow_free"] = []  # no request of the step has a list: no mask, nothing to upload
    values = tables.pop("bias_value")
    used = {name: v for name, v in tables.items() if v}  # one upload of every table in use
    ints = dict(zip(used, to_device_async(torch.tensor([t for v in used.values() for t in v], dtype=torch.long),
                                          device).split([len(v) for v in used.values()])))
    x = logits.index_select(0, ints["rows"]).float()  # a copy: logprobs stay the model's raw ones
    # every scatter below is into a flattened [rows * V] view: entry (r, t) is r * V + t
    if tables["allow_index"]:  # first (vLLM's order): z = where(t allowed, z, -inf)
        banned = torch.ones(len(chosen), vocab, dtype=torch.bool, device=device)
        banned.view(-1)[ints["allow_index"]] = False  # a repeated id writes False twice: harmless
        if tables["allow_free"]:  # a request without a list bans nothing
            banned[ints["allow_free"]] = False
        # [M, 1, V] over the [M, n, V] rows: each of a request's rows takes its request's mask
        x.view(len(chosen), n, vocab).masked_fill_(banned.unsqueeze(1), float("-inf"))
    if tables["ban_row"]:
        x.view(-1)[ints["ban_row"] * vocab + ints["ban_token"]] = float("-inf")
    if values:  # one (row, token) pair a bias entry: adds, never two to one entry
        x.view(-1).index_add_(0, ints["bias_row"] * vocab + ints["bias_token"],
                              to_device_async(torch.tensor(values, dtype=torch.float32), device))
    if any(r != 1.0 or f or q for r, f, q in zip(rep, freq, pres)):
        num_out = len(tables["out_token"])
        counts = torch.zeros(len(chosen), vocab, dtype=torch.float32, device=device)
        if num_out:
            out_index = ints["out_token"]  # one request: its row 0
            if len(chosen) > 1:  # each output's request: output_size, no host sync
                out_request = torch.repeat_interleave(torch.arange(len(chosen), device=device),
                                                      ints["out_length"], output_size=num_out)
                out_index = out_request * vocab + out_index
            counts.view(-1).index_add_(0, out_index, torch.ones((), device=device).expand(num_out))
        counts = counts.repeat_interleave(n, dim=0) if n > 1 else counts  # [M * n, V]
        if tables["draft_row"]:
            tokens = drafts.reshape(-1)[ints["draft_index"]].long()
            counts.view(-1).index_add_(0, ints["draft_row"] * vocab + tokens,
                                       torch.ones((), device=device).expand(len(tables["draft_row"])))
        # a parameter every request shares is a Python scalar (no upload: batch 1 always), the
        # others [M, 1] columns in one upload; z / rep as z * (1 / rep), the same float32 op for a
        # scalar and a column, so a request's rows are the same bits alone and batched
        inv_rep_c, rep_c, freq_c, pres_c = (
            c.repeat_interleave(n, dim=0) if isinstance(c, torch.Tensor) and n > 1 else c
            for c in per_row_parameters(device, [1.0 / r for r in rep], rep, freq, pres))
        if any(r != 1.0 for r in rep):  # seen: in the prompt or the outputs (drafts included)
            blank = (None if all(r != 1.0 for r in rep)  # repetition 1: a no-op whatever it sees
                     else torch.zeros(vocab, dtype=torch.bool, device=device))
            masks = [_prompt_mask(seqs[i], vocab, device) if r != 1.0 else blank for i, r in zip(chosen, rep)]
            in_prompt = masks[0].view(1, -1) if len(masks) == 1 else torch.stack(masks)
            seen = (counts > 0) | (in_prompt.repeat_interleave(n, dim=0) if n > 1 else in_prompt)
            x = torch.where(seen, torch.where(x > 0, x * inv_rep_c, x * rep_c), x)
        if any(freq):
            x -= freq_c * counts
        if any(pres):
            x -= pres_c * (counts > 0).float()
    return {i: x[pos * n : (pos + 1) * n] for pos, i in enumerate(chosen)}


def _prompt_mask(seq: Sequence, vocab: int, device: torch.device) -> torch.Tensor:
    """``[V]`` bool on ``device``: the tokens of ``seq``'s prompt, uploaded on first use and kept
    on the request (the prompt never changes)."""
    mask = seq.prompt_mask
    if mask is None or mask.shape[0] != vocab or mask.device != device:
        mask = torch.zeros(vocab, dtype=torch.bool, device=device)
        mask[to_device_async(torch.tensor(seq.prompt_token_ids, dtype=torch.long), device)] = True
        seq.prompt_mask = mask
    return mask
