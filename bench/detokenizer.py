"""Streaming detokenization: `tokenizers`' DecodeStream (what the engine uses) against the
two-decodes-per-token Python window it replaced, on the real SmolLM2 tokenizer.

    .venv/bin/python bench/detokenizer.py [--quick] [--model PATH] [--repeats 7]

Both detokenizers turn the same token streams into text one token at a time, as the engine
does after each step: outputs of 256 tokens (a typical answer; each stream starts empty) cut
from three texts tokenized by SmolLM2's byte-level BPE: English prose, CJK + emoji (most
characters are 2-4 byte tokens, so many tokens are held until their character completes), and
the two mixed. Reported per text: the share of tokens held (part of a split character: the
Python path decodes those too), microseconds per token for each (the best of `repeats` rounds,
each running both, so a busy machine hurts neither more) and their ratio. Both outputs are checked against the
full decode of every stream before anything is timed. The CPU is named; nothing is asserted.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenizers.decoders import DecodeStream  # noqa: E402

from bench.machine import cpu_name  # noqa: E402
from inference.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from inference.models.fetch import default_model_path  # noqa: E402
from inference.models.tokenizer import Tokenizer, load_tokenizer  # noqa: E402

OUTPUT_TOKENS = 256
ENGLISH = (
    "The scheduler admits the requests that fit in the cache, runs one batch for every adapter "
    "and streams each token back as soon as it is sampled. Latency stays low because a cold "
    "adapter loads off the step loop, and throughput stays high because the base is shared. "
)
CJK_EMOJI = (
    "你好，世界！今天天气很好，我们去公园散步吧。🎉👍🏽 日本語のテキストと한국어 문장도 섞여 있습니다。"
    "👨‍👩‍👧‍👦🇫🇷🤖 数学：∑∫√∞ ≠ ≤ ≥ — “引用” … 🍣🍜🍵 "
)
TEXTS = {"English": ENGLISH, "CJK + emoji": CJK_EMOJI, "mixed": ENGLISH + CJK_EMOJI}

REPLACEMENT_CHAR = "\ufffd"


class PythonWindowDetokenizer:
    """The detokenizer DecodeStream replaced (vLLM's two offsets, decoded from Python): each
    token decodes the context `ids[prefix:read]` and the window `ids[prefix:]`; the new text is
    what the window adds, held while it ends in an incomplete character."""

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True):
        self.tok = tok
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = self.read = self.emitted_in_window = 0
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        context = self._decode(self.ids[self.prefix : self.read])
        window = self._decode(self.ids[self.prefix :])
        incomplete = not final and window.endswith(REPLACEMENT_CHAR)
        start = len(context) + self.emitted_in_window
        end = len(window) - 1 if incomplete else len(window)
        delta = window[start:end] if end > start else ""
        if incomplete:
            self.emitted_in_window += len(delta)
        else:
            self.prefix, self.read, self.emitted_in_window = self.read, len(self.ids), 0
        self.text += delta
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""


def decode_stream(tok: Tokenizer) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tok, prompt_ids=[])


def python_window(tok: Tokenizer) -> PythonWindowDetokenizer:
    return PythonWindowDetokenizer(tok)


def run(make: Callable[[Tokenizer], object], tok: Tokenizer, streams: list[list[int]]) -> list[str]:
    texts = []
    for ids in streams:
        d = make(tok)
        for token_id in ids:
            d.add(token_id)
        d.flush()
        texts.append(d.text)
    return texts


def best_seconds(makers: Sequence[Callable[[Tokenizer], object]], tok: Tokenizer, streams: list[list[int]],
                 repeats: int) -> list[float]:
    """The best time of each maker over `repeats` rounds; each round runs them one after the
    other, so a burst of load from elsewhere hits both."""
    best = [float("inf")] * len(makers)
    for _ in range(repeats):
        for i, make in enumerate(makers):
            start = time.perf_counter()
            run(make, tok, streams)
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def held_fraction(tok: Tokenizer, streams: list[list[int]]) -> float:
    """Share of tokens whose text waits for a later token (DecodeStream gives nothing for them)."""
    held = 0
    for ids in streams:
        stream = DecodeStream(skip_special_tokens=True)
        held += sum(stream.step(tok.backend, i) is None for i in ids)
    return held / sum(map(len, streams))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="a .gguf file or HF directory (default: SmolLM2)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="fewer streams and repeats")
    args = parser.parse_args()
    tok = load_tokenizer(args.model or default_model_path())
    streams_per_text = 4 if args.quick else 32
    repeats = 2 if args.quick else args.repeats

    print(f"CPU: {cpu_name()}, capability {torch.backends.cpu.get_cpu_capability()}; "
          f"tokenizers {sys.modules['tokenizers'].__version__}; {OUTPUT_TOKENS}-token outputs, best of {repeats}")
    print(f"{'text':<12} {'tokens':>7} {'held':>6} {'python window':>14} {'DecodeStream':>13} {'ratio':>7}")
    for name, text in TEXTS.items():
        ids = tok.encode(text * (1 + streams_per_text * OUTPUT_TOKENS // len(tok.encode(text))))
        streams = [ids[i : i + OUTPUT_TOKENS] for i in range(0, streams_per_text * OUTPUT_TOKENS, OUTPUT_TOKENS)]
        expected = [tok.decode(s) for s in streams]
        for make in (python_window, decode_stream):
            if run(make, tok, streams) != expected:
                sys.exit(f"{make.__name__}: the streamed text differs from the full decode on {name!r}")
        tokens = sum(map(len, streams))
        held = held_fraction(tok, streams)
        old, new = (t / tokens * 1e6 for t in best_seconds((python_window, decode_stream), tok, streams, repeats))
        print(f"{name:<12} {tokens:>7} {held:>6.0%} {old:>11.2f} us {new:>10.2f} us {new / old:>6.2f}x")
    print("ratio: DecodeStream's cost per token / the Python window's (below 1: DecodeStream is faster); "
          "held: tokens whose text waits for a later one (part of a split character)")


if __name__ == "__main__":
    main()
