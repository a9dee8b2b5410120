"""``LLM.chat`` (vLLM's offline chat): conversations through a chat template, then ``generate``;
the renderer is the server's (``laguna_dflash/chat_template.py``), and bad input is a
``ValueError`` naming the argument."""

from __future__ import annotations

from pathlib import Path

import pytest

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.chat_template import read_chat_template, render_messages

DEMO = Path(__file__).resolve().parents[1] / "assets" / "demo"
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if tools %}[{{ tools | length }} tools]{% endif %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(DEMO / "target"), draft=str(DEMO / "draft"))


def test_chat_renders_then_generates_as_generate_does(llm):
    """One conversation: the template's text (no special tokens added: the template writes
    them) is the prompt, and the tokens are those ``generate`` gives for the same ids, with the
    drafter as without it (lossless)."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]
    out, = llm.chat(messages, GREEDY, chat_template=TEMPLATE)
    assert out.prompt == "<system>be brief<user>def add(a, b):<assistant>"
    ids = llm.tokenizer.encode(out.prompt, add_special_tokens=False)
    assert out.prompt_token_ids == ids
    plain, = llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY)
    assert out.token_ids == plain.token_ids and len(out.token_ids) == 6
    target_only = LLM(str(DEMO / "target"))
    again, = target_only.chat(messages, GREEDY, chat_template=TEMPLATE)
    assert again.token_ids == out.token_ids


def test_chat_takes_a_batch_files_tools_and_continuation(llm, tmp_path):
    """A list of conversations gives one output each, in order; ``chat_template`` may be a file;
    ``tools`` reach the template; ``continue_final_message`` leaves the last message open (no
    generation prompt); text content parts are joined."""
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    first = [{"role": "user", "content": "x = 1"}]
    second = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    outs = llm.chat([first, second], GREEDY, chat_template=str(path))
    assert [o.prompt for o in outs] == ["<user>x = 1<assistant>", "<user>a\nb<assistant>"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    out, = llm.chat(first, GREEDY, chat_template=TEMPLATE, tools=tools)
    assert out.prompt == "<user>x = 1[1 tools]<assistant>"
    out, = llm.chat(first + [{"role": "assistant", "content": "y"}], GREEDY, chat_template=TEMPLATE,
                    continue_final_message=True)
    assert out.prompt == "<user>x = 1<assistant>y"
    assert llm.chat([], GREEDY, chat_template=TEMPLATE) == []


@pytest.mark.parametrize("kwargs,needle", [
    ({}, "has no chat template; pass chat_template="),
    ({"chat_template": "/no/such/file.jinja"}, "chat_template= '/no/such/file.jinja': no such file"),
    ({"chat_template": TEMPLATE, "chat_template_kwargs": {"tokenize": True}},
     "chat_template_kwargs: chat_template_kwargs may not set tokenize"),
    ({"chat_template": "{{ raise_exception('no system role') }}"}, "messages: the chat template failed"),
])
def test_chat_errors_name_the_argument(llm, kwargs, needle):
    """No template, a template path that does not exist, a reserved template argument and a
    failing template are ``ValueError``\\ s naming the argument at fault."""
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, **kwargs)


@pytest.mark.parametrize("messages,needle", [
    ("hi", "messages must be a conversation"),
    ([{"content": "no role"}], 'a chat message is a dict with a "role"'),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "content part type 'image_url' is not supported"),
    ([{"role": "user", "content": 5}], "content must be a string or a list of text parts"),
])
def test_chat_bad_messages_name_the_field(llm, messages, needle):
    with pytest.raises(ValueError, match=needle):
        llm.chat(messages, GREEDY, chat_template=TEMPLATE)


def test_renderer_and_template_reader_alone(tmp_path):
    """The shared renderer: ``chat_template_kwargs`` over the flags (its own tools win); the
    reader: a file's text or template text, else an error naming the flag it was given by."""

    class Tok:
        chat_template = None

        @staticmethod
        def apply_chat_template(messages, tokenize, **kwargs):
            assert tokenize is False
            return f"{len(messages)}|{kwargs.get('add_generation_prompt')}|{kwargs.get('tools')}"

    msgs = [{"role": "user", "content": None}]
    assert render_messages(Tok(), msgs, chat_template="t") == "1|True|None"
    assert render_messages(Tok(), msgs, chat_template="t", continue_final_message=True) == "1|False|None"
    assert render_messages(Tok(), msgs, chat_template="t", tools=[1],
                           chat_template_kwargs={"tools": [2], "add_generation_prompt": False}) == "1|False|[2]"
    path = tmp_path / "t.jinja"
    path.write_text("{{ x }}")
    assert read_chat_template(str(path)) == "{{ x }}" and read_chat_template("{% x %}") == "{% x %}"
    assert read_chat_template(None) is None
    long = "{% for m in messages %}{{ m['content'] }}{% endfor %}" * 8  # longer than a file name may be
    assert read_chat_template(long) == long
    with pytest.raises(ValueError, match="--chat-template 'plain': no such file"):
        read_chat_template("plain")
    with pytest.raises(ValueError, match="chat_template= must be"):
        read_chat_template(3, "chat_template=")


def test_get_tokenizer_is_the_models_as_in_vllm(llm, tmp_path):
    """vLLM scripts render chats with ``llm.get_tokenizer().apply_chat_template(...)``; the
    method did not exist. It is the tokenizer the engine encodes with, None without one."""
    from laguna_dflash.models.random_init import write_random_pair

    tok = llm.get_tokenizer()
    assert tok is llm.tokenizer and tok.encode("def f():") == llm.tokenizer.encode("def f():")
    text = "def add(a, b):"
    out, = llm.generate([text], GREEDY)
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=True)
    target, _ = write_random_pair(tmp_path / "pair")
    assert LLM(str(target)).get_tokenizer() is None
