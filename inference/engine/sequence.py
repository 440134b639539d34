"""One request's state as the engine moves it through waiting → running → finished.

Plain Python: the scheduler and block manager are tested without tensors. Anything
torch-shaped a sequence needs (its seeded generator, its detokenizer) hangs off it
as an opaque attribute that only the engine touches.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inference.engine.block_manager import PrefixKey
    from inference.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # client went away or an explicit abort
    ERROR = "error"  # the request could not run (its adapter failed to load); see Sequence.error


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Upper bound on prompt + output tokens: the model's context length.
    max_model_len: int
    # The adapter this request runs with (an opaque handle owned by the adapter manager; None:
    # the base model) and the device slot it holds while running (-1: none / base model).
    adapter: Any = None
    adapter_slot: int = -1
    # Tenant fairness hooks (the inference server sets these; FCFS ignores them).
    tenant: str | None = None
    weight: float = 1.0
    # Prefix caching: requests with different salts never share cached KV (the gateway sets
    # one per tenant); None is a salt of its own, shared by every request without one.
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None  # why the request failed, with FinishReason.ERROR
    # Where this sequence's KV lives, and how many of its tokens are in it.
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    # Prefix caching (block_manager.py): the key the scheduler sets at admission, the hash
    # chain of the full blocks so far, how many leading blocks of block_table are in the cache,
    # and how many prompt tokens the first admission found cached (skipped, not computed).
    prefix_key: PrefixKey | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_cached_tokens: int = 0
    # Engine-owned extras (generator, detokenizer, text state, timings).
    state: Any = None

    # -- derived --------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV still has to be computed (1 for a plain decode step)."""
        return self.num_tokens - self.num_computed_tokens

    def token_id_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n]

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params is not None and self.params.prompt_logprobs is not None

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
