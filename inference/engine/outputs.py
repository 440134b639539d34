"""What the engine hands back each step, per request (also the streaming unit)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    # The most likely alternatives at this position, best first: [(token_id, logprob)].
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # 1 + how many tokens were more likely (prompt logprobs set it)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not computed)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every output token so far
    text: str  # visible output text so far (stop strings removed)
    delta_text: str  # visible text new since the previous output of this request
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once finished
    usage: Usage
    delta_logprobs: list[TokenLogprob] | None = None
    # Seconds since arrival: first token, and finish (None until then).
    time_to_first_token: float | None = None
    latency: float | None = None
    queue_time: float | None = None  # arrival to first scheduled (seconds), once it was scheduled
    # Where the request's adapter was when it arrived: "device" (warm), "host" or "disk"
    # (cold: copied into a slot, or read first); "" for the base model.
    adapter_tier: str = ""
    error: str | None = None  # with finish_reason "error": why (e.g. the adapter failed to load)
    extra: dict = field(default_factory=dict)
    # With SamplingParams.prompt_logprobs, once the prompt is computed: one entry per prompt
    # token, the first None (nothing predicts it), as vLLM's RequestOutput.prompt_logprobs.
    prompt_logprobs: list[TokenLogprob | None] | None = None
