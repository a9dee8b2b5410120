"""Structured outputs, allowed_token_ids, bad_words, logit bias, presence / frequency /
repetition penalties and min_tokens, per generated position.

For request ``i`` with :attr:`SamplingParams.has_penalties` (or fewer than ``min_tokens``
outputs), the logits row that scores output position ``n`` (``n`` tokens generated before it)
becomes, in float32 (vLLM's order: the allowed-token mask first)::

    z = where(t allowed by the grammar in the state the n outputs reach, logits, -inf)
    z = where(t in allowed_token_ids (every t when None), z, -inf)
    z = where(t == w_m for a bad word w = (w_1 .. w_m) whose w_1 .. w_{m-1} are the last m - 1 of
              the n outputs (always for m == 1; never when n < m - 1), -inf, z)
    z = where(n < min_tokens and t is a stop token (EOS unless ignore_eos, stop_token_ids), -inf, z)
              (not in a row whose grammar allows stop tokens only: a complete output ends)
    z = z + logit_bias
    z = where(seen, where(z > 0, z * (1 / rep), z * rep), z)   seen: in the prompt or the n outputs
    z = z - frequency * count - presence * (count > 0)       count: occurrences in the n outputs

A masked token stays -inf through every later line (-inf plus a finite bias or minus a finite
penalty, times a positive 1 / rep or rep), so the masks' place in the order changes no output:
they go first as in vLLM (allowed_token_ids, then bad_words, among its first processors; two
-inf masks commute). The sampler's filters and its race keep -inf tokens unpicked, greedy
and sampled; ``allowed_token_ids`` is never empty and lies in the vocabulary (checked when the
request is added, as is a list min_tokens or one-token bad words would ban whole), so every row
keeps a finite logit. (Not caught, as in vLLM: a list that longer bad words ban whole only in
some context, e.g. allowed [a, b] with words (b, a) and (b, b) once b is generated: that row is
all -inf.)

A verify forward scores ``K + 1`` positions at once: its row ``j`` follows the bonus token and
drafts ``d_1 .. d_j``, which are the request's outputs there if row ``j`` is reached at all (a
row is used only when every earlier draft was accepted). So row ``j`` counts the outputs so far
plus ``d_1 .. d_j``, and the verify samples every row from the distribution target-only decoding
would sample that position from: speculation stays lossless with penalties, greedy and sampled.
A bad word's prefix is matched against the same outputs-plus-drafts: row ``j``'s past ends
``.., o_N, d_1, .., d_j``, so drafts that complete a word's prefix mid-block ban its last token
at the very row after them, as target-only decoding would ban it at that position. The drafter
proposes without any of this (it changes acceptance, never the output).

Only the rows of requests with penalties are processed (copies, so logprobs stay the model's
raw ones, as vLLM reports them by default), all of a step's at once; the counts and the allowed
mask are built on the device from one upload of the token ids per step, with no host sync. The
mask is per request, not per row: its ``K + 1`` verify rows share it (allowed_token_ids does not
depend on the outputs), so the upload carries each request's list once. The grammar's masks
are per row: row ``j``'s state is the one the outputs and ``d_1 .. d_j`` reach, walked on the
host (structured_outputs.ConstraintMatcher), so a verify step with a constrained request brings
its drafts to the host (one sync; requests without a constraint never do). The bad words' prefix
match runs on the device too: the drafts never come to the host, and the outputs' tails and the
words' ids ride in the same upload.
"""

from __future__ import annotations

import torch

