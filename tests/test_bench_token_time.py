"""benchmarks/bench_gpu_xs.py ``token_time``: the simulated-acceptance cells count the tokens a
request is delivered, not ``1 + min(K, L - 1)`` a step. A request's last DFlash step keeps only
the tokens up to ``max_tokens``: 64 new tokens at acceptance length 4 (K = 3) are one prefill
token and 16 steps for 63 decode tokens, so a step time over 4 overstated the rate by 64 / 63."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_gpu_xs  # noqa: E402

from laguna_dflash import LLM  # noqa: E402


@pytest.mark.parametrize("new_tokens,length,k,steps,delivered", [
    (64, 4.0, 3, 16, 63),  # the last step keeps 3 of its 4 tokens
    (65, 4.0, 3, 16, 64),  # every step keeps 4
    (32, 8.0, 7, 4, 31),
])
def test_token_time_is_decode_time_over_the_tokens_delivered(new_tokens, length, k, steps, delivered) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tdir, ddir, _ = bench_gpu_xs.write_xs_configs(Path(tmp), 2, 128)
        llm = LLM(str(tdir), draft=str(ddir), dtype="float32", device="cpu", load_format="dummy",
                  max_model_len=256, max_num_seqs=2)
        engine = llm.engine
        engine.num_speculative_tokens = k
        engine.simulated_acceptance, engine._sim_carry = length, 0.0
        prompt = list(range(100, 140))
        before = llm.get_metrics()
        t = bench_gpu_xs.token_time(llm, prompt, new_tokens, batch=2, warm=False)
        after = llm.get_metrics()
    num_steps = after["num_decode_steps"] - before["num_decode_steps"]
    num_tokens = after["num_decode_tokens"] - before["num_decode_tokens"]
    decode_s = after["decode_s"] - before["decode_s"]
    assert (num_steps, num_tokens) == (steps, 2 * delivered)  # two requests, one step for both
    assert t == pytest.approx(decode_s / delivered, rel=1e-9)
    if delivered != steps * (1 + min(k, length - 1)):  # where the old formula was wrong
        assert t != pytest.approx(decode_s / (steps * (1 + min(k, length - 1))), rel=1e-3)
