"""``bench_gpu_xs.parse_switch`` / ``switch_error``: the ``module:attr=value`` switches every GPU
benchmark script takes (``--switch``), including a dataclass config replaced field by field."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from laguna_dflash.kernels import qkv_norm_rope_cache as head_gemm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_gpu_xs import parse_switch, switch_error  # noqa: E402


def test_json_and_python_booleans() -> None:
    obj, name, value = parse_switch("laguna_dflash.kernels.pdl:USE_PDL=False")
    assert (obj.__name__, name, value) == ("laguna_dflash.kernels.pdl", "USE_PDL", False)
    assert parse_switch("laguna_dflash.kernels.paged_attention:PRELOAD_MAX_QUERIES=null")[2] is None


def test_an_object_replaces_fields_of_a_dataclass_config() -> None:
    obj, name, value = parse_switch(
        'laguna_dflash.kernels.qkv_norm_rope_cache:DEFAULT_CONFIG={"num_warps": 2, "num_stages": 3}')
    assert obj is head_gemm and name == "DEFAULT_CONFIG"
    assert value == head_gemm.HeadGemmConfig(block_k=head_gemm.DEFAULT_CONFIG.block_k, num_stages=3,
                                             num_warps=2)
    assert head_gemm.DEFAULT_CONFIG == head_gemm.HeadGemmConfig()  # parsing sets nothing


@pytest.mark.parametrize("value, message", [
    ('{"warps": 8}', "fields are"),            # an unknown field names the known ones
    ('{"num_warps": 3}', "num_warps must be"),  # the config's own check
])
def test_bad_config_fields_name_the_field(value, message) -> None:
    problem = switch_error(f"laguna_dflash.kernels.qkv_norm_rope_cache:DEFAULT_CONFIG={value}")
    assert problem is not None and message in problem and "module:attr=value" in problem
    assert switch_error("laguna_dflash.kernels.pdl:USE_PDL=true") is None
