"""Offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, like vLLM's.

    llm = LLM()                                    # the default SmolLM2 GGUF
    [out] = llm.generate("The capital of France is", SamplingParams(max_tokens=16, temperature=0))
    out.text, out.token_ids, out.finish_reason, out.usage
    llm.chat([{"role": "user", "content": "Hi"}])  # chat messages through the checkpoint's template
    for delta in llm.stream("Once upon a time"):  # streaming deltas
        print(delta.delta_text, end="")
    llm.generate(prompts, params, lora=LoRARequest("pirate", "adapters/pirate"))  # a LoRA adapter
    llm.generate(prompts, params, lora=["pirate", None])  # one adapter (or None: base) per prompt
    llm.generate(prompt, SamplingParams(structured_output=StructuredOutput.json_schema(schema)))

All prompts of one call run together through continuous batching.
"""

from __future__ import annotations

from collections.abc import Iterator

from inference.config import EngineConfig
from inference.engine.llm_engine import LLMEngine
from inference.engine.outputs import RequestOutput
from inference.engine.sampling_params import SamplingParams
from inference.lora.request import LoRARequest

Messages = list[dict]
LoRA = str | LoRARequest | None


class LLM:
    def __init__(self, model: str | None = None, *, progress: bool = False, **engine_kwargs: object) -> None:
        config = EngineConfig.from_env(model=model, **engine_kwargs)
        self.engine = LLMEngine(config, progress=progress)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        lora: LoRA | list[LoRA] = None,
    ) -> list[RequestOutput]:
        """Prompts as text or token ids; one SamplingParams for all or one per prompt; one
        adapter (a registered name or a LoRARequest) for all or one per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([{"prompt": p} for p in prompts], params, lora)

    def chat(
        self,
        conversations: Messages | list[Messages],
        params: SamplingParams | list[SamplingParams] | None = None,
        lora: LoRA | list[LoRA] = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self._run([{"messages": m} for m in conversations], params, lora)

    def stream(
        self,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        *,
        messages: Messages | None = None,
        lora: LoRA = None,
    ) -> Iterator[RequestOutput]:
        """Yields this request's outputs step by step; `delta_text` pieces concatenate to the final text."""
        request_id = self.engine.add_request(prompt, params, messages=messages, lora=lora)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(request_id)  # no-op once finished; frees KV if the caller stops early

    def add_adapter(self, name: str, path: str, *, pin: bool = False):
        """Validate and load a PEFT adapter directory under `name`; returns its AdapterInfo."""
        return self.engine.add_adapter(name, path, pin=pin)

    def _run(
        self,
        requests: list[dict],
        params: SamplingParams | list[SamplingParams] | None,
        lora: LoRA | list[LoRA] = None,
    ) -> list[RequestOutput]:
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(requests)
        if len(params) != len(requests):
            raise ValueError(f"params: {len(params)} SamplingParams for {len(requests)} prompts")
        if not isinstance(lora, list):
            lora = [lora] * len(requests)
        if len(lora) != len(requests):
            raise ValueError(f"lora: {len(lora)} adapters for {len(requests)} prompts")
        for p in params:  # compile here, so a bad schema raises StructuredOutputError at once
            if p is not None and p.structured_output is not None:
                self.engine.grammars.compile(p.structured_output)
        ids: list[str] = []
        try:
            for request, p, adapter in zip(requests, params, lora, strict=True):
                ids.append(self.engine.add_request(params=p, lora=adapter, **request))
        except (ValueError, LookupError):
            for request_id in ids:  # all or nothing: don't leave half a batch running
                self.engine.abort_request(request_id)
            self.engine.step()
            raise
        done = self.engine.run_until_done(ids)
        return [done[i] for i in ids]
