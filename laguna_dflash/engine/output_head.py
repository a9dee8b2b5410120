"""What a decode-phase forward hands back when its batch only needs greedy tokens.

A greedy step needs the argmax of the lm_head logits and nothing else of the hidden states. With
a :class:`GreedyHead` the forward computes them itself, after its last layer, so on CUDA the
lm_head GEMM and the argmax are part of the forward's graph replay: no copy of the hidden
states out of the graph, and no eager launches with their gaps between the replay and the
tokens. Batches with a sampled request or one that wants logprobs keep the hidden states and
sample eagerly (engine/sampler.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.argmax import argmax_rows

# True: greedy target decode / verify steps and the drafter's block take their tokens from a
# GreedyHead inside the forward (inside its CUDA graph); False: the hidden states come back and
# the lm_head and argmax run eagerly after the replay (an A/B switch; graphs are keyed by the
# head, so switching needs no reset).
in_graph = True


@dataclass(frozen=True)
class GreedyHead:
    """``hidden [R, q, H]`` (final-normed, request-major) -> argmax tokens ``[R, q - first_row]``
    int64 of ``model.lm_head_logits`` over rows ``first_row ..`` of each request.

    ``first_row = 1`` is the drafter's block (its row 0 is the bonus token, not a draft). The
    argmax is :func:`argmax_rows` of the logits in the lm_head's dtype, which is what
    ``sample_rows`` takes for a greedy row: the tokens equal the eager path's.
    """

    model: torch.nn.Module  # has ``lm_head_logits(hidden [N, H]) -> [N, V]``
    first_row: int = 0

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        r, q, h = hidden.shape
        logits = self.model.lm_head_logits(hidden[:, self.first_row :].reshape(-1, h))
        return argmax_rows(logits).view(r, q - self.first_row)
