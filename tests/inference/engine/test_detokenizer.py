"""Streaming detokenization with the real SmolLM2 tokenizer (byte-level BPE)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from inference.engine.detokenizer import IncrementalDetokenizer
from inference.models.tokenizer import Tokenizer, load_tokenizer

REPLACEMENT = "\ufffd"

TEXTS = [
    "Hello, world! This is a plain English sentence.",
    "中文分词测试：你好，世界！今天天气很好。",
    "emoji 🎉👍🏽👨‍👩‍👧‍👦🇫🇷🤖 end",
    "Ångström café naïve e\u0301 Øre — “quotes” …",
    "def f(x):\n    return x ** 2  # ✓\n",
    "日本語と한국어と𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "a genuine replacement char \ufffd in the middle \ufffd",
]


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Tokenizer:
    return load_tokenizer(smollm2_path)


def stream(tok, ids: Sequence[int], skip_special_tokens: bool = True) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, prompt_ids=[1, 2, 3], skip_special_tokens=skip_special_tokens)
    deltas = []
    for token_id in ids:
        deltas.append(d.add(token_id))
        assert d.text == "".join(deltas)
    deltas.append(d.flush())
    return deltas, d


def test_multi_byte_characters_split_across_tokens_are_held_until_complete(tok: Tokenizer) -> None:
    ids = tok.encode("🤖")
    assert len(ids) > 1 and tok.decode(ids[:1]).endswith("\ufffd")  # the emoji really is split
    deltas, d = stream(tok, ids)
    assert deltas[:-2] == [""] * (len(ids) - 1)
    assert deltas[-2] == "🤖"
    assert d.text == "🤖"


def test_real_text_streams_without_replacement_chars(tok: Tokenizer) -> None:
    for text in TEXTS:
        ids = tok.encode(text)
        deltas, d = stream(tok, ids)
        assert "".join(deltas) == d.text == tok.decode(ids) == text
        if "\ufffd" not in text:
            assert not any("\ufffd" in delta for delta in deltas), text
        if not text.endswith("\ufffd"):
            assert deltas[-1] == ""  # nothing left to flush after a complete character


def test_text_before_an_incomplete_character_is_not_delayed(tok: Tokenizer) -> None:
    # Some tokens end with the first bytes of a character (' ' + a lead byte): the space goes
    # out at once, only the incomplete character waits for the next token.
    token = next(
        i for i in range(tok.vocab_size)
        if len(tok.decode([i])) > 1 and tok.decode([i]).endswith("\ufffd") and tok.decode([i]).count("\ufffd") == 1
    )
    visible = tok.decode([token])[:-1]
    d = IncrementalDetokenizer(tok, prompt_ids=[])
    assert d.add(tok.encode("ab")[0]) == "ab"
    assert d.add(token) == visible
    assert d.text == "ab" + visible
    assert d.flush() == "\ufffd"
    assert d.text == tok.decode([tok.encode("ab")[0], token])


def test_special_tokens_are_skipped_or_kept(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\nHi 中<|im_end|>")
    skipped, d = stream(tok, ids, skip_special_tokens=True)
    assert d.text == "assistant\nHi 中" == tok.decode(ids)
    kept, d = stream(tok, ids, skip_special_tokens=False)
    assert d.text == "<|im_start|>assistant\nHi 中<|im_end|>"


def test_an_incomplete_character_at_the_end_is_flushed_as_the_full_decode_has_it(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🎉")[:-1]  # stop in the middle of the emoji
    deltas, d = stream(tok, ids)
    assert "\ufffd" not in "".join(deltas[:-1])
    assert deltas[-1].endswith("\ufffd")
    assert d.text == tok.decode(ids)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_concatenation_equals_full_decode_on_random_sequences(tok: Tokenizer, skip_special_tokens: bool) -> None:
    rng = random.Random(0)
    # Byte tokens (single bytes, many of them partial characters) make this adversarial.
    byte_tokens = [tok.encode(ch)[0] for ch in "中🎉é"] + [tok.encode("🎉")[1], tok.encode("中")[-1]]
    for _ in range(300):
        ids = [
            rng.choice(byte_tokens) if rng.random() < 0.4 else rng.randrange(tok.vocab_size)
            for _ in range(rng.randint(1, 60))
        ]
        deltas, d = stream(tok, ids, skip_special_tokens)
        assert "".join(deltas) == d.text == tok.decode(ids, skip_special_tokens=skip_special_tokens), ids


class DecodeSpy:
    """The real tokenizer, recording the length of every id list decoded from Python (the
    stream itself runs on `backend`, in Rust)."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.backend = tok.backend
        self.lengths: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_work_per_token_does_not_grow_with_the_output(tok: Tokenizer) -> None:
    ids = tok.encode(" ".join(TEXTS[:6]) * 40)
    assert len(ids) > 2000
    spy = DecodeSpy(tok)
    deltas, d = stream(spy, ids)
    assert d.text == tok.decode(ids)
    # Python decodes only while a token is held (part of a split character: its own text has a
    # U+FFFD), two per such token, each of a window of a few tokens (a split emoji needs up to 4),
    # never of the output.
    split_tokens = sum(REPLACEMENT in tok.decode([i]) for i in ids)
    assert 0 < len(spy.lengths) <= 2 * split_tokens
    assert max(spy.lengths) <= 6


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_special_token_inside_a_split_character(tok: Tokenizer, skip_special_tokens: bool) -> None:
    # The stream holds the emoji's first bytes; a special token arrives before the rest.
    emoji = tok.encode("🤖")
    ids = [*tok.encode("ok "), *emoji[:1], *tok.encode("<|im_end|>"), *emoji[1:], *tok.encode(" 中")]
    deltas, d = stream(tok, ids, skip_special_tokens)
    assert deltas[0] == "ok"
    assert d.text == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert ("<|im_end|>" in d.text) is not skip_special_tokens
