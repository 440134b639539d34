"""/v1 goes through the gateway's own handler (portal.gateway.asgi): the portal's middleware,
sessions, CSRF and cookies are not on the API's path; the portal's pages keep all of it."""

import httpx
import pytest

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
async def client():
    from portal.asgi import application

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://127.0.0.1") as c:
        yield c


async def test_api_responses_skip_the_portal_middleware_but_keep_their_headers(client):
    response = await client.get("/v1/models")
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert response.headers["x-request-id"] and response.headers["x-content-type-options"] == "nosniff"
    assert "x-frame-options" not in response.headers and "set-cookie" not in response.headers
    assert "cookie" not in response.headers.get("vary", "").lower()
    # A POST without a CSRF token is an API call like any other, not a 403 from CsrfViewMiddleware.
    response = await client.post("/v1/chat/completions", content=b"{}", headers={"content-type": "application/json"})
    assert response.status_code == 401


async def test_portal_pages_keep_their_middleware(client):
    response = await client.get("/login/")
    assert response.status_code == 200
    assert response.headers["x-frame-options"] == "DENY" and "csrftoken" in response.headers.get("set-cookie", "")
    # /v1 without the slash is not the gateway's: the portal's 404 (or redirect), not an API error.
    assert (await client.get("/v1")).headers.get("x-request-id") is None
