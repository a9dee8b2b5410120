"""Incremental detokenization and stop strings, one token at a time.

Streamed and non-streamed responses are both built from the deltas of :class:`OutputText`, so the
streamed text is the non-streamed text by construction.

Incremental decoding keeps a small window ``ids[prefix_offset:]``: the text of the new tokens is
``decode(window)`` minus ``decode(ids[prefix_offset:read_offset])``. New text is released only
when it does not end in U+FFFD (the tail of an unfinished multi-byte character, or a merge that
changes once the next token arrives); then the window slides to the last release point. Release
points are character boundaries, so the concatenated deltas equal ``decode(all ids)`` for
byte-level BPE tokenizers. :meth:`IncrementalDetokenizer.flush` releases whatever is held at the
end, U+FFFD included, as a full decode would show it.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turn a growing list of token ids into text deltas (see the module docstring)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _delta(self, final: bool) -> str:
        if self.read_offset == len(self.token_ids):
            return ""
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset :])
        if len(text) <= len(prefix) or (text.endswith(_REPLACEMENT) and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return text[len(prefix) :]

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now final (possibly empty)."""
        self.token_ids.append(int(token_id))
        return self._delta(final=False)

    def flush(self) -> str:
        """Release the held-back tail (end of the request)."""
        return self._delta(final=True)


class OutputText:
    """The text of one request: detokenized deltas, stop strings, and what may be sent yet.

    While stop strings are active, the last ``max(len(stop)) - 1`` characters are held back: they
    could be the start of a stop string, which must never reach the client. When a stop string
    appears the text is cut before it (or after it with ``include_stop_str``). As in vLLM, stop
    strings are looked for only once more than ``min_tokens`` tokens were generated, and a stop
    string counts only where it ends in the text of those later tokens.
    """

    def __init__(self, detokenizer: IncrementalDetokenizer | None, stop: tuple[str, ...] = (),
                 include_stop_str: bool = False, min_tokens: int = 0) -> None:
        self.detokenizer = detokenizer
        self.stop = stop
        self.include_stop_str = include_stop_str
        self.min_tokens = min_tokens
        self.num_tokens = 0
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stop_hit: str | None = None

    def _append(self, delta: str) -> None:
        if not delta or self.stop_hit is not None:
            return
        before = len(self.text)
        self.text += delta
        if self.num_tokens <= self.min_tokens:
            return
        best: tuple[int, str] | None = None
        for s in self.stop:
            # only a match that ends in ``delta`` is new: one wholly in the earlier text lay in
            # the first min_tokens tokens (any other would have stopped the request already)
            i = self.text.find(s, max(0, before - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.text = self.text[: i + len(s) if self.include_stop_str else i]
            self.stop_hit = s

    def add_token(self, token_id: int, stop_token: bool = False) -> bool:
        """Feed one generated token; True when a stop string was hit (the request is done).

        ``stop_token``: the token the engine stopped on (EOS or a ``stop_token_ids`` one); as in
        vLLM its text is left out unless ``include_stop_str``."""
        self.num_tokens += 1
        if self.detokenizer is not None and (self.include_stop_str or not stop_token):
            self._append(self.detokenizer.push(token_id))
        return self.stop_hit is not None

    def add_tokens(self, token_ids: list[int], ends_on_stop_token: bool) -> int:
        """Feed generated tokens in order -> how many were taken: all of them, or up to and
        including the one that completed a stop string. ``ends_on_stop_token``: the engine
        stopped on the last one (EOS or a ``stop_token_ids`` one), whose text is left out."""
        last = len(token_ids) - 1
        for i, token in enumerate(token_ids):
            if self.add_token(token, stop_token=ends_on_stop_token and i == last):
                return i + 1
        return len(token_ids)

    def finish(self) -> None:
        """The engine finished the request: decode what is still held."""
        if self.detokenizer is not None and self.stop_hit is None:
            self._append(self.detokenizer.flush())

    def take(self, final: bool) -> str:
        """The text that may be sent now and was not sent before."""
        end = len(self.text) if final or self.stop_hit is not None else len(self.text) - self.hold
        if end <= self.sent:
            return ""
        delta = self.text[self.sent : end]
        self.sent = end
        return delta
