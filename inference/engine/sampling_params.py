"""Per-request sampling settings, validated once when the request is made.

Semantics follow vLLM / the OpenAI API. A SamplingParams is frozen: build a changed copy with
`dataclasses.replace(params, max_tokens=...)` (which validates again). Every bad value raises a
ValueError whose message starts with the field's name, e.g. "max_tokens must be >= 0, got -1".
"""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inference.engine.structured_output import StructuredOutput

# temperature below this is treated as greedy (argmax): dividing logits by ~0 would overflow,
# and the argmax is what such a temperature means anyway (vLLM uses the same cut-off).
GREEDY_TEMPERATURE = 1e-5
# OpenAI's `top_logprobs` allows 0..20.
MAX_LOGPROBS = 20
# OpenAI's `logit_bias` values lie in [-100, 100] (-100 bans a token, +100 all but forces it).
MAX_LOGIT_BIAS = 100.0
# torch.Generator.manual_seed accepts this range.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


class SamplingType(enum.Enum):
    GREEDY = "greedy"  # argmax of the (penalised) logits; seed and filters are ignored
    RANDOM = "random"  # sampled from the process-wide random stream
    RANDOM_SEEDED = "random_seeded"  # sampled from the request's own torch.Generator


def _is_int(value: object) -> bool:
    # bool is an int subclass in Python; `top_k=True` is a bug, not 1.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _int(name: str, value: object) -> int:
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token of one request, and when to stop.

    max_tokens: output tokens to generate at most; None = until the context length is reached;
        0 = prefill only (score the prompt with prompt_logprobs; the request finishes "length").
    temperature: 0 (or < 1e-5) = greedy; otherwise logits are divided by it before filtering.
    top_p: keep the smallest set of most likely tokens whose probability adds up to >= top_p.
    top_k: keep the k most likely tokens; 0 (or -1, normalised to 0) = disabled.
    min_p: drop tokens whose probability is < min_p x the most likely token's probability.
    presence_penalty: subtracted once from the logit of every token already in the output.
    frequency_penalty: subtracted from a token's logit once per time it occurs in the output.
    repetition_penalty: for tokens in the prompt or the output: a positive logit is divided by
        it, a negative one multiplied (HF/vLLM semantics); 1 = off.
    seed: the request samples from its own generator seeded with this, so the same seed and
        inputs give the same tokens whatever else shares the batch.
    stop: strings that end generation (not returned unless include_stop_str_in_output).
    stop_token_ids: token ids that end generation, besides EOS.
    ignore_eos: keep going past EOS (benchmarks).
    logprobs: None = no logprobs; k in 0..20 = the chosen token's logprob plus the k most likely
        alternatives (log-softmax of the raw model logits, before penalties and temperature).
    prompt_logprobs: None = none; k in 0..20 = each prompt token's logprob (the first has none)
        and rank, plus the k most likely tokens at that position (vLLM's extra). Such a request
        computes its whole prompt: a cached prefix has no logits to give.
    structured_output: the output must match this JSON schema / grammar (structured_output.py);
        None = free text. The grammar's mask applies before penalties and temperature; the
        request finishes "stop" once the grammar is complete.
    logit_bias: {token id: bias in [-100, 100]} added to those logits before penalties and
        temperature (OpenAI). Normalised to a dict of int -> float; decimal-string ids (JSON
        object keys) are read as ints. Logprobs stay those of the raw logits.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    structured_output: StructuredOutput | None = None
    logit_bias: Mapping[int, float] | None = None

    def __post_init__(self) -> None:
        # frozen dataclass: normalised values are written with object.__setattr__.
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        if self.max_tokens is not None:
            max_tokens = _int("max_tokens", self.max_tokens)
            if max_tokens < 0:
                raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
            put("max_tokens", max_tokens)

        temperature = _real("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        put("temperature", temperature)

        top_p = _real("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        put("top_p", top_p)

        top_k = _int("top_k", self.top_k)
        if top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {top_k}")
        put("top_k", max(top_k, 0))

        min_p = _real("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        put("min_p", min_p)

        for name in ("presence_penalty", "frequency_penalty"):
            value = _real(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            put(name, value)

        repetition_penalty = _real("repetition_penalty", self.repetition_penalty)
        if repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
        put("repetition_penalty", repetition_penalty)

        if self.seed is not None:
            seed = _int("seed", self.seed)
            if not _SEED_MIN <= seed <= _SEED_MAX:
                raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got {seed}")
            put("seed", seed)

        put("stop", self._validated_stop(self.stop))
        put("stop_token_ids", self._validated_stop_token_ids(self.stop_token_ids))

        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                value = _int(name, getattr(self, name))
                if not 0 <= value <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
                put(name, value)

        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _bool(name, getattr(self, name))

        if self.structured_output is not None:
            from inference.engine.structured_output import StructuredOutput

            if not isinstance(self.structured_output, StructuredOutput):
                raise ValueError(
                    f"structured_output must be a StructuredOutput, got {type(self.structured_output).__name__}"
                )
        put("logit_bias", self._validated_logit_bias(self.logit_bias))

    @staticmethod
    def _validated_stop(stop: object) -> tuple[str, ...]:
        if isinstance(stop, str):
            stop = (stop,)
        elif stop is None:
            stop = ()
        elif not isinstance(stop, Sequence):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        for i, s in enumerate(stop):
            if not isinstance(s, str):
                raise ValueError(f"stop[{i}] must be a string, got {s!r}")
            if not s:
                raise ValueError(f"stop[{i}] must not be empty")
        return tuple(stop)

    @staticmethod
    def _validated_stop_token_ids(ids: object) -> tuple[int, ...]:
        if ids is None:
            return ()
        if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
            raise ValueError(f"stop_token_ids must be a list of integers, got {ids!r}")
        out = []
        for i, token_id in enumerate(ids):
            token_id = _int(f"stop_token_ids[{i}]", token_id)
            if token_id < 0:
                raise ValueError(f"stop_token_ids[{i}] must be >= 0, got {token_id}")
            out.append(token_id)
        return tuple(out)

    @staticmethod
    def _validated_logit_bias(bias: object) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, Mapping):
            raise ValueError(f"logit_bias must be a map of token id to bias, got {bias!r}")
        out: dict[int, float] = {}
        for key, value in bias.items():
            token_id = key
            if isinstance(key, str) and key.strip().lstrip("-").isdecimal():
                token_id = int(key)
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"logit_bias key {key!r} is not a token id (an integer >= 0)")
            value = _real(f"logit_bias[{key!r}]", value)
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{key!r}] must be in [-100, 100], got {value}")
            out[int(token_id)] = value
        return out or None

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < GREEDY_TEMPERATURE:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEEDED
        return SamplingType.RANDOM
