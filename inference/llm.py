"""Offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, like vLLM's.

    llm = LLM()                                    # the default SmolLM2 GGUF
    [out] = llm.generate("The capital of France is", SamplingParams(max_tokens=16, temperature=0))
    out.text, out.token_ids, out.finish_reason, out.usage
    llm.chat([{"role": "user", "content": "Hi"}])  # chat messages through the checkpoint's template
    for delta in llm.stream("Once upon a time"):  # streaming deltas
        print(delta.delta_text, end="")

All prompts of one call run together through continuous batching.
"""

from __future__ import annotations

from collections.abc import Iterator

from inference.config import EngineConfig
from inference.engine.llm_engine import LLMEngine
from inference.engine.outputs import RequestOutput
from inference.engine.sampling_params import SamplingParams

Messages = list[dict]


class LLM:
    def __init__(self, model: str | None = None, *, progress: bool = False, **engine_kwargs: object) -> None:
        config = EngineConfig.from_env(model=model, **engine_kwargs)
        self.engine = LLMEngine(config, progress=progress)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Prompts as text or token ids; one SamplingParams for all or one per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([{"prompt": p} for p in prompts], params)

    def chat(
        self, conversations: Messages | list[Messages], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self._run([{"messages": m} for m in conversations], params)

    def stream(
        self, prompt: str | list[int] | None = None, params: SamplingParams | None = None, *, messages: Messages | None = None
    ) -> Iterator[RequestOutput]:
        """Yields this request's outputs step by step; `delta_text` pieces concatenate to the final text."""
        request_id = self.engine.add_request(prompt, params, messages=messages)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(request_id)  # no-op once finished; frees KV if the caller stops early

    def _run(self, requests: list[dict], params: SamplingParams | list[SamplingParams] | None) -> list[RequestOutput]:
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(requests)
        if len(params) != len(requests):
            raise ValueError(f"params: {len(params)} SamplingParams for {len(requests)} prompts")
        ids: list[str] = []
        try:
            for request, p in zip(requests, params, strict=True):
                ids.append(self.engine.add_request(params=p, **request))
        except ValueError:
            for request_id in ids:  # all or nothing: don't leave half a batch running
                self.engine.abort_request(request_id)
            self.engine.step()
            raise
        done = self.engine.run_until_done(ids)
        return [done[i] for i in ids]
