"""``benchmarks/verify_floor.py``: the expert-union counts, the byte counts it builds its floors
from (meta-built models), and its printed ratios with a given union (no routing run)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import verify_floor  # noqa: E402
from bench_gpu_xs import active_bytes, xs_draft_config, xs_target_config  # noqa: E402


def test_mean_union_counts_distinct_ids_per_window() -> None:
    ids = torch.tensor([[0, 1], [1, 2], [3, 4]])
    assert verify_floor.mean_union(ids, 1) == 2
    assert verify_floor.mean_union(ids, 2) == (3 + 4) / 2  # {0, 1, 2}, {1, 2, 3, 4}
    assert verify_floor.mean_union(ids, 3) == 5


def test_expected_union_of_uniform_choices() -> None:
    assert verify_floor.expected_union(4, 2, 1) == pytest.approx(2)
    assert verify_floor.expected_union(4, 2, 2) == pytest.approx(3)  # 4 (1 - (1/2)^2)
    assert verify_floor.expected_union(256, 8, 64) < 256


def test_parts_are_active_bytes_at_top_k_and_grow_by_whole_experts() -> None:
    model = verify_floor.meta_model(xs_target_config(3)).to(torch.bfloat16)
    drafter = verify_floor.meta_model(xs_draft_config(3), target=model).to(torch.bfloat16)
    moe = model.spec.moe
    bf16 = verify_floor.Formats(lm_head="bf16")
    base = verify_floor.step_parts(model, drafter, 1024, moe.top_k, bf16)
    assert sum(p[1] for p in base) == pytest.approx(active_bytes(model, 1024))
    more = verify_floor.step_parts(model, drafter, 1024, moe.top_k + 1, bf16)
    expert = 3 * 512 * 2048 * 2  # gate, up, down of one XS-2.1 expert in bf16
    num_sparse = xs_target_config(3)["mlp_layer_types"].count("sparse")
    assert sum(p[2] for p in more) - sum(p[2] for p in base) == pytest.approx(expert * num_sparse)


# ---- the engine's formats, part by part (meta-built models: shapes only) ----------------------

ACTIVE_PARAMS_XS21 = 2_811_614_976  # reference/laguna.md 6.1: active a token, lm_head in, embedding out
DRAFTER_PARAMS_XS21 = 462_064_896  # reference/laguna.md 6.1: the XS-2.1 DFlash drafter


@pytest.fixture(scope="module")
def xs21_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    target = verify_floor.meta_model(xs_target_config(40)).to(torch.bfloat16)
    drafter = verify_floor.meta_model(xs_draft_config(40), target=target).to(torch.bfloat16)
    return target, drafter


def _totals(parts: list[tuple[str, float, float]]) -> tuple[float, float]:
    return sum(p[1] for p in parts), sum(p[2] for p in parts)


def test_decode_parts_in_bf16_are_the_active_parameters_and_the_kv(xs21_pair) -> None:
    target, drafter = xs21_pair
    top_k = target.spec.moe.top_k
    parts = verify_floor.step_parts(target, drafter, 1024, top_k, verify_floor.Formats(lm_head="bf16"))
    decode, _ = _totals(parts)
    # 10 full layers read 1024 tokens of K and V, 30 sliding ones their 512-token window (4096 B a token)
    kv = (10 * 1024 + 30 * 512) * 8 * 128 * 2 * 2
    assert decode == pytest.approx(2 * ACTIVE_PARAMS_XS21 + kv)
    assert decode == pytest.approx(active_bytes(target, 1024))


def test_dflash_parts_read_the_union_and_every_drafter_weight_once(xs21_pair) -> None:
    target, drafter = xs21_pair
    formats = verify_floor.Formats(lm_head="bf16")
    parts = verify_floor.step_parts(target, drafter, 1024, 29.5, formats)
    decode, step = _totals(parts)
    num_sparse = xs_target_config(40)["mlp_layer_types"].count("sparse")
    expert = 3 * 512 * 2048 * 2
    drafter_kv = 5 * 512 * 8 * 128 * 2 * 2  # five sliding layers, 512-token window
    draft_lm_head = 100352 * 2048 + 4 * 100352  # no fp8, no map: the drafts come from the int8 copy
    # every drafter layer's K|V rows [2 x 8 x 128, 2048] are read twice: by the context store (the
    # accepted rows' K/V) and by the block's Q|K|V|gate GEMM (the block rows' own K/V)
    kv_rows_again = 5 * 2048 * 2048 * 2
    assert step - decode == pytest.approx((29.5 - 8) * expert * num_sparse + 2 * DRAFTER_PARAMS_XS21
                                          + kv_rows_again + drafter_kv + draft_lm_head)


def test_one_byte_formats_shrink_exactly_their_parts(xs21_pair) -> None:
    target, drafter = xs21_pair
    bf16 = dict((p[0].split(" (")[0], p) for p in verify_floor.step_parts(
        target, drafter, 1024, 29.5, verify_floor.Formats(lm_head="bf16")))
    small = dict((p[0].split(" (")[0], p) for p in verify_floor.step_parts(
        target, drafter, 1024, 29.5, verify_floor.Formats("int8", "fp8", 16384)))
    v, h = 100352, 2048
    assert small["target lm_head"][1] == v * h + 4 * v == bf16["target lm_head"][1] / 2 + 4 * v
    gate_up_rows = 5 * 16384  # five layers' gate|up [16384, 2048]
    assert bf16["drafter block weights"][2] - small["drafter block weights"][2] == gate_up_rows * h - 4 * gate_up_rows
    assert small["draft lm_head"][2] == 16384 * h + 4 * 16384
    assert small["drafter context store"][2] == bf16["drafter context store"][2]  # never quantized
    # a map without fp8 keeps the map's rows in bf16
    mapped = verify_floor.step_parts(target, drafter, 1024, 29.5, verify_floor.Formats(token_map_size=1000))
    assert mapped[-1][2] == 2 * 1000 * h


def test_main_prints_the_ratio_of_its_parts(xs21_pair, capsys, monkeypatch) -> None:
    target, drafter = xs21_pair
    monkeypatch.setattr(sys, "argv", ["verify_floor.py", "--union", "29.73", "--draft-quantization", "fp8",
                                      "--token-map-size", "16384", "--bandwidth", "3.04e12",
                                      "--decode-ms", "2.41", "--dflash-ms", "4.94"])
    verify_floor.main()
    out = capsys.readouterr().out
    decode, step = _totals(verify_floor.step_parts(target, drafter, 1024, 29.73,
                                                   verify_floor.Formats("int8", "fp8", 16384)))
    assert f"at equal multiples of the floors: {4 * decode / step:.3f}x" in out
    assert f"L = 4 gives {4 * 2.41 / 4.94:.3f}x" in out
    assert f"2x needs a DFlash step of {2 * 2.41:.3f} ms = {2 * 2.41 / (step / 3.04e12 * 1e3):.3f}x" in out


def test_main_wants_both_measured_steps(monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["verify_floor.py", "--union", "29.73", "--decode-ms", "2.41"])
    with pytest.raises(SystemExit, match="--decode-ms and --dflash-ms go together"):
        verify_floor.main()
