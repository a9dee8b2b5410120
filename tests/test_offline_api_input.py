"""User input to the offline API (``SamplingParams``, ``EngineConfig``, ``LLM.generate``): what a
vLLM user writes works the same here, and bad input is a ``ValueError`` naming the field."""

from __future__ import annotations

from pathlib import Path

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


@pytest.mark.parametrize("field,value", [
    ("ignore_eos", "no"), ("ignore_eos", 1), ("include_stop_str_in_output", "False"),
    ("stop_token_ids", 5), ("stop_token_ids", [True]), ("logit_bias", [1, 2]),
    ("logit_bias", {5: "1.0"}),
])
def test_sampling_params_container_and_bool_types_name_the_field(field, value):
    """``ignore_eos="no"`` used to count as True silently; ``stop_token_ids=5`` and
    ``logit_bias=[...]`` / ``{5: "1.0"}`` failed with TypeErrors naming no field."""
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("option,value,needle", [
    ("enforce_eager", "no", r"enforce_eager must be True or False \(--enforce-eager\)"),
    ("enable_prefix_caching", "False", "enable_prefix_caching must be True or False"),
    ("block_size", "16", r"block_size must be an integer \(--block-size\)"),
    ("block_size", 16.0, "block_size must be an integer"),
    ("max_model_len", "256", "max_model_len must be an integer or None"),
    ("mem_fraction_static", "0.5", "mem_fraction_static must be a number or None"),
    ("tensor_parallel_size", True, "tensor_parallel_size must be an integer"),
    ("device", "cudax", r"device='cudax' is not supported \(--device\)"),
])
def test_engine_options_of_the_wrong_type_name_the_field(llm, option, value, needle):
    """A string for a bool option (``"no"``, ``"False"``) used to switch it on silently; a
    string for a number failed with "'<' not supported between 'str' and 'int'"; ``"cudax"``
    with torch's list of every device type."""
    with pytest.raises(ValueError, match=needle):
        LLM(llm.config.model, **{option: value})


def test_speculative_options_of_the_wrong_type_name_the_argument(tmp_path):
    target, draft = write_random_pair(tmp_path)
    for kwargs, needle in (({"num_speculative_tokens": "3"}, "num_speculative_tokens must be an integer"),
                           ({"num_speculative_tokens": 2.5}, "num_speculative_tokens must be an integer"),
                           ({"adaptive_k": "yes"}, r"adaptive_k must be True or False \(--adaptive-k\)"),
                           ({"simulate_acceptance_length": "2"}, "simulate_acceptance_length must be a number")):
        with pytest.raises(ValueError, match=needle):
            LLM(str(target), draft=str(draft), **kwargs)


def test_device_may_be_a_torch_device(llm):
    assert LLM(llm.config.model, device=torch.device("cpu")).config.device == "cpu"


def test_missing_directories_name_the_argument(llm, tmp_path):
    """The loader's message says "model path" whichever argument gave it; a missing drafter
    directory now names ``draft=`` (or ``speculative_config``), ``model=None`` is not "'None'"."""
    missing = str(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"^draft= '.*missing': no such directory"):
        LLM(llm.config.model, draft=missing)
    with pytest.raises(ValueError, match=r"^speculative_config's \"model\" '.*missing'"):
        LLM(llm.config.model, speculative_config={"model": missing})
    with pytest.raises(ValueError, match=r"^model= '.*missing': no such directory"):
        LLM(missing)
    with pytest.raises(ValueError, match=r"^model= must be the target checkpoint directory"):
        LLM(None)


@pytest.mark.parametrize("option,needle", [
    ("tokenizer", r"'tokenizer' \(the tokenizer is read from model=\)"),
    ("max_num_seq", r"'max_num_seq'; the engine options are .*max_num_seqs"),
])
def test_unknown_engine_options_name_the_valid_ones(llm, option, needle):
    """It used to be "EngineConfig.__init__() got an unexpected keyword argument" (no list)."""
    with pytest.raises(TypeError, match=rf"LLM\(\) got an unexpected keyword argument {needle}"):
        LLM(llm.config.model, **{option: 1})


