"""Chat templates: our rendering against transformers' apply_chat_template, and bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.models.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate, validate_messages
from inference.models.tokenizer import Tokenizer, load_tokenizer

CONVERSATIONS = {
    "system and multi-turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another one, please?"},
    ],
    "no system message (SmolLM2 injects its own)": [
        {"role": "user", "content": "Hello!"},
    ],
    "no system, several turns": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about {braces} and <tags> & ampersands."},
    ],
    "ends with an assistant turn": [
        {"role": "system", "content": ""},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ],
    "unicode and newlines": [
        {"role": "user", "content": "Traduis : « bonjour »\n\n中文 🎉\n  indented"},
    ],
    "tool result": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check."},
        {"role": "tool", "content": '{"temp_c": 21}'},
    ],
}


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Tokenizer:
    return load_tokenizer(smollm2_path)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_smollm2_template_matches_hf(tok: Tokenizer, hf_smollm2_tokenizer, name: str,
                                     add_generation_prompt: bool) -> None:
    messages = CONVERSATIONS[name]
    expected = hf_smollm2_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_smollm2_template_injects_its_default_system_prompt(tok: Tokenizer) -> None:
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_rendered_prompt_encodes_like_hf(tok: Tokenizer, hf_smollm2_tokenizer) -> None:
    messages = CONVERSATIONS["system and multi-turn"]
    expected = hf_smollm2_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if not isinstance(expected, list):  # transformers 5 returns a BatchEncoding
        expected = expected["input_ids"]
    assert tok.encode(tok.apply_chat_template(messages)) == list(expected)


def test_text_parts_are_joined(tok: Tokenizer) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    assert tok.apply_chat_template([{"role": "user", "content": parts}]) == tok.apply_chat_template(
        [{"role": "user", "content": "first\nsecond"}]
    )


HF_TEMPLATE_FEATURES = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if loop.previtem is defined and loop.previtem['role'] == m['role'] %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}"
    "{% if m['role'] == 'system' %}{% continue %}{% endif %}"
    "{% generation %}{{ m['role'] }}: {{ m['content'] | tojson }}{% endgeneration %}\n"
    "{% endfor %}"
    "{% if tools %}tools={{ tools | tojson }}\n{% endif %}"
    "{% if add_generation_prompt %}assistant:{% endif %}{{ eos_token if not add_generation_prompt }}"
)


def test_hf_template_features(hf_smollm2_tokenizer) -> None:
    """bos/eos variables, loop controls, the generation tag, tojson without HTML escaping,
    raise_exception, tools: same output as transformers for the same template."""
    template = ChatTemplate(HF_TEMPLATE_FEATURES, bos_token="<|im_start|>", eos_token="<|im_end|>")
    messages = [
        {"role": "system", "content": "skipped"},
        {"role": "user", "content": "<b>\"quoted\" & 中文</b>"},
        {"role": "assistant", "content": "ok"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for add in (True, False):
        expected = hf_smollm2_tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=HF_TEMPLATE_FEATURES, tokenize=False, add_generation_prompt=add
        )
        assert template.render(messages, add_generation_prompt=add, tools=tools) == expected
    assert '"<b>\\"quoted\\" & 中文</b>"' in template.render(messages)

    with pytest.raises(ValueError, match="rejected by the chat template: roles must alternate"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_default_template_is_chatml() -> None:
    template = ChatTemplate(None)
    assert template.source == DEFAULT_CHAT_TEMPLATE
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert template.render(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    )


def test_template_cannot_escape_the_sandbox() -> None:
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ValueError, match="rejected by the chat template"):
        ChatTemplate(evil).render([{"role": "user", "content": "x"}])


def test_template_syntax_error_is_reported() -> None:
    with pytest.raises(ValueError, match="chat_template: syntax error on line 1"):
        ChatTemplate("{% for m in messages %}")


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "messages must be a non-empty list"),
        ("hello", "messages must be a non-empty list"),
        (None, "messages must be a non-empty list"),
        (["hi"], r"messages\[0\] must be an object with 'role' and 'content', got str"),
        ([{"content": "hi"}], r"messages\[0\]\.role is required"),
        ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}],
         r"messages\[1\]\.role: unknown role 'robot'"),
        ([{"role": 3, "content": "a"}], r"messages\[0\]\.role: unknown role 3"),
        ([{"role": "user"}], r"messages\[0\]\.content is required"),
        ([{"role": "user", "content": 42}], r"messages\[0\]\.content must be a string or a list of text parts, got int"),
        ([{"role": "user", "content": None}], r"messages\[0\]\.content must be a string or a list of text parts"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
         r"messages\[0\]\.content\[0\]\.type: unsupported content part type 'image_url'"),
        ([{"role": "user", "content": [{"type": "text"}]}], r"messages\[0\]\.content\[0\]\.text must be a string"),
        ([{"role": "user", "content": ["plain"]}], r"messages\[0\]\.content\[0\] must be an object"),
    ],
)
def test_bad_messages_are_rejected_naming_the_field(tok: Tokenizer, messages, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tok.apply_chat_template(messages)


def test_bad_flags_are_rejected(tok: Tokenizer) -> None:
    ok = [{"role": "user", "content": "x"}]
    with pytest.raises(ValueError, match="add_generation_prompt must be true or false"):
        tok.apply_chat_template(ok, add_generation_prompt="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tools must be a list of objects"):
        tok.apply_chat_template(ok, tools="f")  # type: ignore[arg-type]


def test_validation_leaves_the_callers_messages_alone() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}], "name": "bob"}]
    clean = validate_messages(messages)
    assert clean == [{"role": "user", "content": "a", "name": "bob"}]
    assert messages[0]["content"] == [{"type": "text", "text": "a"}]


def test_assistant_tool_call_may_have_no_content() -> None:
    calls = [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
    clean = validate_messages([{"role": "assistant", "content": None, "tool_calls": calls}])
    assert clean[0]["content"] is None and clean[0]["tool_calls"] == calls


def test_template_failing_on_valid_input_gives_value_error(tok: Tokenizer) -> None:
    # SmolLM2's template concatenates content, so a content-less tool-call turn cannot render.
    calls = [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
    with pytest.raises(ValueError, match="messages: the chat template could not render them"):
        tok.apply_chat_template([{"role": "assistant", "content": None, "tool_calls": calls}])
