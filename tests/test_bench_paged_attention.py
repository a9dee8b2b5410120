"""``benchmarks/bench_paged_attention.py``: what can be checked without a GPU. Each variant sets
exactly its switch or keyword for its block and restores the module after (also when the block
raises), an unknown variant is refused with the list of known ones, and the per-layer inputs
describe one request whose last ``q`` keys are the new tokens, in the graph runner's key bucket."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from laguna_dflash.kernels import paged_attention as pa  # noqa: E402
from laguna_dflash.kernels import pdl  # noqa: E402


def test_variants_set_and_restore_their_switch():
    import bench_paged_attention as bench

    warps, preload, use_pdl = pa._num_warps, pa.PRELOAD_OLD_KEYS, pdl.USE_PDL
    with bench.variant("block_n=32") as kw:
        assert kw == {"block_n": 32}
    with bench.variant("splits=8") as kw:
        assert kw == {"num_splits": 8}
    with pytest.raises(RuntimeError), bench.variant("warps=8") as kw:
        assert kw == {} and pa._num_warps(16, 128) == 8
        raise RuntimeError("a failing variant")
    assert pa._num_warps is warps
    with bench.variant("no_preload"), bench.variant("no_pdl"):
        assert pa.PRELOAD_OLD_KEYS is False and pdl.USE_PDL is False
    assert (pa.PRELOAD_OLD_KEYS, pdl.USE_PDL) == (preload, use_pdl)
    skip, preload_max = pa.SKIP_EMPTY_SPLITS, pa.PRELOAD_MAX_QUERIES
    with bench.variant("keep_empty+preload_max=4"):
        assert pa.SKIP_EMPTY_SPLITS is False and pa.PRELOAD_MAX_QUERIES == 4
    assert (pa.SKIP_EMPTY_SPLITS, pa.PRELOAD_MAX_QUERIES) == (skip, preload_max)
    rows = pa._TARGET_ROWS
    with bench.variant("rows=8+splits=32+no_pdl") as kw:
        assert kw == {"num_splits": 32} and pa._TARGET_ROWS == 8 and pdl.USE_PDL is False
    assert (pa._TARGET_ROWS, pdl.USE_PDL) == (rows, use_pdl)
    with pytest.raises(SystemExit, match="block_n=N, splits=S"), bench.variant("no_pdl+tiles=3"):
        pass
    assert pdl.USE_PDL == use_pdl  # the part before the bad one was undone


def test_layer_inputs_are_one_request_with_q_new_keys():
    import bench_paged_attention as bench

    layers = bench.layer_inputs(2, context=100, q_len=4, heads=64, device="cpu")
    assert len(layers) == 2 and layers[0]["k_cache"].data_ptr() != layers[1]["k_cache"].data_ptr()
    x = layers[0]
    assert x["q"].shape == (4, 64, 128) and x["q"].dtype == torch.bfloat16
    assert x["query_positions"].tolist() == [[100, 101, 102, 103]]
    assert x["seq_lens"].tolist() == [104]
    assert x["key_slots"].shape == (1, 128)  # next power of two >= 104
    assert x["k_cache"].shape[0] >= 128 and x["k_cache"].shape[1:] == (8, 128)
