"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes; ``vllm bench serve`` uses them)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from .chat import render_chat
from .errors import bad_request
from .protocol import DetokenizeRequest, TokenizeRequest
from .serving import Serving


async def tokenize(serving: Serving, request: Request) -> JSONResponse:
    req = await serving.parse(request, TokenizeRequest)
    serving.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of prompt or messages", "prompt")
    if req.messages is not None:
        text = render_chat(serving, req.messages, req.add_generation_prompt,
                           req.continue_final_message, req.chat_template_kwargs,
                           req.chat_template, req.tools)
        add_special = bool(req.add_special_tokens)  # the template already has them
    else:
        text = req.prompt
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
    ids = serving.encode(text, add_special, "messages" if req.messages is not None else "prompt")
    strs = serving.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": serving.max_model_len,
                         "tokens": ids, "token_strs": strs})


async def detokenize(serving: Serving, request: Request) -> JSONResponse:
    req = await serving.parse(request, DetokenizeRequest)
    serving.check_model(req.model)
    bad = [t for t in req.tokens if not 0 <= t < serving.vocab_size]
    if bad:
        raise bad_request(f"token ids {bad[:5]} are outside the vocabulary [0, {serving.vocab_size})",
                          "tokens")
    tok = serving.require_tokenizer("detokenize")
    return JSONResponse({"prompt": tok.decode(req.tokens)})
