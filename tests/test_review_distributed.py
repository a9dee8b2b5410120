"""Review of the multi-process paths (tensor and expert parallelism, data-parallel training).

Each test pins a bug found in the review: it failed before the fix named in its docstring.
"""

from __future__ import annotations

import pytest
import torch

from laguna_dflash.distributed import TensorParallel
from laguna_dflash.models.layers import MoE, fuse_for_inference


def _ep_rank(rank: int, world_size: int) -> TensorParallel:
    """Rank ``rank`` of ``world_size`` with expert parallelism (no process group: the tests call
    the rank's ``_forward`` and sum the ranks' outputs themselves, as the all-reduce would)."""
    return TensorParallel(rank, world_size, expert_parallel=True)


def _moe_with_shared(tp: TensorParallel, hidden: int, num_experts: int, top_k: int, inter: int,
                     shared: int) -> MoE:
    """An MoE with seeded random parameters and a shared expert of width ``shared``: the one-rank
    module, or rank ``tp.rank``'s part of the same parameters (its experts whole, its slice of
    the shared expert's width)."""
    torch.manual_seed(0)
    whole = MoE(hidden, num_experts, top_k, inter, shared, routed_scaling_factor=2.5)
    for p in whole.parameters():
        torch.nn.init.normal_(p, std=0.1)
    if not tp.is_parallel:
        return whole
    moe = MoE(hidden, num_experts, top_k, inter, shared, routed_scaling_factor=2.5, tp=tp)
    first, n = moe.first_expert, moe.num_local_experts
    width = moe.shared_expert.intermediate_size  # shared / world_size
    cols = slice(tp.rank * width, (tp.rank + 1) * width)
    with torch.no_grad():
        moe.gate.weight.copy_(whole.gate.weight)
        moe.e_score_correction_bias.copy_(whole.e_score_correction_bias)
        moe.experts_gate_up.copy_(whole.experts_gate_up[first : first + n])
        moe.experts_down.copy_(whole.experts_down[first : first + n])
        gate, up = whole.shared_expert.gate_up_proj.weight.chunk(2)  # [shared, H] each
        moe.shared_expert.gate_up_proj.weight.copy_(torch.cat([gate[cols], up[cols]]))
        moe.shared_expert.down_proj.weight.copy_(whole.shared_expert.down_proj.weight[:, cols])
    return moe


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_tokens", [1, 8, 64])  # the GEMV, fused and sorted expert kernels
def test_expert_parallel_keeps_a_folded_shared_expert(num_tokens):
    """Expert parallelism keeps each routed expert whole (width ``I``) but splits the shared
    expert's width over the ranks; where ``shared / world_size == I`` the CUDA fast path folded
    the shared expert in as pair id ``E``, which :meth:`MoE.local_ids` mapped to -1 ("another
    rank's expert") on EVERY rank: the shared expert's output vanished from the MoE. Fixed in
    ``MoE.fold_shared_expert`` (no fold under expert parallelism): the ranks' outputs again add
    up to the one-rank MoE's."""
    hidden, num_experts, top_k, inter = 256, 16, 8, 128
    shared = 2 * inter  # at 2 ranks each holds 128 = inter of the shared width: foldable
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        whole = _moe_with_shared(TensorParallel(), hidden, num_experts, top_k, inter, shared)
        whole = whole.to("cuda", torch.bfloat16).eval()
        want = whole._forward(x, keep_pairs=False).float()
        total = torch.zeros_like(want)
        for rank in range(2):
            moe = _moe_with_shared(_ep_rank(rank, 2), hidden, num_experts, top_k, inter, shared)
            moe = moe.to("cuda", torch.bfloat16).eval()
            fuse_for_inference(moe)
            total += moe._forward(x, keep_pairs=False).float()
        # the shared expert alone is a large part of the output: its loss is far outside bf16 noise
        shared_part = whole.shared_expert(x).float()
    assert shared_part.abs().max() > 0.1
    torch.testing.assert_close(total, want, atol=3e-2, rtol=3e-2)


def test_indivisible_shared_expert_width_names_its_field():
    """The shared expert's width was checked under the name ``intermediate_size`` (the dense
    MLP's field), so a config whose ``intermediate_size`` divides was told it does not. Fixed:
    the error names ``shared_expert_intermediate_size``, with and without expert parallelism."""
    for tp in (TensorParallel(0, 4), _ep_rank(0, 4)):
        with pytest.raises(ValueError, match=r"^shared_expert_intermediate_size=6 is not divisible "
                                             r"by tensor_parallel_size=4.*--tensor-parallel-size"):
            MoE(16, 8, 2, 8, 6, tp=tp)


def test_cached_target_states_with_fewer_sequences_than_ranks_is_an_error():
    """Data-parallel ``--cache-target-states`` with fewer sequences than ranks: a rank kept no
    sequence and crashed on an empty ``torch.cat``; now an error naming the flags (checked
    before the target runs, so no target is needed here)."""
    from laguna_dflash.train.draft import cached_target_states

    data = torch.zeros(3, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"--cache-target-states over 3 sequences on 4 ranks.*--num-sequences >= 4"):
        cached_target_states(None, data, [0], torch.device("cpu"), dp=TensorParallel(3, 4))
