"""Fuzzed bodies and headers never get a 5xx from the gateway (hypothesis): random JSON
documents, valid bodies with fields replaced by odd values (integers past 2**63, NULs and lone
surrogate escapes in strings, fields the API does not support), broken bytes, odd Authorization
and content-type headers. Every error is OpenAI-shaped JSON and every authenticated request
leaves its ledger row. Generation stays at most 2 tokens: the fuzz is about input handling."""

from __future__ import annotations

import json

import httpx
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.portal.gateway.conftest import BASE, make_caller  # noqa: E402

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options",
          "temperature", "top_p", "stop", "seed", "logprobs", "top_logprobs", "tenant", "tenant_weight", "user",
          "tools", "tool_choice", "response_format", "logit_bias", "functions", "cache_salt"]
ODD = st.sampled_from([None, True, 0, -1, 1, 2, 129, 10**20, 2**63, 2**64 + 1, 0.5, "", "x", "🦙", "\x00",
                       "\ud800", f"{BASE}\x00", "a\udfffb", [], [1], ["a"], [[1, 2]], {},
                       {"type": "json_object"}, {"type": "text"}, [{"type": "function"}], {"50256": -100},
                       {"include_usage": True}, {"include_usage": "yes"}, [{}], [{"role": "user"}],
                       [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "image"}]}],
                       "acme/x", "acme/x@v1", "other/x", BASE])


def bodies():
    chat = {"model": BASE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    completion = {"model": BASE, "prompt": "Hello", "max_tokens": 2}
    mutated = st.tuples(st.sampled_from([chat, completion]),
                        st.dictionaries(st.sampled_from(FIELDS), ODD | json_values, min_size=1, max_size=3))

    def small(value) -> bool:  # a count the gateway passes on: keep generation short
        return value is None or (isinstance(value, int) and not isinstance(value, bool) and 2 < value < 2**31)

    def apply(pair):
        base, changes = pair
        body = {**base, **changes}
        if small(body.get("max_tokens")):
            body["max_tokens"] = 2
        if small(body.get("max_completion_tokens")):
            body.pop("max_completion_tokens", None)
        if isinstance(body.get("n"), int) and body["n"] > 2:
            body["n"] = 2
        return json.dumps(body).encode()  # lone surrogates and NULs travel as \ud800 / \u0000

    return st.one_of(
        mutated.map(apply),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=64),
        st.sampled_from([b"", b"{", b"[]", b'{"model": NaN}', b"\xff\xfe", b'{"a":' * 3000]),
    )


headers = st.fixed_dictionaries({}, optional={
    "authorization": st.sampled_from(["Bearer", "Basic x", "bearer sk-x", "Bearer sk-" + "a" * 300]),
    "content-type": st.sampled_from(["text/plain", "application/json; charset=latin-1", "multipart/form-data"]),
    "x-request-id": st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
})


@pytest.fixture
def http(live):
    caller = make_caller("acme")
    with httpx.Client(base_url=live.url, timeout=120) as client:
        client.headers["authorization"] = f"Bearer {caller.key}"
        yield client


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), body=bodies(), extra=headers)
# The classes that once got Django's HTML 500 (and, for the NUL, no ledger row), always tried:
@example(path="/v1/chat/completions", extra={},
         body=b'{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 9223372036854775808}'
         % BASE.encode())
@example(path="/v1/chat/completions", extra={},
         body=b'{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 1e400}'
         % BASE.encode())
@example(path="/v1/completions", extra={}, body=b'{"model": "%s", "prompt": "x\\ud800", "max_tokens": 2}' % BASE.encode())
@example(path="/v1/chat/completions", extra={},
         body=b'{"model": "%s\\u0000", "messages": [{"role": "user", "content": "Hi"}]}' % BASE.encode())
@example(path="/v1/chat/completions", extra={},
         body=b'{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, '
              b'"response_format": {"type": "json_object"}}' % BASE.encode())
def test_fuzzed_requests_never_get_a_5xx(http, path, body, extra):
    from portal.usage.models import UsageRecord

    response = http.post(path, content=body, headers={"content-type": "application/json", **extra})
    assert response.status_code < 500, (response.status_code, body[:200], response.text[:300])
    request_id = response.headers["x-request-id"]
    assert request_id.startswith("req_")
    assert response.headers["content-type"].startswith("application/json"), response.text[:300]
    payload = response.json()
    if response.status_code >= 400:
        assert set(payload["error"]) == {"message", "type", "param", "code"}
    if response.status_code not in (401, 403):  # authenticated: written before the answer
        row = UsageRecord.objects.get(request_id=request_id)
        assert row.status_code == response.status_code
