"""Request bodies of the OpenAI-compatible routes (pydantic v2), with vLLM's extension fields.

Unknown fields are ignored (clients send many); fields we cannot honour with a non-default value
(``use_beam_search``, ...) are rejected in :mod:`.sampling` with a 400
rather than silently dropped.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions (sent through ``extra_body`` by the openai client)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    # vLLM's: only these token ids can be generated (the others' logits are -inf)
    allowed_token_ids: list[int] | None = None
    # vLLM's: these words are never generated (their last token's logit is -inf right after the
    # rest of them in the output; a one-token word everywhere); needs the model's tokenizer
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    # vLLM's: prefix-cache blocks are shared only among requests with the same salt
    cache_salt: str | None = None
    # vLLM's: each prompt token's logprob and the n most likely at its position (-1: the whole
    # vocabulary); not with stream=true, as in vLLM
    prompt_logprobs: int | None = None
    # vLLM's: keep only the prompt's last N tokens (-1: max_model_len of them)
    truncate_prompt_tokens: int | None = None
    # vLLM's: the response's ``id`` is ``<cmpl|chatcmpl>-<request_id>`` (an ``X-Request-Id``
    # header takes precedence); a random one when neither is sent
    request_id: str | None = None
    # vLLM's: only with ``--scheduling-policy priority`` (lower first), else a 400
    priority: int = 0
    # Structured outputs (server/structured.py): OpenAI's response_format, vLLM's guided_*
    # fields and its newer structured_outputs dict; one constraint a request.
    # guided_decoding_backend is declared to be ignored.
    response_format: dict[str, Any] | None = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: Any = None
    # Changes the output and is not implemented: declared so that a non-default value is a 400
    # (sampling.reject_unsupported), never silently dropped.
    use_beam_search: bool = False


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, token ids, or a list of either."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_is_no_logprobs(cls, value: Any) -> Any:
        """``logprobs: false`` (chat's spelling of "none") means no logprobs, not zero top
        log-probabilities per token, which pydantic would make of it; ``true`` stays 1."""
        return None if value is False else value


class ChatMessage(BaseModel):
    """One chat message; fields beyond these (an assistant's ``tool_calls``, a tool message's
    ``tool_call_id`` and ``name``) reach the chat template as sent."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: messages go through the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # OpenAI tool calling (server/tool_calls.py): checked there, a 400 naming the field
    tools: list[Any] | None = None
    tool_choice: Any = None
    # OpenAI's: false allows one call (tool_choice "required": maxItems 1; "auto": the first)
    parallel_tool_calls: bool | None = None
    # OpenAI's deprecated function calling and vLLM's chat ``echo``: rejected unless off
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ResponsesRequest(BaseModel):
    """``POST /v1/responses`` (OpenAI's Responses API), rendered as a chat request
    (server/responses_input.py). Other fields are kept as extras: vLLM's sampling extras and
    chat completions' own fields are looked up there (taken, or a 400 saying what to send
    instead); the rest are ignored, as the other routes ignore unknown fields."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None  # accepted; nothing is stored
    # Change the output and are not implemented: a 400 naming the field unless off
    # (responses_input.reject_unsupported), never silently dropped.
    previous_response_id: str | None = None
    reasoning: Any = None
    include: list[Any] | None = None
    background: bool | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    prompt: Any = None
    conversation: Any = None


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: either ``prompt`` (text) or ``messages`` (through the chat template)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
