"""A checkpoint's chat template, rendered the way HF `apply_chat_template` renders it.

The template is jinja2 source shipped with the checkpoint (GGUF `tokenizer.chat_template`,
or `chat_template` in tokenizer_config.json / a chat_template.jinja file). Templates are
untrusted code from the internet, so they run in jinja2's immutable sandbox. The
environment matches transformers': `trim_blocks` + `lstrip_blocks`, the `loopcontrols`
extension, a `{% generation %}` tag, `raise_exception(msg)`, `strftime_now(fmt)` and a
`tojson` filter that does not HTML-escape. The template sees `messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, `tools` and `documents`, as in HF.

Messages are validated here, at the edge, so a bad request gets a ValueError naming the
field ("messages[1].role: unknown role 'robot'") instead of a jinja traceback.

    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    prompt = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant", "tool")

# Used when a checkpoint ships no template: plain ChatML (the format SmolLM2, Qwen and many
# other instruct models were trained on). No default system prompt is injected.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: HF marks assistant spans with it (for training
    masks). For inference the block simply renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    # Templates call this to reject a conversation (e.g. roles that do not alternate).
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson HTML-escapes '<', '>' and '&', which would corrupt prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference."""

    def __init__(self, source: str | None, bos_token: str | None = None, eos_token: str | None = None):
        if source is None:
            source = DEFAULT_CHAT_TEMPLATE
        if not isinstance(source, str) or not source.strip():
            raise ValueError("chat_template must be a non-empty string")
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat_template: syntax error on line {exc.lineno}: {exc.message}") from None

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text for `messages` (validated first; see `validate_messages`)."""
        if not isinstance(add_generation_prompt, bool):
            raise ValueError(f"add_generation_prompt must be true or false, got {add_generation_prompt!r}")
        clean = validate_messages(messages)
        if tools is not None and (
            not isinstance(tools, list | tuple) or not all(isinstance(t, Mapping) for t in tools)
        ):
            raise ValueError("tools must be a list of objects")
        try:
            return self._template.render(
                messages=clean,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                tools=[dict(t) for t in tools] if tools is not None else None,
                documents=None,
            )
        except jinja2.TemplateError as exc:
            # raise_exception() from the template, or a template bug the input triggered.
            raise ValueError(f"messages: rejected by the chat template: {exc.message or exc}") from None
        except (TypeError, KeyError, IndexError, AttributeError) as exc:
            raise ValueError(f"messages: the chat template could not render them: {exc}") from None

    def mentions(self, text: str) -> bool:
        """Whether the template source contains `text` (e.g. an end-of-turn token)."""
        return text in self.source


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages and return copies with `content` as plain text.

    Each message is an object with a `role` in ROLES and a `content` that is a string or a
    list of `{"type": "text", "text": ...}` parts (joined with newlines, as vLLM does for
    string-content templates). An assistant message that carries `tool_calls` may have no
    content. Other keys (name, tool_calls, tool_call_id) pass through unchanged.
    """
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    clean = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ValueError(f"{where} must be an object with 'role' and 'content', got {type(message).__name__}")
        if "role" not in message:
            raise ValueError(f"{where}.role is required")
        role = message["role"]
        if not isinstance(role, str) or role not in ROLES:
            raise ValueError(f"{where}.role: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        out = dict(message)
        if message.get("content") is None and role == "assistant" and message.get("tool_calls"):
            out["content"] = None
        else:
            if "content" not in message:
                raise ValueError(f"{where}.content is required")
            out["content"] = _content_text(message["content"], f"{where}.content")
        clean.append(out)
    return clean


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list | tuple):
        raise ValueError(f"{where} must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise ValueError(f"{where}[{j}] must be an object like {{\"type\": \"text\", \"text\": ...}}")
        if part.get("type") != "text":
            raise ValueError(f"{where}[{j}].type: unsupported content part type {part.get('type')!r} (only 'text')")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}].text must be a string")
        texts.append(part["text"])
    return "\n".join(texts)
