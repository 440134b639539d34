"""Loading an adapter by URL: the worker streams the two PEFT files from a real loopback HTTP
server into its adapter cache, checks sha256 and size, then loads the directory; every failure
is a 400 in OpenAI's shape with the reason, and leaves no partial file and no registered adapter.
Only the configured portal origins are fetched from: any other URL is refused before a request."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import openai
import pytest

from inference.config import ConfigError, parse_origins, url_origin
from inference.server.fetch import FetchError, FetchSettings, check_request
from tests.inference.server.conftest import ADMIN_TOKEN, TINY, TINY_ENGINE
from tests.inference.server.file_server import FILE_TOKEN, PEFT, FileServer
from tests.inference.server.server_process import start_server
from tests.inference.server.tiny_lora import word_prompt

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
MAX_BYTES = 400_000
NOBODY = "http://127.0.0.1:9"  # a listed origin where nothing listens


@pytest.fixture(scope="module")
def files():
    server = FileServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("adapter-cache")


@pytest.fixture(scope="module")
def foreign():
    """Another file server, on an origin the worker is not told about."""
    server = FileServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def worker(tiny_lora, files, cache_dir, tmp_path_factory):
    """The tiny model with its own adapter cache directory and a small size cap, fetching from
    the `files` server's origin (and NOBODY's)."""
    base, _ = tiny_lora
    flags = []
    for name, value in TINY_ENGINE.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    proc = start_server(
        ["--model", str(base), "--served-model-name", TINY, *flags],
        tmp_path_factory.mktemp("server") / "fetch.log",
        env={"INFERENCE_ADMIN_TOKEN": ADMIN_TOKEN, "INFERENCE_ADAPTER_CACHE_DIR": str(cache_dir),
             "INFERENCE_ADAPTER_MAX_BYTES": str(MAX_BYTES), "INFERENCE_PORTAL_ORIGINS": f"{files.url},{NOBODY}"},
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def sdk(worker) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="x", max_retries=0, timeout=120)


def _load(worker, body: dict) -> httpx.Response:
    return httpx.post(f"{worker.url}/v1/load_lora_adapter", json=body, headers=AUTH, timeout=60)


def _names(sdk) -> list[str]:
    return [m.id for m in sdk.models.list().data]


def _complete(sdk, model: str) -> str:
    return sdk.completions.create(model=model, prompt=word_prompt(3, 10), max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text


def test_load_by_url_fetches_checks_and_serves_like_the_local_path(worker, files, tiny_lora, cache_dir, sdk):
    _, adapters = tiny_lora
    digests = files.publish("private/v-ad1", adapters["ad1"])
    r = _load(worker, {"lora_name": "lora-fetched-ad1", "lora_url": f"{files.url}/private/v-ad1/",
                       "files": digests, "auth_token": FILE_TOKEN})
    assert r.status_code == 200, r.text
    assert Path(r.json()["path"]) == cache_dir / "lora-fetched-ad1"
    for name in PEFT:  # the cached bytes are the published ones; no temporary file is left behind
        assert (cache_dir / "lora-fetched-ad1" / name).read_bytes() == (adapters["ad1"] / name).read_bytes()
    assert sorted(p.name for p in (cache_dir / "lora-fetched-ad1").iterdir()) == sorted(PEFT)
    assert {auth for path, auth in files.requests if path.startswith("/private/v-ad1/")} == {f"Bearer {FILE_TOKEN}"}
    assert "lora-fetched-ad1" in _names(sdk)

    assert _load(worker, {"lora_name": "local-ad1", "lora_path": str(adapters["ad1"])}).status_code == 200
    fetched, local, base = _complete(sdk, "lora-fetched-ad1"), _complete(sdk, "local-ad1"), _complete(sdk, TINY)
    assert fetched == local and fetched != base


def test_a_cached_adapter_is_not_fetched_again(worker, files, tiny_lora, sdk):
    _, adapters = tiny_lora
    digests = files.publish("public/v-ad2", adapters["ad2"])
    body = {"lora_name": "lora-cached-ad2", "lora_url": f"{files.url}/public/v-ad2", "files": digests}
    assert _load(worker, body).status_code == 200
    fetched = [p for p, _ in files.requests if p.startswith("/public/v-ad2/")]
    assert sorted(fetched) == sorted(f"/public/v-ad2/{n}" for n in PEFT)
    assert httpx.post(f"{worker.url}/v1/unload_lora_adapter", json={"lora_name": "lora-cached-ad2"},
                      headers=AUTH).status_code == 200
    assert _load(worker, body).status_code == 200  # reloaded from the cache
    assert [p for p, _ in files.requests if p.startswith("/public/v-ad2/")] == fetched
    assert "lora-cached-ad2" in _names(sdk)


def _bad(worker, sdk, cache_dir, name: str, body: dict, *, param: str, code: str | None, needle: str):
    r = _load(worker, {"lora_name": name, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and error["code"] == code, error
    assert needle in error["message"], error
    assert name not in _names(sdk)
    cached = cache_dir / name
    assert not cached.exists() or not any(p.name.endswith(".part") for p in cached.iterdir())
    return error


def test_checksum_mismatch_is_400_and_nothing_is_kept(worker, files, tiny_lora, cache_dir, sdk):
    _, adapters = tiny_lora
    digests = files.publish("public/v-ad3", adapters["ad3"])
    wrong = {**digests, "adapter_model.safetensors": "0" * 64}
    body = {"lora_url": f"{files.url}/public/v-ad3/", "files": wrong}
    error = _bad(worker, sdk, cache_dir, "lora-bad-sha", body, param="files", code="adapter_checksum_mismatch",
                 needle="sha256 mismatch")
    assert digests["adapter_model.safetensors"] in error["message"]
    assert not (cache_dir / "lora-bad-sha" / "adapter_model.safetensors").exists()


def test_http_errors_are_400_with_the_status(worker, files, tiny_lora, cache_dir, sdk):
    _, adapters = tiny_lora
    digests = files.publish("private/v-ad4", adapters["ad4"])
    common = dict(param="lora_url", code="adapter_fetch_failed")
    # no token for a protected source
    _bad(worker, sdk, cache_dir, "lora-no-token", {"lora_url": f"{files.url}/private/v-ad4/", "files": digests},
         needle="HTTP 403", **common)
    # a missing file
    _bad(worker, sdk, cache_dir, "lora-missing", {"lora_url": f"{files.url}/nowhere/", "files": digests},
         needle="HTTP 404", **common)
    # redirects are not followed (the token is only ever sent to lora_url)
    _bad(worker, sdk, cache_dir, "lora-redirect", {"lora_url": f"{files.url}/redirect/v-ad4/", "files": digests},
         needle="HTTP 302", **common)
    # nobody listening
    _bad(worker, sdk, cache_dir, "lora-refused", {"lora_url": f"{NOBODY}/x/", "files": digests},
         needle="ConnectError", **common)


@pytest.mark.parametrize("chunked", [False, True])
def test_too_large_is_400_by_declared_and_actual_size(worker, files, tiny_lora, cache_dir, sdk, chunked):
    _, adapters = tiny_lora
    prefix = "chunked" if chunked else "public"
    big = b"\0" * (MAX_BYTES + 1)
    config = (adapters["ad5"] / "adapter_config.json").read_bytes()
    files.files[f"/{prefix}/big/adapter_config.json"] = config
    files.files[f"/{prefix}/big/adapter_model.safetensors"] = big
    digests = {"adapter_config.json": hashlib.sha256(config).hexdigest(),
               "adapter_model.safetensors": hashlib.sha256(big).hexdigest()}
    name = f"lora-big-{prefix}"
    _bad(worker, sdk, cache_dir, name, {"lora_url": f"{files.url}/{prefix}/big/", "files": digests},
         param="lora_url", code="adapter_too_large", needle=f"limit of {MAX_BYTES} bytes")
    assert not (cache_dir / name / "adapter_model.safetensors").exists()


def test_fetched_but_invalid_adapter_is_400_with_the_validation_reason(worker, files, tiny_lora, cache_dir, sdk):
    _, adapters = tiny_lora
    digests = files.publish("public/v-nan", adapters["bad_nan"])
    error = _bad(worker, sdk, cache_dir, "lora-nan", {"lora_url": f"{files.url}/public/v-nan/", "files": digests},
                 param="lora_path", code="adapter_invalid", needle="lora-nan")
    assert "nan" in error["message"].lower()


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"lora_name": "../escape"}, "lora_name", "cannot name a cache directory"),
        ({"lora_name": "a/b"}, "lora_name", "cannot name a cache directory"),
        ({"lora_url": "file:///etc/"}, "lora_url", "not an http(s) URL"),
        ({"files": {"adapter_config.json": "0" * 64}}, "files", "expected exactly"),
        ({"files": {"../adapter_config.json": "0" * 64, "adapter_model.safetensors": "0" * 64}}, "files",
         "expected exactly"),
        ({"files": {"adapter_config.json": "0" * 64, "adapter_model.safetensors": "0" * 64, "x.bin": "0" * 64}},
         "files", "expected exactly"),
        ({"files": {"adapter_config.json": "nothex", "adapter_model.safetensors": "0" * 64}}, "files", "sha256"),
        ({"files": None}, "files", "lora_url needs files"),
        ({"lora_path": "/tmp"}, "lora_path", "exactly one of"),
    ],
)
def test_malformed_fetch_requests_are_400_naming_the_field(worker, files, sdk, cache_dir, body, param, needle):
    full = {"lora_name": "lora-malformed", "lora_url": f"{files.url}/public/x/",
            "files": {n: "0" * 64 for n in PEFT}, **body}
    full = {k: v for k, v in full.items() if v is not None}
    r = _load(worker, full)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error
    assert full["lora_name"] not in _names(sdk)
    assert not (cache_dir.parent / "escape").exists()


def test_neither_path_nor_url_is_400(worker):
    r = _load(worker, {"lora_name": "lora-none"})
    assert r.status_code == 400 and "exactly one of" in r.json()["error"]["message"]


def test_fetch_settings_and_checks_without_a_server(tmp_path):
    s = FetchSettings.from_env({"INFERENCE_ADAPTER_CACHE_DIR": str(tmp_path), "INFERENCE_ADAPTER_MAX_BYTES": "10"})
    assert s.cache_dir == tmp_path and s.max_bytes == 10 and s.timeout == 300.0
    assert FetchSettings.from_env({}).cache_dir == Path("var/adapter-cache")
    for bad in ("0", "-1", "ten"):
        with pytest.raises(ValueError, match="INFERENCE_ADAPTER_MAX_BYTES"):
            FetchSettings.from_env({"INFERENCE_ADAPTER_MAX_BYTES": bad})
    digests = {n: "A" * 64 for n in PEFT}
    origins = ("https://h:443",)
    assert check_request(lora_name="lora-x", lora_url="https://h/x/", files=digests,
                         allowed_origins=origins) == {n: "a" * 64 for n in PEFT}
    for name in (".", "..", "", ".hidden", "x" * 201):
        with pytest.raises(FetchError):
            check_request(lora_name=name, lora_url="https://h/x/", files=digests, allowed_origins=origins)


def test_lora_url_outside_the_portal_origins_is_refused_before_any_request(worker, files, foreign, tiny_lora,
                                                                             cache_dir, sdk):
    _, adapters = tiny_lora
    digests = foreign.publish("public/v-ad6", adapters["ad6"])
    assert files.publish("public/v-ad6", adapters["ad6"]) == digests
    port = files.url.rsplit(":", 1)[1]
    not_listed = "is not one of this worker's portal origins: add it to INFERENCE_PORTAL_ORIGINS"
    for i, (url, needle) in enumerate([
        (f"{foreign.url}/public/v-ad6/", not_listed),  # same host, another port
        (f"http://localhost:{port}/public/v-ad6/", not_listed),  # the same server under another host name
        (f"https://127.0.0.1:{port}/public/v-ad6/", not_listed),  # another scheme
        (f"http://user:pw@127.0.0.1:{port}/public/v-ad6/", "credentials"),
        (f"http://127.0.0.1:{port}@{foreign.url[7:]}/public/v-ad6/", "credentials"),
    ]):
        _bad(worker, sdk, cache_dir, f"lora-forbidden-{i}", {"lora_url": url, "files": digests},
             param="lora_url", code="adapter_source_forbidden", needle=needle)
        assert not (cache_dir / f"lora-forbidden-{i}").exists()
    assert foreign.requests == []
    assert [p for p, _ in files.requests if p.startswith("/public/v-ad6/")] == []

    # The listed origin, however it is spelled, is fetched from.
    r = _load(worker, {"lora_name": "lora-listed-ad6", "lora_url": f"HTTP://127.0.0.1:{port}/public/v-ad6/",
                       "files": digests})
    assert r.status_code == 200, r.text
    assert sorted(p for p, _ in files.requests if p.startswith("/public/v-ad6/")) == [
        f"/public/v-ad6/{n}" for n in PEFT]
    assert foreign.requests == []


def test_without_portal_origins_nothing_is_fetched_by_url(lora_server, tiny_lora, foreign):
    """lora_server has an admin token and no INFERENCE_PORTAL_ORIGINS: loads by URL are refused,
    loads by local path still work."""
    _, adapters = tiny_lora
    before = len(foreign.requests)
    digests = foreign.publish("public/v-ad7", adapters["ad7"])
    r = _load(lora_server, {"lora_name": "lora-no-origins", "lora_url": f"{foreign.url}/public/v-ad7/",
                            "files": digests})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "lora_url" and error["code"] == "adapter_source_forbidden", error
    assert "none is configured: set INFERENCE_PORTAL_ORIGINS" in error["message"]
    assert len(foreign.requests) == before
    r = _load(lora_server, {"lora_name": "lora-by-path-ad7", "lora_path": str(adapters["ad7"])})
    assert r.status_code == 200, r.text
    names = [a["name"] for a in httpx.get(f"{lora_server.url}/v1/adapters", headers=AUTH).json()["data"]]
    assert "lora-by-path-ad7" in names and "lora-no-origins" not in names
    httpx.post(f"{lora_server.url}/v1/unload_lora_adapter", json={"lora_name": "lora-by-path-ad7"}, headers=AUTH)


def test_origins_are_compared_by_scheme_host_and_effective_port():
    assert url_origin("HTTP://Portal.Internal/internal/adapters/x/") == "http://portal.internal:80"
    assert url_origin("https://portal:443/x") == url_origin("https://PORTAL/") == "https://portal:443"
    assert url_origin("http://[::1]:8000/x/") == "http://[::1]:8000"
    assert url_origin("http://portal:8000/x") != url_origin("https://portal:8000/x")
    for bad in ("ftp://portal/x", "file:///etc/", "http://u:p@portal/", "http://portal\\@evil/", "http://p:0/",
                "http://p:70000/", "http:///x", "portal:8000"):
        with pytest.raises(ValueError):
            url_origin(bad)
    assert parse_origins("V", " http://Portal:8000/ , https://portal.example,http://portal:8000") == (
        "http://portal:8000", "https://portal.example:443")
    assert parse_origins("V", "") == ()
    for bad in ("portal:8000", "http://portal/internal/", "http://u@portal", "ftp://portal", "http://p:0",
                "http://portal?x", "http://port al"):
        with pytest.raises(ConfigError, match="^V: "):
            parse_origins("V", bad)