def test_cumulative_logprob_and_finished_as_in_vllm(llm):
    """vLLM's ``outputs[i].cumulative_logprob`` (None without ``logprobs``) and ``finished``."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=params)[0]
    assert plain.outputs[0].cumulative_logprob is None and plain.finished
    out = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, logprobs=2, n=2))[0]
    for choice in out.outputs:
        assert choice.cumulative_logprob == pytest.approx(
            sum(lp[t] for t, lp in zip(choice.token_ids, choice.logprobs)))
        assert choice.cumulative_logprob < 0


def test_default_sampling_params_come_from_generation_config_as_in_vllm(llm, tmp_path):
    """vLLM's ``LLM.generate(prompts)`` without sampling params samples with the model's
    ``generation_config.json`` (temperature, top_p, top_k, min_p, repetition_penalty,
    max_new_tokens as max_tokens); it used to be ``SamplingParams()`` whatever the model said.
    Explicit sampling params are untouched; ``generation_config="vllm"`` turns it off."""
    import json
    import shutil

    d = Path(shutil.copytree(llm.config.model, tmp_path / "with-gen-config"))
    (d / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "temperature": 0.0, "top_k": 20, "max_new_tokens": 5}))
    with_defaults = LLM(str(d))
    got = with_defaults.get_default_sampling_params()
    assert (got.temperature, got.top_k, got.max_tokens) == (0.0, 20, 5)
    out = with_defaults.generate(prompt_token_ids=[[1, 2, 3]])[0]
    greedy = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(
        temperature=0, max_tokens=5))[0]
    assert out.token_ids == greedy.token_ids
    assert LLM(str(d), generation_config="vllm").get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="generation_config='nope'"):
        LLM(str(d), generation_config="nope")
    (d / "generation_config.json").write_text(json.dumps({"top_p": 2.0}))
    with pytest.raises(ValueError, match=r"generation_config\.json: SamplingParams\.top_p"):
        LLM(str(d)).generate(prompt_token_ids=[[1, 2]])


def test_use_tqdm_as_in_vllm(llm):
    """vLLM scripts pass ``use_tqdm=False`` (or True, or a tqdm-like callable); it used to be a
    TypeError."""
    made = []

    class Bar:
        def __init__(self, total, **kwargs):
            self.total, self.n, self.closed = total, 0, False
            made.append(self)

        def update(self, k):
            self.n += k

        def close(self):
            self.closed = True

    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ref = llm.generate(prompt_token_ids=[[1, 2], [3]], sampling_params=params, use_tqdm=False)
    outs = llm.generate(prompt_token_ids=[[1, 2], [3]], sampling_params=params, use_tqdm=Bar)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert len(made) == 1 and (made[0].total, made[0].n, made[0].closed) == (2, 2, True)
    with pytest.raises(ValueError, match="use_tqdm"):
        llm.generate(prompt_token_ids=[[1]], sampling_params=params, use_tqdm="yes")


def test_token_ids_given_as_prompts_point_to_prompt_token_ids(llm):
    with pytest.raises(ValueError, match="pass token ids as prompt_token_ids="):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))


def test_logprobs_are_vllms_logprob_objects_with_decoded_tokens():
    """vLLM's offline outputs map token ids to ``Logprob(logprob, rank, decoded_token)``; ours
    were bare floats, so ``lp[t].logprob`` (the vLLM spelling) raised AttributeError. A
    :class:`Logprob` is still the float (sums, JSON, comparisons), pickles with its fields, and
    ``decoded_token`` is the token decoded alone, for prompt logprobs too."""
    import json
    import pickle

    from laguna_dflash import Logprob

    demo = Path(__file__).resolve().parents[1] / "assets" / "demo" / "target"
    llm = LLM(str(demo))
    out, = llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=4, logprobs=2,
                                                            prompt_logprobs=1, ignore_eos=True))
    for tok, entry in zip(out.token_ids, out.logprobs):
        lp = entry[tok]
        assert isinstance(lp, Logprob) and lp.logprob == float(lp) < 0 and lp.rank == 1  # greedy
        assert sorted(v.rank for v in entry.values()) == [1, 2]
        for t, v in entry.items():
            assert v.decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False)
    assert out.prompt_logprobs[0] is None
    for t, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert entry[t].decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False)
        assert entry[t].rank >= 1
    lp = out.logprobs[0][out.token_ids[0]]
    back = pickle.loads(pickle.dumps(lp))
    assert (float(back), back.rank, back.decoded_token) == (float(lp), lp.rank, lp.decoded_token)
    assert json.loads(json.dumps({"v": lp}))["v"] == float(lp) and str(lp) == repr(float(lp))


def test_skip_special_tokens_and_truncate_prompt_tokens_as_in_vllm():
    """vLLM's ``SamplingParams.skip_special_tokens`` (False: special tokens stay in the text)
    and ``truncate_prompt_tokens`` (the prompt's last N tokens; -1: max_model_len of them);
    neither existed offline (a TypeError)."""
    demo = Path(__file__).resolve().parents[1] / "assets" / "demo" / "target"
    llm = LLM(str(demo), max_model_len=64)
    special = llm.tokenizer.all_special_ids[0]
    marker = llm.tokenizer.decode([special], skip_special_tokens=False)
    base = dict(temperature=0, max_tokens=3, ignore_eos=True, allowed_token_ids=[special])
    shown, = llm.generate(["def f():"], SamplingParams(**base, skip_special_tokens=False))
    hidden, = llm.generate(["def f():"], SamplingParams(**base))
    assert shown.token_ids == hidden.token_ids == [special] * 3
    assert shown.text == marker * 3 and marker and hidden.text == ""
    prompt = list(range(5, 25))
    greedy = dict(temperature=0, max_tokens=5, ignore_eos=True)
    cut, = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(**greedy, truncate_prompt_tokens=4))
    tail, = llm.generate(prompt_token_ids=[prompt[-4:]], sampling_params=SamplingParams(**greedy))
    assert cut.prompt_token_ids == prompt[-4:] and cut.token_ids == tail.token_ids
    with pytest.raises(ValueError, match="prompt"):  # -1 keeps 64 of 80 tokens: no room for output
        llm.generate(prompt_token_ids=[prompt * 4], sampling_params=SamplingParams(**greedy, truncate_prompt_tokens=-1))
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens must be -1 \(max_model_len\) or in \[1, 64\]"):
        llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(**greedy, truncate_prompt_tokens=65))
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="SamplingParams.truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    with pytest.raises(ValueError, match="SamplingParams.skip_special_tokens must be True or False"):
        SamplingParams(skip_special_tokens="no")


def test_vllm_no_op_options_are_taken(llm):
    """``LLM(model, trust_remote_code=True, disable_log_stats=True)``, as vLLM scripts write it,
    runs (trust_remote_code used to be a TypeError) and changes nothing; options vLLM has and
    this engine lacks stay errors."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    vllm_style = LLM(llm.config.model, trust_remote_code=True, disable_log_stats=True)
    assert vllm_style.config == llm.config
    assert (vllm_style.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=params)[0].token_ids
            == llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=params)[0].token_ids)
    with pytest.raises(TypeError, match="unexpected keyword argument 'kv_cache_dtype'"):
        LLM(llm.config.model, kv_cache_dtype="fp8")
