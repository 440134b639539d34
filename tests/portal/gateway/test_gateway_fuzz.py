"""Fuzzed bodies and headers never get a 5xx from the gateway (hypothesis): random JSON
documents, valid bodies with fields replaced by odd values, broken bytes, odd Authorization
and content-type headers. Generation stays at most 2 tokens: the fuzz is about input handling."""

from __future__ import annotations

import json

import httpx
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.portal.gateway.conftest import BASE, make_caller  # noqa: E402

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options",
          "temperature", "top_p", "stop", "seed", "logprobs", "top_logprobs", "tenant", "tenant_weight", "user"]
ODD = st.sampled_from([None, True, 0, -1, 1, 2, 129, 10**20, 0.5, "", "x", "🦙", [], [1], ["a"], [[1, 2]], {},
                       {"include_usage": True}, {"include_usage": "yes"}, [{}], [{"role": "user"}],
                       [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "image"}]}],
                       "acme/x", "acme/x@v1", "other/x", BASE])


def bodies():
    chat = {"model": BASE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    completion = {"model": BASE, "prompt": "Hello", "max_tokens": 2}
    mutated = st.tuples(st.sampled_from([chat, completion]),
                        st.dictionaries(st.sampled_from(FIELDS), ODD | json_values, min_size=1, max_size=3))

    def apply(pair):
        base, changes = pair
        body = {**base, **changes}
        if not isinstance(body.get("max_tokens"), int) or body.get("max_tokens", 0) > 2:
            body["max_tokens"] = 2
        body.pop("max_completion_tokens", None)
        if isinstance(body.get("n"), int) and body["n"] > 2:
            body["n"] = 2
        return json.dumps(body).encode()

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


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), body=bodies(), extra=headers)
def test_fuzzed_requests_never_get_a_5xx(http, path, body, extra):
    response = http.post(path, content=body, headers={"content-type": "application/json", **extra})
    assert response.status_code < 500, (response.status_code, body[:200], response.text[:300])
    assert response.headers["x-request-id"].startswith("req_")
    if response.headers.get("content-type", "").startswith("application/json"):
        payload = response.json()
        if response.status_code >= 400:
            assert set(payload["error"]) == {"message", "type", "param", "code"}
