"""A malformed evaluation file is refused whole, each bad line named with its reason; nothing is
stored (service, REST API and console page alike); a good file replaces the set."""

from __future__ import annotations

import json

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from portal.adapters.services import adapter_create
from portal.core.exceptions import InvalidInput
from portal.evals.models import EvaluationSet
from portal.evals.services import evaluation_set_upload
from portal.evals.validation import MAX_CASES, MAX_FILE_BYTES, EvaluationFileError, parse_cases
from portal.fleet.models import InferenceWorker

GOOD = {"prompt": "Say hi", "expected": "hi", "check": "contains"}


def lines(*cases) -> bytes:
    return "\n".join(c if isinstance(c, str) else json.dumps(c) for c in cases).encode()


def refusal(data: bytes, context_length: int | None = 2048) -> list[str]:
    with pytest.raises(EvaluationFileError) as info:
        parse_cases(data, context_length=context_length)
    return info.value.problems


@pytest.mark.parametrize(("bad", "reason"), [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected a JSON object, got a list"),
    ({"prompt": "x", "expected": "y", "check": "fuzzy"}, "unknown check 'fuzzy'"),
    ({"prompt": "x", "expected": "(unclosed", "check": "regex"}, "bad regex"),
    ({"prompt": "x", "expected": {"type": "nope"}, "check": "json_schema"}, "not a valid JSON Schema"),
    ({"prompt": "x", "expected": "a string", "check": "json_schema"}, "JSON Schema object"),
    ({"prompt": "x", "expected": "y", "check": "json_valid"}, "json_valid takes no 'expected'"),
    ({"prompt": "x", "check": "contains"}, "needs 'expected'"),
    ({"expected": "y"}, "give exactly one of 'prompt'"),
    ({"prompt": "x", "messages": [{"role": "user", "content": "x"}], "expected": "y"}, "exactly one of"),
    ({"messages": [{"role": "robot", "content": "x"}], "expected": "y"}, "role must be one of"),
    ({"prompt": "x", "expected": "y", "max_tokens": 100000}, "'max_tokens' must be an integer from 1 to 256"),
    ({"prompt": "x", "expected": "y", "expect": "typo"}, "unknown field 'expect'"),
    ({"prompt": "word " * 3000, "expected": "y"}, "over the context length"),
])
def test_each_bad_line_is_refused_with_its_number_and_reason(bad, reason):
    problems = refusal(lines(GOOD, "", bad, GOOD))
    assert len(problems) == 1
    assert problems[0].startswith("line 3: "), problems  # the blank line 2 still counts
    assert reason in problems[0], problems


def test_every_bad_line_is_listed_and_not_utf8_is_named():
    problems = refusal(b"\xff\xfe\n" + lines(GOOD, "3") + b"\n" + lines({"prompt": "x", "name": "line 2"}))
    assert problems[0] == "line 1: not UTF-8 text"
    assert problems[1].startswith("line 3: expected a JSON object, got a number")
    assert "the name 'line 2' is also used on line 2" in problems[2]


def test_context_length_comes_from_the_fleet_and_the_estimate_is_an_upper_bound():
    prompt = "é" * 600  # 1200 UTF-8 bytes: up to 1200 tokens
    case = {"prompt": prompt, "expected": "y", "max_tokens": 64}
    assert parse_cases(lines(case), context_length=1264).cases[0]["prompt"] == prompt
    problems = refusal(lines(case), context_length=1263)
    assert "up to 1200 tokens" in problems[0] and "max_tokens is 64" in problems[0] and "1263" in problems[0]


def test_too_many_cases_and_too_many_bytes():
    problems = refusal(lines(*[GOOD] * (MAX_CASES + 1)))
    assert problems == [f"line {MAX_CASES + 1}: more than {MAX_CASES} cases (the limit is {MAX_CASES} a set)"]
    assert "the limit is" in refusal(b" " * (MAX_FILE_BYTES + 1))[0]
    assert refusal(b"\n\n") == ["the file has no cases (one JSON object per line)"]
    assert "no case has a check" in refusal(lines({"prompt": "x"}))[0]


def test_defaults_and_normalisation():
    parsed = parse_cases(lines({"prompt": "x", "expected": " hi "}, {"messages": [{"role": "user", "content": "q"}],
                                                                     "check": "json_valid", "name": "js"}),
                         context_length=None)
    first, second = parsed.cases
    assert first == {"line": 1, "name": "line 1", "prompt": "x", "check": "exact", "expected": " hi ", "max_tokens": 64}
    assert second["name"] == "js" and second["messages"] == [{"role": "user", "content": "q"}]
    assert parsed.checked_count == 2


@pytest.mark.django_db
def test_the_service_stores_nothing_on_refusal_and_the_fleet_context_applies(tenant, member):
    adapter = adapter_create(tenant=tenant, name="bot", actor=member)
    InferenceWorker.objects.create(url="http://w:1", name="w", healthy=True, base_model="base",
                                   base_config={"max_model_len": 100})
    with pytest.raises(InvalidInput) as info:
        evaluation_set_upload(adapter=adapter, data=lines(GOOD, {"prompt": "x" * 50, "expected": "y"}), actor=member)
    assert info.value.field == "file" and info.value.message.startswith("line 2: over the context length")
    assert not EvaluationSet.objects.exists()

    first = evaluation_set_upload(adapter=adapter, data=lines(GOOD), actor=member)
    second = evaluation_set_upload(adapter=adapter, data=lines(GOOD, GOOD | {"name": "two"}), actor=member)
    from portal.evals.selectors import evaluation_set_current

    assert evaluation_set_current(adapter=adapter) == second and second.case_count == 2
    assert EvaluationSet.objects.filter(pk=first.pk).exists()  # history kept for the runs that used it


@pytest.mark.django_db
def test_rest_and_console_refuse_with_the_line_and_store_nothing(tenant, member, api):
    adapter_create(tenant=tenant, name="bot", actor=member)
    url = f"/api/v1/tenants/{tenant.slug}/adapters/bot/evaluation-set/"
    bad = SimpleUploadedFile("cases.jsonl", lines(GOOD, {"prompt": "x", "expected": "y", "check": "fuzzy"}))
    r = api.post(url, {"file": bad}, format="multipart")
    assert r.status_code == 400 and r.json()["field"] == "file"
    assert r.json()["detail"].startswith("line 2: unknown check 'fuzzy'")
    assert api.get(url).status_code == 404

    page = api.post(f"/t/{tenant.slug}/adapters/bot/evaluation/",
                    {"file": SimpleUploadedFile("c.jsonl", b"{oops\n")})
    assert page.status_code == 400 and "line 1: not JSON" in page.content.decode()
    assert not EvaluationSet.objects.exists()

    r = api.post(url, {"file": SimpleUploadedFile("cases.jsonl", lines(GOOD))}, format="multipart")
    assert r.status_code == 201 and r.json()["case_count"] == 1
    assert api.get(url).json()["cases"][0]["check"] == "contains"
    assert api.get(f"/t/{tenant.slug}/adapters/bot/evaluation/").status_code == 200
