"""Show the demo adapters in our engine: every prompt answered by the base and by each adapter,
all in one mixed batch.

    .venv/bin/python demo/try_adapters.py
    .venv/bin/python demo/try_adapters.py "What is the capital of Italy?" "Tell me a joke."
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference.engine.sampling_params import SamplingParams
from inference.llm import LLM

ADAPTERS_DIR = Path(__file__).resolve().parent / "adapters"
ADAPTERS = ("pirate", "json", "french")
PROMPTS = [
    "What is the capital of Italy?",
    "How many legs does a spider have?",
    "Give me a tip for staying healthy.",
    "What is the tallest animal?",
]


def main(prompts: list[str]) -> None:
    t0 = time.perf_counter()
    llm = LLM()
    for name in ADAPTERS:
        llm.add_adapter(name, str(ADAPTERS_DIR / name))
    print(f"engine + adapters ready in {time.perf_counter() - t0:.1f}s")
    loras = [None, *ADAPTERS]
    conversations = [[{"role": "user", "content": p}] for p in prompts for _ in loras]
    t0 = time.perf_counter()
    outs = llm.chat(conversations, SamplingParams(max_tokens=48, temperature=0), lora=loras * len(prompts))
    print(f"{len(outs)} requests in one batch: {time.perf_counter() - t0:.1f}s")
    for i, prompt in enumerate(prompts):
        print(f"\n### {prompt}")
        for j, lora in enumerate(loras):
            print(f"  {lora or 'base':>6}: {outs[i * len(loras) + j].text!r}")


if __name__ == "__main__":
    main(sys.argv[1:] or PROMPTS)