from ..structured_outputs import unpack_token_bits
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

    bad_words (``SamplingParams.bad_words_token_ids``, ``w = (w_1 .. w_m)``): a one-token word's
    flat entries ``(pos * n + j) * V + w_1`` (every row ``j``) are set to -inf. The longer words
    of the step share ``P``, the longest prefix ``m - 1`` among them; each request with one gets a
    history row ``[P + n - 1]`` int64: its last ``P`` outputs (left-padded with -1, which no
    prefix holds, so a history shorter than a prefix never matches) and then its drafts
    ``d_1 .. d_{n-1}`` (gathered on the device). Row ``j``'s past ends with ``history[j : j + P]``
    (the outputs' tail, then ``d_1 .. d_j``), an ``unfold`` window ``[B, n, P]``; a (request,
    word) pair's prefix ``[P]`` is right-aligned, left-padded with -1 (a wildcard), and matches a
    window where every non-pad entry is equal: ``match [Q, n]`` bool. The ``(row, w_m)`` entries
    then take ``amin(z, -inf if match else +inf)`` in one ``scatter_reduce_``: -inf where a
    prefix matched, the same bits elsewhere, and order-free when pairs share an entry.
    """
    n = rows_per_request
    chosen = [i for i, s in enumerate(seqs)
              if s.params.has_penalties or len(s.output_token_ids) < s.params.min_tokens]
    if not chosen:
        return {}
    vocab, device = logits.shape[-1], logits.device
    grammar_bits = _grammar_row_bits(seqs, chosen, n, drafts)  # {pos: n rows' bit sets}, host
    tables: dict[str, list] = {name: [] for name in (
        "rows", "ban_row", "ban_token", "bias_row", "bias_token", "bias_value", "out_token",
        "draft_row", "draft_index", "allow_index", "allow_free", "bad_flat", "bad_history",
        "bad_request", "bad_pair", "bad_prefix", "bad_target")}
    tables["out_length"] = [0] * len(chosen)
    rep, freq, pres = [], [], []
    longer: list[tuple[int, int, tuple[int, ...]]] = []  # (pos, i, word): the bad words of m >= 2
    for pos, i in enumerate(chosen):
        seq, p = seqs[i], seqs[i].params
        tables["rows"] += range(i * n, (i + 1) * n)
        num_banned = min(n, p.min_tokens - len(seq.output_token_ids))  # rows j < min_tokens - outputs
        stops = sorted({t for t in (p.stop_token_ids or []) + ([] if p.ignore_eos else list(seq.eos_token_ids))
                        if 0 <= t < vocab})
        for j in range(max(num_banned, 0) if stops else 0):
            if pos in grammar_bits and seq.grammar.allows_only_stops(grammar_bits[pos][j]):
                continue  # the constraint is complete: it wins over min_tokens
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
        words = p.bad_words_token_ids or ()
        assert all(0 <= t < vocab for w in words for t in w), "bad_words id past the vocabulary"
        for w in words:
            if len(w) == 1:  # no prefix: banned at each of the request's n rows
                tables["bad_flat"] += [(pos * n + j) * vocab + w[0] for j in range(n)]
            else:
                longer.append((pos, i, w))
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
    span = max((len(w) - 1 for _, _, w in longer), default=0)  # P: the step's longest prefix
    history_row: dict[int, int] = {}  # pos -> its row of the history
    for pos, i, w in longer:
        if pos not in history_row:
            history_row[pos] = len(history_row)
            tail = seqs[i].output_token_ids[-span:]  # the last P outputs (fewer early on)
            tables["bad_history"] += [-1] * (span - len(tail)) + tail
            if n > 1:
                assert drafts is not None, "verify rows with bad words need the drafts"
                tables["bad_request"].append(i)  # its row of drafts [R, n - 1]
        tables["bad_pair"].append(history_row[pos])
        tables["bad_prefix"] += [-1] * (span - len(w) + 1) + list(w[:-1])  # right-aligned
        tables["bad_target"].append(pos * n * vocab + w[-1])  # entry (row pos * n, w_m), flat
    values = tables.pop("bias_value")
    used = {name: v for name, v in tables.items() if v}  # one upload of every table in use
    ints = dict(zip(used, to_device_async(torch.tensor([t for v in used.values() for t in v], dtype=torch.long),
                                          device).split([len(v) for v in used.values()])))
    x = logits.index_select(0, ints["rows"]).float()  # a copy: logprobs stay the model's raw ones
    if grammar_bits:  # first (vLLM's order: the grammar's bit mask before the processors)
        _mask_grammar_rows(x, grammar_bits, n)
    # every scatter below is into a flattened [rows * V] view: entry (r, t) is r * V + t
    if tables["allow_index"]:  # first (vLLM's order): z = where(t allowed, z, -inf)
        banned = torch.ones(len(chosen), vocab, dtype=torch.bool, device=device)
        banned.view(-1)[ints["allow_index"]] = False  # a repeated id writes False twice: harmless
        if tables["allow_free"]:  # a request without a list bans nothing
            banned[ints["allow_free"]] = False
        # [M, 1, V] over the [M, n, V] rows: each of a request's rows takes its request's mask
        x.view(len(chosen), n, vocab).masked_fill_(banned.unsqueeze(1), float("-inf"))
    if tables["bad_flat"]:  # next (vLLM's order): one-token bad words, every row
        x.view(-1)[ints["bad_flat"]] = float("-inf")  # a repeated entry writes -inf twice: harmless
    if longer:  # the last token of a bad word whose prefix ends the row's past
        history = ints["bad_history"].view(-1, span)  # [B, P]: the outputs' tails
        if n > 1:  # then d_1 .. d_{n-1}: [B, P + n - 1]
            history = torch.cat([history, drafts.index_select(0, ints["bad_request"]).long()], dim=1)
        windows = history.unfold(1, span, 1)  # [B, n, P]: row j's past's last P = history[j : j + P]
        prefix = ints["bad_prefix"].view(-1, 1, span)  # [Q, 1, P], -1: no constraint (left pad)
        match = ((windows.index_select(0, ints["bad_pair"]) == prefix) | (prefix < 0)).all(-1)  # [Q, n]
        flat = ints["bad_target"].view(-1, 1) + torch.arange(n, device=device) * vocab  # [Q, n]
        # amin(z, -inf) = -inf where matched, amin(z, +inf) = z (the same bits) elsewhere; a min
        # is order-free, so pairs hitting one entry (a word's two spellings) give one result
        cap = torch.where(match, float("-inf"), float("inf")).to(x.dtype)  # [Q, n]
        x.view(-1).scatter_reduce_(0, flat.view(-1), cap.view(-1), "amin")
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


def _grammar_row_bits(seqs: list[Sequence], chosen: list[int], n: int,
                      drafts: torch.Tensor | None) -> dict[int, list[torch.Tensor]]:
    """Structured outputs: ``{pos: n bit sets [ceil(V / 32)] int32}`` for each request
    ``seqs[chosen[pos]]`` with a grammar, its row ``j`` in the state its outputs and then drafts
    ``d_1 .. d_j`` reach (``drafts [R, n - 1]`` on the device; structured_outputs.ConstraintMatcher).
    The constraint runs on the host: a verify step with such a request brings their drafts to
    the host (unless the drafter's guided choice left them there), the one host sync
    structured outputs add."""
    positions = [pos for pos, i in enumerate(chosen) if seqs[i].grammar is not None]
    if not positions:
        return {}
    requests = [chosen[pos] for pos in positions]
    # guided drafts are known on the host already (spec_decode.DFlashProposer._guide)
    known = [seqs[i].grammar.drafted(len(seqs[i].output_token_ids), n - 1) for i in requests]
    if n == 1:
        draft_lists: list[list[int]] = [[] for _ in requests]
    elif all(d is not None for d in known):
        draft_lists = known
    else:
        assert drafts is not None, "verify rows with a grammar need the drafts"
        draft_lists = drafts.index_select(0, to_device_async(torch.tensor(requests), drafts.device)).tolist()
    return {pos: seqs[i].grammar.row_bits(seqs[i].output_token_ids, d)
            for pos, i, d in zip(positions, requests, draft_lists)}


def _mask_grammar_rows(x: torch.Tensor, bits_by_pos: dict[int, list[torch.Tensor]], n: int) -> None:
    """``-inf`` in ``x [M * n, V]`` float32 (in place) at the tokens the grammar's bit sets
    (:func:`_grammar_row_bits`; request ``pos``'s rows start at ``pos * n``) leave out; the bit
    sets go up packed (``V / 8`` bytes a row) and are unpacked on the device."""
    bits = torch.stack([b for rows in bits_by_pos.values() for b in rows])  # [G * n, W] int32
    banned = ~unpack_token_bits(to_device_async(bits, x.device), x.shape[-1])  # [G * n, V]
    if len(bits_by_pos) * n == x.shape[0]:  # every request of x: no gather
        x.masked_fill_(banned, float("-inf"))
        return
    rows = to_device_async(torch.tensor([p * n + j for p in bits_by_pos for j in range(n)]), x.device)
    x.index_copy_(0, rows, x.index_select(0, rows).masked_fill_(banned, float("-inf")))


def _prompt_mask(seq: Sequence, vocab: int, device: torch.device) -> torch.Tensor:
    """``[V]`` bool on ``device``: the tokens of ``seq``'s prompt, uploaded on first use and kept
    on the request (the prompt never changes)."""
    mask = seq.prompt_mask
    if mask is None or mask.shape[0] != vocab or mask.device != device:
        mask = torch.zeros(vocab, dtype=torch.bool, device=device)
        mask[to_device_async(torch.tensor(seq.prompt_token_ids, dtype=torch.long), device)] = True
        seq.prompt_mask = mask
    return mask
