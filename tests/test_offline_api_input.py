"""User input to the offline API (``SamplingParams``, ``EngineConfig``, ``LLM.generate``): what a
vLLM user writes works the same here, and bad input is a ``ValueError`` naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.config import EngineConfig
from laguna_dflash.models.random_init import write_random_pair


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    target, _ = write_random_pair(tmp_path_factory.mktemp("api-pair"))
    return LLM(str(target))


def test_top_k_minus_one_disables_top_k_as_in_vllm():
    """vLLM (and this project's server) take ``top_k=-1`` as "no top-k"."""
    assert SamplingParams(top_k=-1).top_k == 0
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)


def test_max_tokens_none_generates_up_to_max_model_len(llm):
    """vLLM's ``max_tokens=None``: no output cap of its own, the sequence ends at max_model_len."""
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    small = LLM(llm.config.model, max_model_len=12)
    out = small.generate(prompt_token_ids=[[1, 2, 3, 4]], sampling_params=params)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 12 - 4


@pytest.mark.parametrize("field,value", [
    ("temperature", "0.5"), ("top_p", None), ("top_k", 2.5), ("top_k", True), ("max_tokens", 2.5),
    ("max_tokens", "16"), ("min_tokens", 1.5), ("logprobs", 1.5), ("seed", 1.5), ("min_p", "0"),
    ("presence_penalty", "1"), ("repetition_penalty", None),
])
def test_sampling_params_wrong_types_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}"):
        SamplingParams(**{field: value})


def test_sampling_params_n():
    assert SamplingParams(n=1).n == 1 and SamplingParams(n=64).n == 64
    for bad in (0, 65, -1):
        with pytest.raises(ValueError, match=r"SamplingParams\.n must be in \[1, 64\]"):
            SamplingParams(n=bad)


def test_n_choices_per_prompt_as_in_vllm(llm):
    """``n`` choices per prompt in ``outputs`` (index 0..n-1); choice i of a seeded request is
    the same request alone with seed + i; greedy choices agree; prompts keep their order."""
    prompts = [[5, 6, 7], [9, 3]]
    sampled = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=[sampled, SamplingParams(
        temperature=0, n=2, max_tokens=6, ignore_eos=True)])
    assert [len(o.outputs) for o in outs] == [3, 2]
    assert [c.index for c in outs[0].outputs] == [0, 1, 2] and outs[0].outputs[0] is outs[0]
    assert all(c.prompt_token_ids == prompts[0] for c in outs[0].outputs)
    for i, choice in enumerate(outs[0].outputs):
        alone = llm.generate(prompt_token_ids=[prompts[0]], sampling_params=SamplingParams(
            temperature=1.0, seed=11 + i, max_tokens=6, ignore_eos=True))[0]
        assert choice.token_ids == alone.token_ids, i
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1  # the seeds differ
    assert outs[1].outputs[0].token_ids == outs[1].outputs[1].token_ids


def test_num_kv_blocks_must_be_positive():
    """``num_kv_blocks=0`` is not silently "size it for me" (that is None)."""
    with pytest.raises(ValueError, match="num_kv_blocks"):
        EngineConfig(model="m", num_kv_blocks=0)


def test_generate_takes_vllm_prompt_dicts(llm):
    """vLLM's ``TokensPrompt`` form, ``{"prompt_token_ids": [...]}``, equals ``prompt_token_ids=``."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ref = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=params)[0].token_ids
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params)[0]
    assert out.token_ids == ref and out.prompt_token_ids == [1, 2, 3]
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"tokens": [1, 2, 3]}], params)


def test_generate_takes_a_tuple_of_sampling_params(llm):
    params = (SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outs = llm.generate(prompt_token_ids=[[1, 2], [3, 4]], sampling_params=params)
    assert [len(o.token_ids) for o in outs] == [2, 3]
    with pytest.raises(TypeError, match="sampling_params"):
        llm.generate(prompt_token_ids=[[1, 2]], sampling_params={"max_tokens": 2})


def test_generate_takes_numpy_and_torch_token_ids(llm):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ref = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=params)[0].token_ids
    for ids in (np.array([1, 2, 3]), torch.tensor([1, 2, 3]), [np.int64(1), np.int64(2), np.int64(3)],
                np.array([[1, 2, 3]])):
        assert llm.generate(prompt_token_ids=ids, sampling_params=params)[0].token_ids == ref


@pytest.mark.parametrize("ids", [[[1.7, 2, 3]], [["1", 2, 3]], "123", [[True, 2]]])
def test_generate_rejects_token_ids_that_are_not_ints(llm, ids):
    """Floats are not truncated, strings not parsed: a ValueError naming prompt_token_ids."""
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate(prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=2))


def test_max_model_len_past_the_model_limit_is_an_error_not_a_silent_cap(llm):
    """vLLM refuses a max_model_len the model's positions cannot hold; it used to be lowered to
    the limit silently (a long prompt then failed with "raise max_model_len")."""
    limit = llm.engine.target.spec.max_position_embeddings
    with pytest.raises(ValueError, match=rf"max_model_len={limit + 1} \(--max-model-len\).*{limit}"):
        LLM(llm.config.model, max_model_len=limit + 1)
    assert LLM(llm.config.model, max_model_len=limit).engine.max_model_len == limit


def test_dtype_auto_as_in_vllm(llm):
    """``dtype="auto"`` (vLLM's default): float32 on the CPU; on a GPU the checkpoint's
    ``torch_dtype`` (bfloat16 when it names none, or names float32)."""
    from laguna_dflash.config import resolve_dtype

    assert LLM(llm.config.model, dtype="auto").engine.dtype == torch.float32
    assert LLM(llm.config.model, dtype="AUTO", device="cpu").engine.dtype == torch.float32
    gpu = torch.device("cuda", 0)
    assert resolve_dtype("auto", {"torch_dtype": "float16"}, gpu) == torch.float16
    assert resolve_dtype("auto", {"dtype": "bfloat16"}, gpu) == torch.bfloat16
    assert resolve_dtype("auto", {"torch_dtype": "float32"}, gpu) == torch.bfloat16
    assert resolve_dtype("auto", {}, gpu) == torch.bfloat16
    with pytest.raises(ValueError, match="use one of auto, float32"):
        resolve_dtype("float8")


def test_logprobs_are_capped_by_max_logprobs_as_in_vllm(llm):
    with pytest.raises(ValueError, match=r"SamplingParams.logprobs=21 is more than max_logprobs=20"):
        llm.generate(prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(logprobs=21))
    with pytest.raises(ValueError, match=r"SamplingParams.prompt_logprobs=21"):
        llm.generate(prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(prompt_logprobs=21))
    whole = LLM(llm.config.model, max_logprobs=-1)
    vocab = whole.engine.target.spec.vocab_size
    out = whole.generate(prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(
        temperature=0, max_tokens=2, logprobs=vocab))[0]
    assert all(len(lp) == vocab for lp in out.logprobs)
    with pytest.raises(ValueError, match="more than max_logprobs"):  # not a torch.topk error
        whole.generate(prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(logprobs=vocab + 1))
    with pytest.raises(ValueError, match="max_logprobs must be"):
        EngineConfig(model="m", max_logprobs=-2)
