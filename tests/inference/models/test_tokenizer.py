"""Our tokenizer against HF transformers' reading of the same checkpoint, token for token."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import tokenizers
from gguf import GGUFWriter

from inference.models.gguf_metadata import GGUFFormatError
from inference.models.tokenizer import Tokenizer, load_tokenizer

CORPUS = [
    "",
    " ",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. I'm sure you'll agree; they've DON'T we'd.",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\t\tmore tabs\t",
    "line one\nline two\n\nline four\r\nwindows line\r\n",
    "\n\n\n",
    "a    b     c      d",
    "numbers: 0 1 12 123 1234 12345 3.14159 1,000,000 -42 +7 1e-10 0xFF 2024-01-01",
    "x  1, y   22,\n    333",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }",
    '{"key": [1, 2, {"nested": null}], "ok": true}',
    "<div class=\"a\">&amp; <b>bold</b></div>",
    "emoji: 🎉 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ 🤖",
    "中文分词测试：你好，世界！今天天气很好。",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 텍스트입니다.",
    "Русский текст, и ещё немного.",
    "النص العربي من اليمين إلى اليسار",
    "हिन्दी पाठ",
    "Café naïve résumé Ångström façade Øre straße",
    "combining: e\u0301 a\u0308 n\u0303",
    "zero\u200bwidth\ufeffbom and nbsp\u00a0here",
    "control\x00chars\x01\x7f",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more text<|endoftext|>",
    "almost special <|im_sta and <|im_end|",
    "<repo_name>smollm<file_sep>main.py<jupyter_code>print(1)",
]


def random_texts(count: int, seed: int) -> list[str]:
    """Strings mixing scripts, digits, punctuation, whitespace runs and special tokens."""
    rng = random.Random(seed)
    pieces = [
        "a", "Z", "the", " ", "  ", "\t", "\n", "\r\n", "0", "7", "42", ".", ",", "!", "'s", "'LL", "-",
        "é", "ß", "中", "文", "😀", "🏽", "\u200d", "ж", "ا", "\u0301", "<|im_start|>", "<|im_end|>", "{", "}",
        "    ", "\\", "\"", "€", "𝔘", "\x0b",
    ]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 40))) for _ in range(count)]


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Tokenizer:
    return load_tokenizer(smollm2_path)


@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_encode_matches_hf_on_a_varied_corpus(tok: Tokenizer, hf_smollm2_tokenizer, add_special_tokens: bool) -> None:
    for text in CORPUS + random_texts(300, seed=0):
        expected = hf_smollm2_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        assert tok.encode(text, add_special_tokens=add_special_tokens) == expected, repr(text)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_hf(tok: Tokenizer, hf_smollm2_tokenizer, skip_special_tokens: bool) -> None:
    rng = random.Random(1)
    id_lists = [tok.encode(text) for text in CORPUS + random_texts(100, seed=2)]
    # Arbitrary id sequences too: byte tokens that do not form whole characters, specials anywhere.
    id_lists += [[rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))] for _ in range(200)]
    for ids in id_lists:
        expected = hf_smollm2_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert tok.decode(ids, skip_special_tokens=skip_special_tokens) == expected, ids


def test_round_trip_is_lossless(tok: Tokenizer) -> None:
    for text in CORPUS + random_texts(100, seed=3):
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_special_tokens_and_ids_match_hf(tok: Tokenizer, hf_smollm2_tokenizer) -> None:
    hf = hf_smollm2_tokenizer
    assert isinstance(tok.backend, tokenizers.Tokenizer)
    assert tok.vocab_size == len(hf) == 49152
    assert (tok.bos_token_id, tok.eos_token_id) == (hf.bos_token_id, hf.eos_token_id) == (1, 2)
    hf_special = {i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert tok.all_special_ids == hf_special == set(range(17))
    # Each special token is one id wherever it appears, and disappears when skipped.
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("x<|im_end|>y") == [tok.encode("x")[0], 2, tok.encode("y")[0]]
    assert tok.decode(tok.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"


def test_stop_tokens_are_eos_and_the_end_of_turn_token(tok: Tokenizer) -> None:
    # SmolLM2: EOS is <|im_end|> (2), which is also the template's end of turn.
    assert tok.stop_token_ids == {2}
    assert tok.encode("<|im_end|>") == [2]


def test_hf_directory_gives_the_same_tokenizer(tok: Tokenizer, hf_smollm2_dir: Path) -> None:
    from_dir = load_tokenizer(hf_smollm2_dir)
    for text in CORPUS + random_texts(100, seed=4):
        assert from_dir.encode(text) == tok.encode(text), repr(text)
    assert (from_dir.bos_token_id, from_dir.eos_token_id) == (1, 2)
    assert from_dir.stop_token_ids == {2}
    assert from_dir.all_special_ids == tok.all_special_ids
    assert from_dir.chat_template.source == tok.chat_template.source
    messages = [{"role": "user", "content": "Hi"}]
    assert from_dir.apply_chat_template(messages) == tok.apply_chat_template(messages)


def copy_hf_dir(src: Path, dst: Path, **config_overrides) -> Path:
    dst.mkdir()
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.update(config_overrides)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_hf_directory_template_from_config_and_extra_eos(hf_smollm2_dir: Path, tmp_path: Path) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}<|im_end|>{% endfor %}"
    d = copy_hf_dir(hf_smollm2_dir, tmp_path / "ckpt", eos_token={"content": "<|endoftext|>"},
                    chat_template=[{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}])
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5]}))

    loaded = load_tokenizer(d)

    assert loaded.eos_token_id == 0
    # EOS, generation_config's extra EOS ids, and <|im_end|> because the template ends turns with it.
    assert loaded.stop_token_ids == {0, 5, 2}
    assert loaded.apply_chat_template([{"role": "user", "content": "yo"}]) == "[user] yo<|im_end|>"


def test_checkpoint_without_template_gets_chatml(hf_smollm2_dir: Path, tmp_path: Path) -> None:
    d = copy_hf_dir(hf_smollm2_dir, tmp_path / "ckpt")  # no chat_template.jinja copied
    loaded = load_tokenizer(d)
    assert not loaded.has_own_chat_template
    assert loaded.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_bad_paths_and_files_raise_clear_errors(hf_smollm2_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "nope.gguf")
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 definitely not gguf")
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        load_tokenizer(not_gguf)
    broken = copy_hf_dir(hf_smollm2_dir, tmp_path / "broken", bos_token="<not-a-token>")
    with pytest.raises(ValueError, match="bos_token: '<not-a-token>' is not in the vocabulary"):
        load_tokenizer(broken)
    bad_json = copy_hf_dir(hf_smollm2_dir, tmp_path / "bad_json")
    (bad_json / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ValueError, match="tokenizer_config.json: not valid JSON"):
        load_tokenizer(bad_json)


def write_tiny_gguf(path: Path, model: str, *, add_bos: bool = False) -> Path:
    """A GGUF with only tokenizer metadata: a byte-level vocabulary of 'a', 'b', 'ab', '<s>'."""
    writer = GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(["a", "b", "ab", "<s>", "Ġ"])
    writer.add_token_types([1, 1, 1, 3, 1])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(3)
    writer.add_eos_token_id(3)
    writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_asking_for_bos_gets_it_with_add_special_tokens(tmp_path: Path) -> None:
    tiny = load_tokenizer(write_tiny_gguf(tmp_path / "tiny.gguf", "gpt2", add_bos=True))
    assert tiny.encode("ab a") == [2, 4, 0]
    assert tiny.encode("ab a", add_special_tokens=True) == [3, 2, 4, 0]
    assert tiny.decode([3, 2, 4, 0]) == "ab a"


def test_unsupported_gguf_tokenizer_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer.ggml.model: unsupported tokenizer 'llama'"):
        load_tokenizer(write_tiny_gguf(tmp_path / "spm.gguf", "llama"))


def test_encode_rejects_non_text(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="text must be a string"):
        tok.encode(["not", "a", "string"])  # type: ignore[arg-type]
