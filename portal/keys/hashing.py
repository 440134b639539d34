"""API key secrets: how they are made, shown and hashed."""

import hashlib
import secrets

from portal.keys.models import API_KEY_PREFIX, VISIBLE_PREFIX_CHARS

SECRET_BYTES = 32  # 256 bits of entropy
MAX_KEY_LENGTH = 200  # longer input is rejected before hashing


def new_plaintext_key() -> str:
    """'sk-' followed by 43 URL-safe characters."""
    return API_KEY_PREFIX + secrets.token_urlsafe(SECRET_BYTES)


def visible_prefix(plaintext: str) -> str:
    return plaintext[len(API_KEY_PREFIX) : len(API_KEY_PREFIX) + VISIBLE_PREFIX_CHARS]


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode("utf-8")).hexdigest()


def looks_like_key(plaintext: str) -> bool:
    return (
        plaintext.startswith(API_KEY_PREFIX)
        and len(API_KEY_PREFIX) + VISIBLE_PREFIX_CHARS <= len(plaintext) <= MAX_KEY_LENGTH
    )
