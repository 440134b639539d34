"""An evaluation file, checked line by line before anything is stored.

JSONL: one case per non-blank line, an object with
    "prompt": str                  sent to /v1/completions, or
    "messages": [{"role", "content"}, ...]   sent to /v1/chat/completions
    "expected", "check"            optional; check in portal.evals.checks.CHECKS (exact when only
                                   "expected" is given; json_valid takes no expected)
    "max_tokens": int              optional, 1..MAX_TOKENS (DEFAULT_MAX_TOKENS)
    "name": str                    optional, unique in the file (default "line N")
Every refusal names the line and the reason (up to MAX_REPORTED of them, then how many more).

Context length: a case is refused when its prompt's estimated tokens + max_tokens exceed the
base model's context length (max_model_len that the workers report in /v1/base_model, else
DEFAULT_CONTEXT_LENGTH). The estimate is an upper bound, not a guess: one token per UTF-8 byte of
the text (a byte-level BPE or byte-fallback tokenizer never makes more tokens than bytes), plus
TEMPLATE_TOKENS_PER_MESSAGE per chat message and TEMPLATE_TOKENS for the chat template's own text
(a default system prompt and the assistant header). The workers expose no tokenizer route to
count exactly; a case refused here could have fitted, none accepted here can overflow.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from portal.evals.checks import CheckError, compile_check

MAX_CASES = 200
MAX_FILE_BYTES = 1 << 20  # 1 MiB
DEFAULT_MAX_TOKENS = 64
MAX_TOKENS = 256
DEFAULT_CONTEXT_LENGTH = 2048  # when no worker has reported max_model_len
TEMPLATE_TOKENS = 64
TEMPLATE_TOKENS_PER_MESSAGE = 8
MAX_NAME_CHARS = 200
MAX_MESSAGES = 64
ROLES = ("system", "user", "assistant")
FIELDS = ("name", "prompt", "messages", "expected", "check", "max_tokens")
MAX_REPORTED = 20


class EvaluationFileError(ValueError):
    """The file is refused: `problems` are "line N: reason" (or a reason about the whole file)."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


@dataclass(frozen=True)
class ParsedSet:
    cases: list[dict]
    checked_count: int
    size_bytes: int
    sha256: str


def estimate_prompt_tokens(case: dict) -> int:
    """An upper bound on the case's prompt tokens (see the module docstring)."""
    if case.get("messages") is not None:
        return TEMPLATE_TOKENS + sum(
            TEMPLATE_TOKENS_PER_MESSAGE + len(m["content"].encode()) for m in case["messages"]
        )
    return len(case["prompt"].encode())


def parse_cases(data: bytes, *, context_length: int | None, max_cases: int = MAX_CASES,
                max_bytes: int = MAX_FILE_BYTES) -> ParsedSet:
    """The file's cases, normalised; EvaluationFileError listing every refused line otherwise."""
    if len(data) > max_bytes:
        raise EvaluationFileError([f"the file is {len(data)} bytes; the limit is {max_bytes} bytes"])
    context = context_length or DEFAULT_CONTEXT_LENGTH
    problems: list[str] = []
    cases: list[dict] = []
    names: dict[str, int] = {}
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        if len(cases) + len(problems) >= max_cases:
            problems.append(f"line {number}: more than {max_cases} cases (the limit is {max_cases} a set)")
            break
        try:
            case = _case(raw, number, context)
        except _LineError as error:
            problems.append(f"line {number}: {error}")
            continue
        if case["name"] in names:
            problems.append(f"line {number}: the name {case['name']!r} is also used on line {names[case['name']]}")
            continue
        names[case["name"]] = number
        cases.append(case)
    if problems:
        shown = problems[:MAX_REPORTED]
        if len(problems) > MAX_REPORTED:
            shown.append(f"and {len(problems) - MAX_REPORTED} more lines refused")
        raise EvaluationFileError(shown)
    if not cases:
        raise EvaluationFileError(["the file has no cases (one JSON object per line)"])
    checked = sum(1 for c in cases if c["check"])
    if not checked:
        raise EvaluationFileError(["no case has a check: give at least one case 'expected' (and a 'check')"])
    return ParsedSet(cases, checked, len(data), hashlib.sha256(data).hexdigest())


class _LineError(ValueError):
    pass


def _case(raw: bytes, number: int, context: int) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _LineError("not UTF-8 text") from None
    try:
        value = json.loads(text)
    except ValueError as error:
        raise _LineError(f"not JSON ({error})") from None
    if not isinstance(value, dict):
        raise _LineError(f"expected a JSON object, got {_kind(value)}")
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        raise _LineError(f"unknown field{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))} "
                         f"(allowed: {', '.join(FIELDS)})")
    case: dict[str, Any] = {"line": number}

    name = value.get("name", f"line {number}")
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_CHARS:
        raise _LineError(f"'name' must be a non-empty string of at most {MAX_NAME_CHARS} characters")
    case["name"] = name.strip()

    has_prompt, has_messages = "prompt" in value, "messages" in value
    if has_prompt == has_messages:
        raise _LineError("give exactly one of 'prompt' (a string) or 'messages' (a list of chat messages)")
    if has_prompt:
        if not isinstance(value["prompt"], str) or not value["prompt"]:
            raise _LineError("'prompt' must be a non-empty string")
        case["prompt"] = value["prompt"]
    else:
        case["messages"] = _messages(value["messages"])

    check, expected = value.get("check"), value.get("expected")
    if check is None and expected is not None:
        check = "exact"
    if check is not None:
        if not isinstance(check, str):
            raise _LineError(f"'check' must be a string, got {_kind(check)}")
        try:
            compile_check(check, expected)
        except CheckError as error:
            raise _LineError(str(error)) from None
    case["check"], case["expected"] = check, expected

    max_tokens = value.get("max_tokens", DEFAULT_MAX_TOKENS)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_TOKENS:
        raise _LineError(f"'max_tokens' must be an integer from 1 to {MAX_TOKENS}, got {max_tokens!r}")
    case["max_tokens"] = max_tokens

    estimate = estimate_prompt_tokens(case)
    if estimate + max_tokens > context:
        raise _LineError(
            f"over the context length: the prompt may take up to {estimate} tokens (UTF-8 bytes + chat "
            f"template) and max_tokens is {max_tokens}, more than the base model's {context}"
        )
    return case


def _messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise _LineError("'messages' must be a non-empty list of {\"role\", \"content\"} objects")
    if len(messages) > MAX_MESSAGES:
        raise _LineError(f"'messages' has {len(messages)} messages; the limit is {MAX_MESSAGES}")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) - {"role", "content"}:
            raise _LineError(f"messages[{i}] must be an object with only 'role' and 'content'")
        if message.get("role") not in ROLES:
            raise _LineError(f"messages[{i}]: role must be one of {', '.join(ROLES)}, got {message.get('role')!r}")
        if not isinstance(message.get("content"), str):
            raise _LineError(f"messages[{i}]: content must be a string")
        clean.append({"role": message["role"], "content": message["content"]})
    if clean[-1]["role"] == "assistant":
        raise _LineError("the last message must not be the assistant's (the model answers after it)")
    return clean


def _kind(value: Any) -> str:
    return {list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number" if isinstance(value, int | float) else type(value).__name__)
