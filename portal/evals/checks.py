"""How a case's output is judged. Shared by upload validation (a check is compiled once there, so
a bad regex or schema is refused with its line) and the run (the output judged).

    exact        the output, surrounding whitespace stripped, equals `expected` (stripped too)
    contains     `expected` occurs in the output
    regex        the pattern `expected` matches somewhere in the output (re.search semantics,
                 the `regex` module with a time limit, so a catastrophic pattern cannot hang a run)
    json_valid   the output (stripped) is one JSON value; no `expected`
    json_schema  the output is JSON and valid against the schema `expected` (Draft 2020-12)
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import regex

CHECKS = ("exact", "contains", "regex", "json_valid", "json_schema")
REGEX_TIMEOUT = 1.0  # seconds one match may take
REGEX_MAX_CHARS = 1000
DETAIL_CHARS = 300


class CheckError(ValueError):
    """A check that cannot be used (bad regex, bad schema, wrong `expected` type)."""


def compile_check(check: str, expected: Any) -> None:
    """Raise CheckError saying why `check` with `expected` cannot judge anything."""
    if check not in CHECKS:
        raise CheckError(f"unknown check {check!r} (use one of {', '.join(CHECKS)})")
    if check == "json_valid":
        if expected is not None:
            raise CheckError("json_valid takes no 'expected' (it only asks for valid JSON)")
        return
    if expected is None:
        raise CheckError(f"the check {check!r} needs 'expected'")
    if check == "json_schema":
        if not isinstance(expected, dict):
            raise CheckError(f"json_schema needs 'expected' to be a JSON Schema object, got {type(expected).__name__}")
        try:
            jsonschema.Draft202012Validator.check_schema(expected)
        except jsonschema.SchemaError as error:
            raise CheckError(f"'expected' is not a valid JSON Schema: {error.message}") from None
        return
    if not isinstance(expected, str):
        raise CheckError(f"{check} needs 'expected' to be a string, got {type(expected).__name__}")
    if check == "regex":
        if len(expected) > REGEX_MAX_CHARS:
            raise CheckError(f"the regex is {len(expected)} characters; the limit is {REGEX_MAX_CHARS}")
        try:
            regex.compile(expected)
        except regex.error as error:
            raise CheckError(f"bad regex {expected!r}: {error}") from None


def judge(check: str | None, expected: Any, output: str) -> tuple[bool | None, str]:
    """(passed, why not) for one output; passed is None for a case without a check."""
    if not check:
        return None, ""
    if check == "exact":
        ok = output.strip() == expected.strip()
        return ok, "" if ok else f"expected exactly {_short(expected.strip())}"
    if check == "contains":
        ok = expected in output
        return ok, "" if ok else f"{_short(expected)} not found in the output"
    if check == "regex":
        try:
            ok = regex.search(expected, output, timeout=REGEX_TIMEOUT) is not None
        except TimeoutError:
            return False, f"the regex took longer than {REGEX_TIMEOUT:g} s on this output"
        return ok, "" if ok else f"no match for the regex {_short(expected)}"
    try:
        value = json.loads(output.strip())
    except ValueError as error:
        return False, f"the output is not JSON ({error})"
    if check == "json_valid":
        return True, ""
    problem = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(expected).iter_errors(value))
    if problem is None:
        return True, ""
    where = "/".join(str(p) for p in problem.absolute_path)
    return False, _cut(f"does not match the schema{f' at /{where}' if where else ''}: {problem.message}")


def _short(text: str) -> str:
    return repr(text) if len(text) <= 80 else repr(text[:77] + "...")


def _cut(text: str) -> str:
    return text if len(text) <= DETAIL_CHARS else text[: DETAIL_CHARS - 3] + "..."
