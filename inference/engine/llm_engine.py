"""The engine: one model, a paged KV cache and a step loop that reads like the spec.

    step():  schedule  →  run the model on the flattened batch  →  sample  →  postprocess
             (admit / preempt)   (prefill chunks + decodes)        (per row)   (detokenize, stop, free)

Each of the four is one method below (`_schedule`, `_run`, `_sample`, `_postprocess`).

Requests are validated when they are added (a ValueError naming the field), so a bad
request never disturbs the ones already running.

Multi-LoRA (inference/lora/): a request may ask for an adapter (`lora=`: a registered name or
a LoRARequest); the adapter manager (`self.adapters`) binds it to that adapter's record, the
scheduler admits it once the adapter holds a device slot (loading from disk happens on a
background thread, so the step loop never waits on it), and each step's tokens carry their
slot into the model's projections, which add that adapter's delta per token. Base-only and
adapter requests share every step.

Prefix caching (block_manager.py): a request's full blocks are keyed by their tokens, its
adapter's immutable id and its `cache_salt`; the scheduler starts it after the longest cached
prefix, so a repeated system prompt or an earlier turn of a conversation is not recomputed.
An adapter that leaves the adapter cache takes its cached blocks with it (`_schedule`).

Structured output (structured_output.py): a request with `params.structured_output` needs its
grammar compiled (in the grammar cache's thread pool, never on this thread). One whose grammar
is already compiled (a cache hit, e.g. after the server's pre-check) joins the scheduler at
once; otherwise it waits in `_compiling`, outside the scheduler, and joins on the first step
after its compile finished, while the others keep running. Errors: add_request raises
StructuredOutputError (a ValueError) when the grammar is already known to be bad; a compile
that fails later finishes the request with finish_reason "error" and the message in `error`.
Each step the constrained rows' matchers fill one bitmask for the sampler; after sampling each
matcher consumes its token, and a grammar that is complete finishes the request ("stop"). A
matcher advances only when a token is sampled, i.e. once per output token: a preempted
sequence recomputes its KV without sampling, so its matcher is never advanced twice.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import time
from collections.abc import Sequence as Seq
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from inference.config import EngineConfig
from inference.engine.block_manager import BlockManager
from inference.engine.detokenizer import IncrementalDetokenizer
from inference.engine.fair_queue import FairQueue
from inference.engine.model_runner import ModelRunner
from inference.engine.outputs import RequestOutput, TokenLogprob, Usage
from inference.engine.prompt_logprobs import score_prompt_tokens
from inference.engine.sampler import Sampler, SamplerOutput, SamplingBatch, make_generator
from inference.engine.sampling_params import SamplingParams
from inference.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput
from inference.engine.sequence import FinishReason, Sequence, SequenceStatus
from inference.engine.stop_checker import StopChecker
from inference.engine.structured_output import GrammarCache, matcher_error
from inference.layers.attention import allocate_kv_cache
from inference.layers.attention_plan import with_attention_kernel
from inference.layers.dense_layout import ONEDNN, PLAIN, pack_dense_weights, with_dense_layout
from inference.layers.linear import apply_plan
from inference.layers.matmul_plan import choose_plan
from inference.layers.quant_plan import with_quant_kernel
from inference.lora.cache import CacheStats
from inference.lora.manager import AdapterInfo, AdapterManager
from inference.lora.request import LoRARequest
from inference.models.loader import load_model
from inference.models.quantize import packed_nbytes
from inference.models.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass
class _SeqState:
    """Engine-side extras of a sequence (kept off `Sequence` so it stays plain Python)."""

    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer
    stop: StopChecker
    emitted_chars: int = 0  # visible text already handed out
    emitted_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    # Prompt logprobs (SamplingParams.prompt_logprobs) scored so far, one per prompt position
    # from 0 (None: nothing predicts the first token); complete once it has every position.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    first_token_time: float | None = None
    matcher: Any = None  # llguidance.LLMatcher of a structured-output request (None: free text)
    scheduled_time: float | None = None  # first left the waiting queue (vLLM's queued time ends)
    adapter_tier: str = ""  # where its adapter was on arrival (AdapterManager.arrival_tier); "" base


@dataclass
class EngineStats:
    """Running totals since start (the server's metrics read these)."""

    num_steps: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0  # prompt tokens of finished prefills (recomputes not double-counted)
    generation_tokens: int = 0
    # Prefix cache, in tokens, per adapter name ("" = the base model): tokens of admitted
    # requests looked up, and those found cached (vLLM's prefix_cache_queries / _hits).
    prefix_cache_queries: dict[str, int] = field(default_factory=dict)
    prefix_cache_hits: dict[str, int] = field(default_factory=dict)
    # Tokens one step ran (prefill chunks + decodes) -> how many steps ran that many; bounded by
    # max_num_batched_tokens distinct keys (vLLM's iteration_tokens_total histogram is built from it).
    iteration_tokens: dict[int, int] = field(default_factory=dict)

    def count_prefix_lookup(self, adapter: str, num_tokens: int, num_cached: int) -> None:
        self.prefix_cache_queries[adapter] = self.prefix_cache_queries.get(adapter, 0) + num_tokens
        self.prefix_cache_hits[adapter] = self.prefix_cache_hits.get(adapter, 0) + num_cached


def kv_cache_num_blocks(config: EngineConfig, model_config, dtype: torch.dtype) -> int:
    """How many KV blocks the memory budget buys: K and V, every layer, block_size tokens."""
    bytes_per_block = (
        2 * model_config.num_hidden_layers * config.block_size
        * model_config.num_key_value_heads * model_config.head_dim * dtype.itemsize
    )
    budget = config.kv_cache_memory
    if isinstance(budget, float):  # a fraction of the memory free right now
        if config.device.startswith("cuda"):
            free = torch.cuda.mem_get_info(torch.device(config.device))[0]
        else:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        budget = int(free * budget)
    return max(1, budget // bytes_per_block)


def served_model_name(path: Path) -> str:
    """The name clients use for the base: the checkpoint's file or directory name, without a
    GGUF quantisation suffix ("SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct")."""
    if path.suffix == ".gguf":
        return re.sub(r"\.(?:I?Q\d[\w]*|F16|F32|BF16)$", "", path.stem, flags=re.IGNORECASE)
    return path.resolve().name


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)  # the shared stream unseeded requests sample from
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        path = config.model_path
        if not path.exists():
            hint = " (fetch the default model: python -m inference.models fetch)" if path.suffix == ".gguf" else ""
            raise FileNotFoundError(f"model: {path} does not exist{hint}")
        self.model = load_model(
            path, dtype=self.dtype, device=self.device, progress=progress,
            weights_dtype=config.weights_dtype,
        )  # fmt: skip
        self.model_config = self.model.config
        # bf16 products on this CPU: native or fp32, measured per shape class; the LoRA delta's
        # kernel where adapters are enabled (matmul_plan.py)
        self.matmul_plan = choose_plan(self.model, self.dtype, self.device, config.matmul_path,
                                       max_rows=config.max_num_batched_tokens,
                                       lora_kernel=config.lora_kernel if config.max_loras else "torch",
                                       may_pack=config.dense_layout != PLAIN)  # fmt: skip
        cfg = self.model.config
        self.matmul_plan = with_attention_kernel(self.matmul_plan, config.attention_kernel, cfg.num_attention_heads,
                                                 cfg.num_key_value_heads, cfg.head_dim, self.dtype, self.device)  # fmt: skip
        self.matmul_plan = with_quant_kernel(self.matmul_plan, config.quant_kernel, self.model, self.dtype)
        self.matmul_plan = with_dense_layout(self.matmul_plan, config.dense_layout, self.model, self.dtype, self.device)
        apply_plan(self.model, self.matmul_plan)
        if self.matmul_plan.dense_layout == ONEDNN:
            pack_dense_weights(self.model)
        log.info("matmul plan: %s", json.dumps(self.matmul_plan.describe()))
        self.tokenizer: Tokenizer = load_tokenizer(path)
        self.model_name = served_model_name(path)
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )

        num_blocks = kv_cache_num_blocks(config, self.model_config, self.dtype)
        self.kv_caches = allocate_kv_cache(
            num_layers=self.model_config.num_hidden_layers, num_blocks=num_blocks,
            block_size=config.block_size, num_kv_heads=self.model_config.num_key_value_heads,
            head_dim=self.model_config.head_dim, dtype=self.dtype, device=self.device,
        )  # fmt: skip
        self.block_manager = BlockManager(
            num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.adapters: AdapterManager | None = None  # None: LoRA disabled (max_loras = 0)
        self._retained_at_removals = 0  # adapters.removals when the prefix cache last dropped theirs
        if config.max_loras > 0:
            self.adapters = AdapterManager(
                self.model,
                self.model_config,
                max_loras=config.max_loras,
                max_cpu_loras=config.max_cpu_loras,
                max_lora_rank=config.max_lora_rank,
                strict_base_match=config.strict_base_match,
                dtype=self.dtype,
                device=self.device,
                slot_dtype=self.matmul_plan.lora_dtype,
            )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                enable_chunked_prefill=config.enable_chunked_prefill,
            ),
            self.block_manager,
            # Weighted fair queuing between tenants (S-LoRA's VTC); exactly FCFS without tenant ids.
            waiting=FairQueue(),
            adapters=self.adapters,
        )
        self.runner = ModelRunner(
            self.model, self.kv_caches, config.block_size, self.device,
            lora_slots=self.adapters.slots if self.adapters else None,
            decode_kernel=self.matmul_plan.attention_kernel,
            prefill_kernel=self.matmul_plan.prefill_attention_kernel,
        )  # fmt: skip
        self.sampler = Sampler()
        self.grammars = GrammarCache(self.tokenizer, self.model_config.vocab_size)
        # Structured-output requests whose grammar is still compiling: (sequence, its Future).
        self._compiling: dict[str, tuple[Sequence, Future]] = {}
        self._ids = itertools.count()
        self._aborted: list[Sequence] = []
        self.stats = EngineStats()
        log.info(
            "KV cache: %d blocks of %d tokens = %d tokens (%.0f MiB)",
            num_blocks, config.block_size, self.block_manager.capacity_tokens,
            sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches) / 2**20,
        )

    # -- requests ---------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        *,
        messages: list[dict] | None = None,
        request_id: str | None = None,
        tenant: str | None = None,
        weight: float = 1.0,
        lora: str | LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Raises ValueError naming the field,
        AdapterNotFoundError for an unregistered adapter name.

        lora: a registered adapter's name, or a LoRARequest(name, path) registered on first use
        (loaded in the background while the request waits; a failed load finishes the request
        with finish_reason "error").

        cache_salt: requests share cached prompt KV only with requests of the same salt (the
        gateway gives each tenant its own); None is one salt of its own."""
        params = params or SamplingParams()
        prompt_ids = self._prompt_token_ids(prompt, messages)
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(prompt_ids)} tokens do not fit the context length of "
                f"{self.max_model_len} (at least one output token must fit)"
            )
        request_id = request_id or f"req-{next(self._ids)}"
        if self.scheduler.get(request_id) is not None or request_id in self._compiling:
            raise ValueError(f"request_id: {request_id!r} is already in the engine")
        if not (isinstance(weight, int | float) and weight > 0):
            raise ValueError(f"weight: must be a number > 0, got {weight!r}")
        if lora is not None and self.adapters is None:
            raise ValueError("lora: LoRA is disabled on this engine (max_loras is 0)")
        if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt):
            raise ValueError(f"cache_salt: must be a non-empty string, got {cache_salt!r}")
        vocab = self.model_config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias: token id {max(params.logit_bias)} is not in the vocabulary (0..{vocab - 1})")
        grammar = None
        if params.structured_output is not None:
            grammar = self.grammars.get(params.structured_output)
            if grammar.done():
                grammar.result()  # a known-bad grammar raises StructuredOutputError here
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            max_model_len=self.max_model_len,
            tenant=tenant,
            weight=weight,
            cache_salt=cache_salt,
        )
        generator = make_generator(params.seed, self.device) if params.seed is not None else None
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.tokenizer.stop_token_ids
        seq.state = _SeqState(
            generator=generator,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens),
            stop=StopChecker(params.stop, stop_ids, params.include_stop_str_in_output),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        if lora is not None:
            if isinstance(lora, LoRARequest):
                self._check_adapter_name(lora.name)
            seq.adapter = self.adapters.bind(lora)
            seq.state.adapter_tier = self.adapters.arrival_tier(seq.adapter)
            self.adapters.prefetch(seq.adapter)  # evicted from host memory: reload while it queues
        try:
            if grammar is not None and not grammar.done():
                self._check_fits(seq)
                self._compiling[request_id] = (seq, grammar)
                return request_id
            if grammar is not None:
                seq.state.matcher = grammar.result().new_matcher()
            self.scheduler.add(seq)
        except ValueError:
            if seq.adapter is not None:
                self.adapters.unbind(seq.adapter)
            raise
        return request_id

    def _prompt_token_ids(self, prompt: str | list[int] | None, messages: list[dict] | None) -> list[int]:
        if (prompt is None) == (messages is None):
            raise ValueError("prompt: give exactly one of a prompt or chat messages")
        if messages is not None:
            # Special tokens only from the template: message text cannot forge a turn.
            ids = self.tokenizer.encode_chat(messages, add_generation_prompt=True)
        elif isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            # A raw prompt (/v1/completions, LLM.generate) is the caller's whole prompt, written
            # for the model: special-token text in it is parsed into special tokens, as vLLM does
            # for completions prompts (chat formats typed by hand keep working).
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"prompt: token id {bad!r} is not in the vocabulary (0..{vocab - 1})")
        if not ids:
            raise ValueError("prompt: must not be empty")
        return ids

    def _check_fits(self, seq: Sequence) -> None:
        """The scheduler's KV check, for a request that joins it later (grammar compiling)."""
        blocks = self.block_manager
        if blocks.blocks_for_tokens(seq.num_tokens) > blocks.num_blocks:
            raise ValueError(
                f"prompt of {seq.num_tokens} tokens needs more KV cache than the engine has "
                f"({blocks.capacity_tokens} tokens)"
            )

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar finished compiling join the scheduler (in arrival order); a
        failed compile finishes its request with finish_reason "error". Outputs of the failed."""
        outputs = []
        for request_id, (seq, grammar) in list(self._compiling.items()):
            if not grammar.done():
                continue
            del self._compiling[request_id]
            try:
                seq.state.matcher = grammar.result().new_matcher()
            except Exception as exc:  # noqa: BLE001 - StructuredOutputError, or the compile crashed
                seq.error = str(exc)
                self._finish_unscheduled(seq, FinishReason.ERROR)
                outputs.append(self._output(seq))
                continue
            self.scheduler.add(seq)
        return outputs

    def _finish_unscheduled(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish a request the scheduler never saw (its grammar was compiling)."""
        if seq.adapter is not None:
            self.adapters.unbind(seq.adapter)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now, freeing its KV blocks; its final output comes with the next step."""
        compiling = self._compiling.pop(request_id, None)
        if compiling is not None:
            self._finish_unscheduled(compiling[0], FinishReason.ABORT)
            self._aborted.append(compiling[0])
            return True
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        self._aborted.append(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted) or bool(self._compiling)

    def do_idle_work(self) -> None:
        """Work deferred off a request's first token (a loaded adapter's host copy handed to its
        slot, an emptied slot zeroed: ~1-2 ms after each load), done now, while nothing waits on
        the engine; otherwise the next step does it first. The server's engine thread calls
        this whenever it runs out of requests."""
        if self.adapters is not None:
            self.adapters.begin_step()

    # -- the step -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step: schedule → run → sample → postprocess. Returns an output for every
        request that got a token, finished or was aborted since the last step."""
        outputs = [self._output(seq) for seq in self._aborted]
        self._aborted.clear()
        if self._compiling:
            outputs += self._admit_compiled()
        decision = self._schedule()
        outputs += [self._output(seq) for seq in decision.failed]
        if not decision:
            self._wait_for_adapter_loads()
            self._wait_for_grammars()
            return outputs
        to_sample = [s.seq for s in decision.scheduled if s.samples]  # before the run marks tokens computed
        logits = self._run(decision, to_sample)  # [len(to_sample), vocab]
        if any(seq.params.max_tokens == 0 for seq in to_sample):  # prefill only: nothing to sample
            keep = [row for row, seq in enumerate(to_sample) if seq.params.max_tokens != 0]
            outputs += self._finish_prefilled([seq for seq in to_sample if seq.params.max_tokens == 0])
            to_sample, logits = [to_sample[row] for row in keep], logits[keep]
        if to_sample:
            sampled = self._sample(to_sample, logits)
            outputs += self._postprocess(to_sample, sampled)
        return outputs

    def _schedule(self) -> SchedulerOutput:
        """Apply the adapter work other threads queued (between forwards), then decide the step.
        Cached KV of adapters that were unloaded meanwhile is forgotten (it can never be hit)."""
        if self.adapters is not None:
            self.adapters.begin_step()
            if self.adapters.removals != self._retained_at_removals:  # not every step: only after an unload
                self._retained_at_removals = self.adapters.removals
                self.block_manager.retain_adapters(self.adapters.known_ids())
        decision = self.scheduler.schedule()
        now = time.monotonic()
        for seq in decision.admitted:  # the first admission ends the queued time (not a readmission)
            if seq.state is not None and seq.state.scheduled_time is None:
                seq.state.scheduled_time = now
        if self.block_manager.enable_prefix_caching:
            for seq in decision.admitted:  # their computed tokens so far are the cached ones
                adapter = seq.adapter.name if seq.adapter is not None else ""
                self.stats.count_prefix_lookup(adapter, seq.num_tokens, seq.num_computed_tokens)
        return decision

    def _wait_for_adapter_loads(self) -> None:
        """Nothing could run: when only requests for loading adapters wait, block briefly on
        their loads instead of spinning."""
        if self.adapters is not None and self.scheduler.waiting and not self.scheduler.running:
            self.adapters.wait_for_loads(timeout=0.01)

    def _wait_for_grammars(self) -> None:
        """Nothing could run: when requests wait only on their grammars, block briefly on the
        compiles instead of spinning."""
        if self._compiling and not self.scheduler.running:
            futures.wait([f for _, f in self._compiling.values()], timeout=0.01, return_when=futures.FIRST_COMPLETED)

    def _run(self, decision: SchedulerOutput, to_sample: list[Sequence]) -> torch.Tensor:
        """The model over the scheduled tokens -> logits [len(to_sample), vocab]; their KV is
        now cached."""
        result = self.runner.execute(decision.scheduled)
        self._score_prompts(decision.scheduled, result.prompt_hidden)  # before the chunks count as computed
        self.scheduler.on_step_done(decision.scheduled)
        self.stats.num_steps += 1
        step_tokens = decision.num_batched_tokens
        self.stats.iteration_tokens[step_tokens] = self.stats.iteration_tokens.get(step_tokens, 0) + 1
        self.stats.num_preemptions += len(decision.preempted)
        self.stats.generation_tokens += sum(1 for s in to_sample if s.params.max_tokens != 0)
        self.stats.prompt_tokens += sum(s.num_prompt_tokens for s in to_sample if not s.output_token_ids)
        return result.logits

    def _score_prompts(self, scheduled: list[ScheduledSeq], prompt_hidden: dict[int, torch.Tensor]) -> None:
        """Prompt logprobs of this step's prefill chunks (hidden rows [rows, hidden] per chunk,
        prompt_logprobs.py). A recompute after preemption scores nothing twice."""
        for i, hidden in prompt_hidden.items():
            seq = scheduled[i].seq
            scored: list = seq.state.prompt_logprobs
            start = seq.num_computed_tokens  # the chunk's rows predict prompt tokens start + 1 ...
            skip = len(scored) - (start + 1)  # rows already scored before a preemption
            if not 0 <= skip < len(hidden):
                continue
            targets = seq.prompt_token_ids[start + 1 + skip : start + 1 + len(hidden)]
            scored += score_prompt_tokens(
                hidden[skip:], targets, self.model.compute_logits, seq.params.prompt_logprobs
            )

    def _finish_prefilled(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """max_tokens 0: the prompt is computed (and scored); the request ends without a token."""
        for seq in seqs:
            self.scheduler.finish(seq, FinishReason.LENGTH)
        return [self._output(seq) for seq in seqs]

    def _sample(self, to_sample: list[Sequence], logits: torch.Tensor) -> SamplerOutput:
        """One token per sequence, each with its own sampling settings and generator; rows with
        a grammar only among the tokens their matcher allows now."""
        constrained = [row for row, seq in enumerate(to_sample) if seq.state.matcher is not None]
        bitmask = None
        if constrained:  # [C, ceil(V / 32)] int32, filled in parallel off the GIL
            bitmask = self.grammars.fill_bitmask([to_sample[row].state.matcher for row in constrained])
        batch = SamplingBatch.build(
            params=[seq.params for seq in to_sample],
            prompt_ids=[seq.prompt_token_ids for seq in to_sample],
            output_ids=[seq.output_token_ids for seq in to_sample],
            generators=[seq.state.generator for seq in to_sample],
            vocab_size=logits.shape[-1],
            device=self.device,
            constrained_rows=constrained,
            token_bitmask=bitmask,
        )
        return self.sampler(logits, batch)

    def _postprocess(self, to_sample: list[Sequence], sampled: SamplerOutput) -> list[RequestOutput]:
        """Append each sampled token, record its logprobs, detokenize, check the stop
        conditions (finishing frees the KV blocks and the adapter slot); one output each."""
        token_ids = sampled.token_ids.tolist()
        chosen_logprobs = sampled.logprobs.tolist() if any(s.params.logprobs is not None for s in to_sample) else None
        top = None
        if sampled.top_logprobs is not None:
            top = (sampled.top_logprobs[0].tolist(), sampled.top_logprobs[1].tolist())

        now = time.monotonic()
        outputs = []
        for row, (seq, token_id) in enumerate(zip(to_sample, token_ids, strict=True)):
            state: _SeqState = seq.state
            seq.output_token_ids.append(token_id)
            if state.first_token_time is None:
                state.first_token_time = now
            if state.logprobs is not None:
                k = seq.params.logprobs or 0
                alternatives = tuple(zip(top[0][row][:k], top[1][row][:k], strict=True)) if top and k else ()
                state.logprobs.append(TokenLogprob(token_id, chosen_logprobs[row], alternatives))
            if state.matcher is not None and not state.matcher.consume_token(token_id):
                # Only a token the mask allowed was sampled, so this is a parser limit or a bug.
                seq.error = f"structured output: {matcher_error(state.matcher)}"
                state.detokenizer.add(token_id)
                reason = FinishReason.ERROR
            else:
                reason = self._check_stop(seq, token_id)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            outputs.append(self._output(seq))
        return outputs

    def _check_stop(self, seq: Sequence, token_id: int) -> FinishReason | None:
        state: _SeqState = seq.state
        prev_len = len(state.detokenizer.text)
        state.detokenizer.add(token_id)
        if state.stop.on_token(token_id, state.detokenizer.text, prev_len):
            return FinishReason.STOP
        if state.matcher is not None and state.matcher.is_stopped():  # the grammar is complete
            return FinishReason.STOP
        max_tokens = seq.params.max_tokens
        if max_tokens is not None and seq.num_output_tokens >= max_tokens:
            return FinishReason.LENGTH
        # The context length, or all the KV cache there is: the sequence cannot grow further.
        if seq.num_tokens >= min(self.max_model_len, self.block_manager.capacity_tokens):
            return FinishReason.LENGTH
        return None

    def _output(self, seq: Sequence) -> RequestOutput:
        state: _SeqState = seq.state
        finished = seq.is_finished
        if finished:
            state.detokenizer.flush()
        text = state.stop.visible_text(state.detokenizer.text, finished)
        delta = text[state.emitted_chars :]
        state.emitted_chars = len(text)
        new_ids = seq.output_token_ids[state.emitted_tokens :]
        new_logprobs = state.logprobs[state.emitted_tokens :] if state.logprobs is not None else None
        state.emitted_tokens = seq.num_output_tokens
        now = time.monotonic()
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=text,
            delta_text=delta,
            delta_token_ids=new_ids,
            finished=finished,
            finish_reason=str(seq.finish_reason) if finished else None,
            usage=Usage(
                seq.num_prompt_tokens, seq.num_output_tokens, min(seq.num_cached_tokens, seq.num_prompt_tokens)
            ),
            delta_logprobs=new_logprobs,
            time_to_first_token=(state.first_token_time - seq.arrival_time) if state.first_token_time else None,
            latency=(now - seq.arrival_time) if finished else None,
            queue_time=(state.scheduled_time - seq.arrival_time) if state.scheduled_time else None,
            adapter_tier=state.adapter_tier,
            error=seq.error,
            prompt_logprobs=self._prompt_logprobs(seq),
        )

    @staticmethod
    def _prompt_logprobs(seq: Sequence) -> list[TokenLogprob | None] | None:
        scored = seq.state.prompt_logprobs
        return scored if scored is not None and len(scored) == seq.num_prompt_tokens else None

    # -- adapters (safe from any thread) ---------------------------------------------
    def add_adapter(
        self, name: str, path: str | Path, *, pin: bool = False, wait: bool = True
    ) -> AdapterInfo | Future:
        """Validate and load a PEFT adapter directory under `name` (into the host tier).
        wait=True: returns its AdapterInfo or raises AdapterError; wait=False: a Future of it."""
        adapters = self._require_adapters()
        self._check_adapter_name(name)
        future = adapters.add(name, path, pin=pin)
        return future.result() if wait else future

    def remove_adapter(self, name: str) -> None:
        """New requests can no longer use `name`; those already running finish with it."""
        self._require_adapters().remove(name)

    def pin_adapter(self, name: str, pinned: bool = True) -> None:
        """Pinned adapters are never evicted (at most max_loras - 1 of them)."""
        self._require_adapters().pin(name, pinned)

    def list_adapters(self) -> list[AdapterInfo]:
        return self.adapters.describe() if self.adapters else []

    def has_adapter(self, name: str) -> bool:
        return self.adapters is not None and self.adapters.has(name)

    def lora_stats(self) -> dict:
        return self.adapters.stats() if self.adapters is not None else CacheStats().as_dict()

    def memory_stats(self) -> dict[str, int]:
        """Bytes held: base weights, KV cache, adapter slots (device), adapters in host memory,
        free host blocks kept for adapter loads."""
        adapters = self.adapters.memory() if self.adapters else {"adapter_slots": 0, "host_adapters": 0, "adapter_buffers": 0}
        return {
            "base_weights": sum(t.nbytes for t in (*self.model.parameters(), *self.model.buffers()))
            + packed_nbytes(self.model)
            # the fp32 copies the matmul plan keeps (fp32-cached; 0 on the other paths)
            + sum(getattr(m, "weight32_nbytes", 0) for m in self.model.modules()),
            "kv_cache": sum(k.nbytes + v.nbytes for k, v in self.kv_caches),
            **adapters,
        }

    def _require_adapters(self) -> AdapterManager:
        if self.adapters is None:
            raise ValueError("lora: LoRA is disabled on this engine (max_loras is 0)")
        return self.adapters

    def _check_adapter_name(self, name: str) -> None:
        if name == self.model_name:
            raise ValueError(f"lora_name: {name!r} is the base model's name")

    # -- load ----------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._compiling)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use (0..1)."""
        return self.block_manager.usage

    def shutdown(self) -> None:
        self.grammars.shutdown()
        if self.adapters is not None:
            self.adapters.shutdown()

    # -- convenience --------------------------------------------------------------
    def run_until_done(self, request_ids: Seq[str]) -> dict[str, RequestOutput]:
        """Step until every request in `request_ids` finished; returns their final outputs."""
        pending, done = set(request_ids), {}
        while pending:
            for out in self.step():
                if out.finished and out.request_id in pending:
                    done[out.request_id] = out
                    pending.discard(out.request_id)
        return done
