"""Fetch a PEFT adapter over HTTP into the worker's local adapter cache, checked by sha256.

    POST /v1/load_lora_adapter {"lora_name": "lora-3f2a...", "lora_url": "http://portal/internal/adapters/<uid>/",
                                "files": {"adapter_config.json": "<sha256>", "adapter_model.safetensors": "<sha256>"},
                                "auth_token": "<sent as Authorization: Bearer to lora_url, optional>"}

Each file is streamed from `lora_url + filename` into a temporary file in
`<cache dir>/<lora_name>/`, hashed on the way, checked against its sha256 and the size cap,
and only then renamed over its final name (os.replace: atomic; a reader never sees half a
file, two concurrent fetches of one adapter both write verified bytes). Files already in the
cache with the right sha256 are not fetched again (the name is an immutable version id).

Only the configured portal origins are fetched from (INFERENCE_PORTAL_ORIGINS or
--portal-origins; inference/config.py AccessConfig): a `lora_url` on any other scheme, host or
port, or carrying user:password@, is a 400 adapter_source_forbidden before anything is
requested, so the adapter routes cannot be used to reach arbitrary hosts or to plant arbitrary
files. With no origin configured nothing is fetched by URL (a local `lora_path` still loads).

The auth token travels in the request body (never logged, never stored) so the worker needs
no extra configuration to read from the portal; redirects are not followed, so it is only
ever sent to `lora_url` itself (and thus to a portal origin).

Settings (environment, read at start-up by `inference serve`: a bad value is a config error; safe defaults):
    INFERENCE_ADAPTER_CACHE_DIR        where fetched adapters live (default var/adapter-cache)
    INFERENCE_ADAPTER_MAX_BYTES        the largest adapter_model.safetensors accepted (default 1 GiB)
    INFERENCE_ADAPTER_FETCH_TIMEOUT    seconds a whole fetch may take (default 300)
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import tempfile
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from inference.config import url_origin
from protocol import worker_api
from protocol.adapter_format import ADAPTER_FILES, CONFIG_FILE

MAX_CONFIG_BYTES = 1 << 20  # a PEFT config is a few KB
CHUNK = 1 << 16

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# A cache directory name: no separators, no dot-only names, no surprises on any filesystem.
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


class FetchError(Exception):
    """The adapter could not be fetched; `param` names the request field, `code` the kind:
    adapter_fetch_failed (HTTP/network: may be transient), adapter_checksum_mismatch,
    adapter_too_large, adapter_source_forbidden (lora_url is not on a configured portal
    origin), or None for a malformed request."""

    def __init__(self, message: str, *, param: str, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True)
class FetchSettings:
    cache_dir: Path
    max_bytes: int
    timeout: float

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> FetchSettings:
        env = os.environ if env is None else env
        cache_dir = Path(env.get("INFERENCE_ADAPTER_CACHE_DIR") or "var/adapter-cache").expanduser()
        max_bytes = _positive(env, "INFERENCE_ADAPTER_MAX_BYTES", 1 << 30, int)
        timeout = _positive(env, "INFERENCE_ADAPTER_FETCH_TIMEOUT", 300.0, float)
        return cls(cache_dir=cache_dir, max_bytes=max_bytes, timeout=timeout)


def _positive(env, key: str, default, kind):
    raw = env.get(key)
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{key}: expected a number, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{key}: must be > 0, got {raw!r}")
    return value


def check_source(lora_url: str, allowed_origins: Collection[str]) -> None:
    """FetchError (adapter_source_forbidden) unless lora_url is on one of the allowed origins
    (normalized as inference.config.url_origin does: exact scheme, host and port)."""
    hint = "INFERENCE_PORTAL_ORIGINS (or --portal-origins)"
    if not allowed_origins:
        raise FetchError(f"lora_url: this worker fetches adapters only from its portal origins and none is "
                         f"configured: set {hint} to the portal's origin, e.g. http://portal:8000",
                         param="lora_url", code=worker_api.ADAPTER_SOURCE_FORBIDDEN)
    try:
        origin = url_origin(lora_url)
    except ValueError as exc:
        raise FetchError(f"lora_url: {exc}", param="lora_url", code=worker_api.ADAPTER_SOURCE_FORBIDDEN) from None
    if origin not in allowed_origins:
        raise FetchError(f"lora_url: {origin} is not one of this worker's portal origins: add it to {hint} "
                         "if adapters should be fetched from it", param="lora_url", code=worker_api.ADAPTER_SOURCE_FORBIDDEN)


def check_request(*, lora_name: str, lora_url: str, files: dict, allowed_origins: Collection[str]) -> dict[str, str]:
    """The request's fields as the fetch needs them, or FetchError naming the bad one."""
    if not _SAFE_NAME.match(lora_name) or lora_name in (".", ".."):
        raise FetchError(
            f"lora_name: {lora_name!r} cannot name a cache directory (letters, digits, '.', '_', '-'; "
            "at most 200; loading by lora_url needs such a name)", param="lora_name")
    parts = urlsplit(lora_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchError(f"lora_url: not an http(s) URL: {_safe_url(lora_url)!r}", param="lora_url")
    check_source(lora_url, allowed_origins)
    if not isinstance(files, dict) or set(files) != set(ADAPTER_FILES):
        got = sorted(files) if isinstance(files, dict) else type(files).__name__
        raise FetchError(f"files: expected exactly {list(ADAPTER_FILES)} with their sha256, got {got}", param="files")
    out = {}
    for name, digest in files.items():
        if not isinstance(digest, str) or not _SHA256.match(digest.lower()):
            raise FetchError(f"files: {name}: expected a sha256 hex digest", param="files")
        out[name] = digest.lower()
    return out


async def fetch_adapter(*, lora_name: str, lora_url: str, files: dict, allowed_origins: Collection[str],
                        auth_token: str | None = None, settings: FetchSettings | None = None,
                        transport: httpx.AsyncBaseTransport | None = None) -> Path:
    """Fetch the adapter's files into the cache; returns its directory. Raises FetchError
    (before any request or cache write when lora_url is not on one of `allowed_origins`)."""
    settings = settings or FetchSettings.from_env()
    expected = check_request(lora_name=lora_name, lora_url=lora_url, files=files, allowed_origins=allowed_origins)
    target = settings.cache_dir / lora_name
    await asyncio.to_thread(target.mkdir, parents=True, exist_ok=True)
    missing = [name for name in ADAPTER_FILES if not await asyncio.to_thread(_has, target / name, expected[name])]
    if not missing:
        return target
    headers = {"authorization": f"Bearer {auth_token}"} if auth_token else {}
    base = lora_url if lora_url.endswith("/") else lora_url + "/"
    timeout = httpx.Timeout(30.0, connect=5.0)
    try:
        async with asyncio.timeout(settings.timeout):
            async with httpx.AsyncClient(timeout=timeout, follow_redirects=False, trust_env=False,
                                         transport=transport) as client:
                for name in missing:
                    limit = MAX_CONFIG_BYTES if name == CONFIG_FILE else settings.max_bytes
                    await _fetch_one(client, base + name, target / name, expected[name], limit, headers)
    except TimeoutError:
        raise FetchError(f"fetching from {_safe_url(base)} took longer than {settings.timeout:g}s",
                         param="lora_url", code=worker_api.ADAPTER_FETCH_FAILED) from None
    return target


async def _fetch_one(client: httpx.AsyncClient, url: str, dest: Path, sha256: str, limit: int,
                     headers: dict) -> None:
    name = dest.name
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".part", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            digest = hashlib.sha256()
            size = 0
            try:
                async with client.stream("GET", url, headers=headers) as response:
                    if response.status_code != 200:
                        raise FetchError(
                            f"fetching {_safe_url(url)} answered HTTP {response.status_code}",
                            param="lora_url", code=worker_api.ADAPTER_FETCH_FAILED)
                    declared = response.headers.get("content-length", "")
                    if declared.isdigit() and int(declared) > limit:
                        raise _too_large(name, int(declared), limit)
                    async for chunk in response.aiter_bytes(CHUNK):
                        size += len(chunk)
                        if size > limit:
                            raise _too_large(name, size, limit)
                        digest.update(chunk)
                        out.write(chunk)
            except httpx.HTTPError as exc:
                raise FetchError(f"fetching {_safe_url(url)} failed: {type(exc).__name__}: {exc}",
                                 param="lora_url", code=worker_api.ADAPTER_FETCH_FAILED) from None
        got = digest.hexdigest()
        if got != sha256:
            raise FetchError(f"{name}: sha256 mismatch: expected {sha256}, got {got} ({size} bytes)",
                             param="files", code=worker_api.ADAPTER_CHECKSUM_MISMATCH)
        os.replace(tmp, dest)
        tmp = None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass


def _too_large(name: str, size: int, limit: int) -> FetchError:
    return FetchError(f"{name}: {size} bytes is over the limit of {limit} bytes", param="lora_url",
                      code=worker_api.ADAPTER_TOO_LARGE)


def _has(path: Path, sha256: str) -> bool:
    """Whether the cache already holds this exact file."""
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest() == sha256
    except (FileNotFoundError, IsADirectoryError):
        return False


def _safe_url(url: str) -> str:
    """The URL without credentials or a query string (they may carry secrets)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return f"{parts.scheme}://{host}{parts.path}"
