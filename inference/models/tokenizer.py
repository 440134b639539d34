"""The text <-> token-id boundary of the engine, on the HF `tokenizers` library.

    tok = load_tokenizer("models/SmolLM2-135M-Instruct.Q4_1.gguf")   # or an HF checkpoint dir
    ids = tok.encode("Hello")                     # no BOS unless add_special_tokens=True
    tok.decode(ids)                               # special tokens skipped by default
    tok.apply_chat_template([{"role": "user", "content": "Hi"}])   # prompt text, gen prompt added
    tok.encode_chat([{"role": "user", "content": "Hi"}])           # prompt ids: what the engine runs

From an HF directory the tokenizer is `tokenizer.json` as is, with the special-token names
and chat template from tokenizer_config.json (and generation_config.json's extra EOS ids).

A GGUF carries no tokenizer.json, only llama.cpp's metadata: the vocabulary, merges, a type
per token, the special ids and a pre-tokenizer name. `_byte_level_bpe_from_gguf` rebuilds
the byte-level BPE tokenizer from those the way transformers does when it reads a GGUF
(tests compare the two on a varied corpus). Control tokens (type 3, e.g. `<|im_start|>`)
become special added tokens: they encode as one id wherever they appear in the text and are
skipped by `decode(..., skip_special_tokens=True)`. So a chat is encoded with `encode_chat`,
never `encode(apply_chat_template(...))`: special tokens must come only from the template, the
messages' text is encoded as text (inference/models/chat_prompt.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from inference.models.chat_prompt import ChatPromptEncoder
from inference.models.chat_template import ChatTemplate
from inference.models.gguf_metadata import read_gguf_metadata

# llama.cpp token types (gguf.TokenType): only these two change how a token is matched.
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Tokens chat templates use to close a turn. When the template mentions one, generation
# must stop on it even if the checkpoint's EOS is a different token.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|end_of_turn|>")

# Split regexes for byte-level vocabularies that were not trained on GPT-2's, keyed by
# `tokenizer.ggml.pre`. Any other name (gpt2, smollm, ...) gets GPT-2's split, which is
# what ByteLevel(use_regex=True) does; transformers does the same for those names.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what the engine needs around it.

    backend: the underlying tokenizers.Tokenizer.
    bos_token_id / eos_token_id: None when the checkpoint has none.
    stop_token_ids: EOS plus the template's end-of-turn token and any extra EOS ids the
        checkpoint's generation config lists.
    all_special_ids: ids of the special added tokens (skipped when decoding).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None,
        extra_stop_token_ids: Sequence[int] = (),
    ):
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = self._id_of(bos_token, "bos_token")
        self.eos_token_id = self._id_of(eos_token, "eos_token")
        self.chat_template = ChatTemplate(chat_template, bos_token=bos_token, eos_token=eos_token)
        self.has_own_chat_template = chat_template is not None
        added = backend.get_added_tokens_decoder()  # {id: AddedToken}
        self.all_special_ids: set[int] = {i for i, t in added.items() if t.special}
        self._chat_encoder = ChatPromptEncoder(
            backend, self.chat_template, {i: t.content for i, t in added.items() if t.special}
        )
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        stop = set(extra_stop_token_ids)
        if self.eos_token_id is not None:
            stop.add(self.eos_token_id)
        for token in END_OF_TURN_TOKENS:
            token_id = backend.token_to_id(token)
            if token_id is not None and token_id in self.all_special_ids and self.chat_template.mentions(token):
                stop.add(token_id)
        self.stop_token_ids: set[int] = stop

    def _id_of(self, token: str | None, field: str) -> int | None:
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{field}: {token!r} is not in the vocabulary")
        return token_id

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special-token text such as `<|im_start|>` encodes as its one id:
        right for a raw prompt the caller wrote for the model, wrong for chat messages (see
        `encode_chat`).
        add_special_tokens: add what the checkpoint adds around a sequence (e.g. BOS)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text for chat `messages`, as HF renders it. To run it, use `encode_chat`:
        encoding this text would read special-token text inside the messages as control tokens."""
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """The prompt ids for chat `messages`: special tokens only where the template writes
        them (no BOS added: the template writes whatever the model wants); every string of the
        messages and tools encodes as plain text, so a message cannot forge a turn. Identical to
        HF's apply_chat_template ids when no message holds special-token text."""
        return self._chat_encoder.encode(messages, add_generation_prompt=add_generation_prompt, tools=tools)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r}, "
                f"stop_token_ids={sorted(self.stop_token_ids)})")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a .gguf file or of an HF checkpoint directory."""
    path = Path(path)
    if path.is_dir():
        return _from_hf_dir(path)
    if path.is_file():
        return _from_gguf(path)
    raise ValueError(f"tokenizer path: {path} does not exist (expected a .gguf file or an HF checkpoint directory)")


# --- GGUF ---------------------------------------------------------------------------------

def _from_gguf(path: Path) -> Tokenizer:
    meta = read_gguf_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"tokenizer.ggml.model: unsupported tokenizer {kind!r} in {path.name} "
            "(byte-level BPE 'gpt2' is supported; use the HF checkpoint directory instead)"
        )
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if key not in meta:
            raise ValueError(f"{key}: missing from {path.name}")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    backend = _byte_level_bpe_from_gguf(tokens, meta["tokenizer.ggml.merges"], token_types,
                                        meta.get("tokenizer.ggml.pre"))

    def token_at(key: str) -> str | None:
        token_id = meta.get(key)
        if token_id is None:
            return None
        if not 0 <= token_id < len(tokens):
            raise ValueError(f"{key}: id {token_id} is outside the vocabulary of {len(tokens)} tokens")
        return tokens[token_id]

    bos, eos = token_at("tokenizer.ggml.bos_token_id"), token_at("tokenizer.ggml.eos_token_id")
    template_parts = []
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        template_parts.append((bos, meta["tokenizer.ggml.bos_token_id"], "before"))
    if meta.get("tokenizer.ggml.add_eos_token") and eos is not None:
        template_parts.append((eos, meta["tokenizer.ggml.eos_token_id"], "after"))
    if template_parts:
        backend.post_processor = _bos_eos_processor(template_parts)
    return Tokenizer(backend, bos_token=bos, eos_token=eos, chat_template=meta.get("tokenizer.chat_template"))


@cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves,
    the other 68 bytes (space, controls, ...) get code points from 256 up (space is 'Ġ')."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _byte_level_bpe_from_gguf(tokens: list[str], merges: list[str], token_types: list[int],
                              pre: str | None) -> tokenizers.Tokenizer:
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    vocab = {}
    for index, (token, token_type) in enumerate(zip(tokens, token_types, strict=True)):
        if token_type not in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED) and not set(token) <= letters:
            # A normal token stored as raw text: respell it in the byte alphabet the merges use.
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ValueError(f"tokenizer.ggml.merges: malformed merge {merge!r}")
        pairs.append((left, right))
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    # Added tokens are matched in the raw text before the model runs, so they stay whole.
    backend.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, token_types, strict=True) if kind == TOKEN_TYPE_CONTROL
    ])
    backend.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, token_types, strict=True) if kind == TOKEN_TYPE_USER_DEFINED
    ])
    if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError("tokenizer.ggml.tokens: duplicate tokens; the vocabulary could not be rebuilt")
    return backend


def _bos_eos_processor(parts: list[tuple[str, int, str]]) -> processors.TemplateProcessing:
    before = [t for t, _, where in parts if where == "before"]
    after = [t for t, _, where in parts if where == "after"]
    single = [*before, "$A", *after]
    pair = [*before, "$A", *after, *before, "$B:1", *after]
    return processors.TemplateProcessing(single=single, pair=pair,
                                         special_tokens=[(t, i) for t, i, _ in parts])


# --- HF directory -------------------------------------------------------------------------

def _from_hf_dir(path: Path) -> Tokenizer:
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"tokenizer path: {path} has no tokenizer.json")
    backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    config = _read_json(path / "tokenizer_config.json")
    special_map = _read_json(path / "special_tokens_map.json")
    generation = _read_json(path / "generation_config.json")

    def token_name(field: str) -> str | None:
        value = config.get(field, special_map.get(field))
        if isinstance(value, Mapping):  # {"content": "<s>", "lstrip": false, ...}
            value = value.get("content")
        if value is not None and not isinstance(value, str):
            raise ValueError(f"tokenizer_config.json: {field} must be a string, got {value!r}")
        return value

    extra_stop = generation.get("eos_token_id")
    if isinstance(extra_stop, int):
        extra_stop = [extra_stop]
    if not isinstance(extra_stop, list) or not all(isinstance(i, int) for i in extra_stop):
        extra_stop = []
    return Tokenizer(
        backend,
        bos_token=token_name("bos_token"),
        eos_token=token_name("eos_token"),
        chat_template=_hf_chat_template(path, config),
        extra_stop_token_ids=extra_stop,
    )


def _hf_chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    """The template from chat_template.jinja (newer checkpoints) or tokenizer_config.json,
    where it is a string or a list of named templates (the one named 'default' is used)."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError("tokenizer_config.json: chat_template must be a string or a list of named templates")
    return template


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path.name}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path.name}: expected a JSON object")
    return data
