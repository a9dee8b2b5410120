"""A DFlash step's acceptance count and its host copy's rows in ONE launch.

After the verify, request ``i`` has drafts ``d_i1 .. d_iK`` (``drafts [R, K]``, column ``j``
holding ``d_i(j+1)``) and the target's tokens ``t_i0 .. t_iK`` (``target_tokens [R, K+1]``).
Draft ``d_ij`` is accepted while every earlier one was and ``d_ij == t_i(j-1)``
(``engine/spec_decode.py``), so the accepted count is the first column whose draft and target
differ, or ``K`` where none does::

    a_i      = min({j in 0..K-1 : drafts[i, j] != target_tokens[i, j]} | {K})
    packed_i = [a_i, t_i0 .. t_iK, d_i1 .. d_iK]                    ([2K + 2] int64)

which is ``spec_decode.num_accepted`` (a cumulative product of the matches, summed). With
simulated acceptance the counts are given (``accepted``) and only copied. The engine brings
``packed`` to the host in one copy (``engine/engine.py``, ``_spec_decode``).

As torch ops it was five launches a step (the comparison, a cast, the cumulative product, the
sum, and the cat of the host copy's rows); one program a request here. Launched normally (no
PDL): its input is the verify's argmax just before it. Integer comparisons and copies only:
bitwise :func:`accept_and_pack_reference`, the CPU path.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from .availability import interpret_mode, triton_can_run
from .jit import jit_functions

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["accept_and_pack", "accept_and_pack_reference"]

# The A/B switch (benchmarks: --switch laguna_dflash.kernels.accept_pack:USE_KERNEL=False).
USE_KERNEL = True


def _accept_pack_kernel(drafts_ptr, targets_ptr, given_ptr, packed_ptr, accepted_ptr,
                        stride_drafts, stride_targets, k,
                        HAS_GIVEN: tl.constexpr, BLOCK: tl.constexpr):
    # program r: request r's row; lane j covers target column j (j <= K) and draft column j (j < K)
    r = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    in_drafts = j < k
    in_targets = j < k + 1
    d = tl.load(drafts_ptr + r * stride_drafts + j, mask=in_drafts, other=0)
    t = tl.load(targets_ptr + r * stride_targets + j, mask=in_targets, other=0)
    if HAS_GIVEN:
        a = tl.load(given_ptr + r).to(tl.int64)
    else:
        # the first draft column that differs from the target column beside it, else K
        miss = (d != t) & in_drafts
        a = tl.min(tl.where(miss, j, k), axis=0).to(tl.int64)
    row = packed_ptr + r * (2 * k + 2)
    tl.store(row, a)
    tl.store(row + 1 + j, t, mask=in_targets)
    tl.store(row + k + 2 + j, d, mask=in_drafts)
    tl.store(accepted_ptr + r, a)


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """The JIT kernel for one mode (``interpret`` is the cache key). Its integers are not
    specialised: the strides and K vary with K (adaptive K), and a variant built on first use
    would stall that step."""
    del interpret
    name = "_accept_pack_kernel"
    return jit_functions(__name__, (_accept_pack_kernel,),
                         {name: ("stride_drafts", "stride_targets", "k")})[name]


def _check(drafts: torch.Tensor, target_tokens: torch.Tensor, accepted: torch.Tensor | None) -> None:
    if drafts.dim() != 2 or drafts.dtype != torch.int64 or drafts.shape[1] < 1:
        raise ValueError(f"drafts must be a [R, K] int64 tensor with K >= 1, got {drafts.dtype} "
                         f"{tuple(drafts.shape)}")
    r, k = drafts.shape
    if (target_tokens.dim() != 2 or target_tokens.dtype != torch.int64
            or tuple(target_tokens.shape) != (r, k + 1) or target_tokens.device != drafts.device):
        raise ValueError(f"target_tokens must be [R, K + 1] = [{r}, {k + 1}] int64 on {drafts.device} "
                         f"(the drafts' device), got {target_tokens.dtype} {tuple(target_tokens.shape)} "
                         f"on {target_tokens.device}")
    if accepted is not None and (accepted.dim() != 1 or accepted.dtype not in (torch.int32, torch.int64)
                                 or accepted.shape[0] != r or accepted.device != drafts.device):
        raise ValueError(f"accepted must be None or a [R] = [{r}] int32 / int64 tensor on {drafts.device} "
                         f"(the drafts' device), got {accepted.dtype} {tuple(accepted.shape)} on "
                         f"{accepted.device}")


def accept_and_pack(drafts: torch.Tensor, target_tokens: torch.Tensor,
                    accepted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted drafts and the host copy's rows of a DFlash step (see the module docstring).

    Args:
        drafts: ``[R, K]`` int64, ``K >= 1``; any strides.
        target_tokens: ``[R, K + 1]`` int64 on the drafts' device; any strides.
        accepted: ``[R]`` int32 / int64, each in ``0 .. K`` (simulated acceptance: taken as
            given), or None: counted, exactly ``spec_decode.num_accepted``.

    Returns:
        ``(packed [R, 2K + 2] int64, accepted [R] int64)``, both contiguous and new: ``packed``
        row ``i`` is ``[a_i, t_i0 .. t_iK, d_i1 .. d_iK]``; ``accepted`` holds ``a_i`` again as
        its own tensor (not a view of ``packed``: a strided column would cost a copy in
        :func:`~laguna_dflash.kernels.rewind_rows.rewind_rows`), written by the same launch.
    """
    _check(drafts, target_tokens, accepted)
    if not (USE_KERNEL and triton_can_run(drafts.device)):
        return accept_and_pack_reference(drafts, target_tokens, accepted)
    r, k = drafts.shape
    packed = torch.empty((r, 2 * k + 2), dtype=torch.int64, device=drafts.device)
    counts = torch.empty((r,), dtype=torch.int64, device=drafts.device)
    if r == 0:
        return packed, counts
    # rows at any stride; the lanes read adjacent columns
    drafts = drafts if drafts.stride(1) == 1 else drafts.contiguous()
    target_tokens = target_tokens if target_tokens.stride(1) == 1 else target_tokens.contiguous()
    given = None if accepted is None else accepted.contiguous()
    _kernel(interpret_mode())[(r,)](
        drafts, target_tokens, drafts if given is None else given, packed, counts,
        drafts.stride(0), target_tokens.stride(0), k,
        HAS_GIVEN=given is not None, BLOCK=1 << k.bit_length(), num_warps=1)  # BLOCK >= K + 1
    return packed, counts


def accept_and_pack_reference(drafts: torch.Tensor, target_tokens: torch.Tensor,
                              accepted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`accept_and_pack` in torch ops (the CPU path, and the kernel's oracle)."""
    _check(drafts, target_tokens, accepted)
    if accepted is None:  # spec_decode.num_accepted: the matches' cumulative product, summed
        match = (drafts == target_tokens[:, :-1]).to(torch.int32)
        accepted = torch.cumprod(match, dim=1).sum(dim=1)
    packed = torch.cat([accepted.view(-1, 1).to(torch.int64), target_tokens, drafts], dim=1)
    return packed, packed[:, 0].clone(memory_format=torch.contiguous_format)
