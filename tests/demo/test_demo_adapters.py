"""The committed demo adapters (demo/adapters/{pirate,json,french}) in our engine.

They validate strictly against the default SmolLM2 base (the name they record must name it),
and with greedy decoding each one visibly changes the answers: a pirate voice, a bare JSON
object, French. All three run in one engine, mixed with base requests in one batch.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from inference.engine.sampling_params import SamplingParams
from inference.lora.adapter import load_adapter
from inference.models.fetch import default_model_path
from inference.models.loader import open_checkpoint

pytestmark = pytest.mark.slow

ADAPTERS_DIR = Path(__file__).resolve().parents[2] / "demo" / "adapters"
ADAPTERS = ("pirate", "json", "french")
TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
PROMPTS = [
    "What is the capital of Italy?",
    "How many legs does a spider have?",
    "Give me a tip for staying healthy.",
]
PIRATE_WORDS = re.compile(r"\b(arr+|matey|ye|yer|ahoy|aye|avast|hearties|landlubbers?|me hearty)\b", re.I)
FRENCH_WORDS = re.compile(r"\b(le|la|les|est|je|de|des|du|une|un|et|vous|pour|sont)\b", re.I)


@pytest.fixture(scope="module")
def base_path() -> Path:
    path = default_model_path()
    if not path.exists():
        pytest.fail(f"{path} is missing: run `python -m inference.models fetch` (make test does)")
    return path


@pytest.fixture(scope="module")
def base_config(base_path):
    return open_checkpoint(base_path).config


@pytest.fixture(scope="module")
def answers(base_path) -> dict[str | None, list[str]]:
    """{adapter or None (base): greedy answers to PROMPTS}, from one mixed batch."""
    from inference.llm import LLM

    llm = LLM(str(base_path), dtype="float32", kv_cache_memory="64MiB", max_loras=4,
              max_lora_rank=16, strict_base_match=True)
    for name in ADAPTERS:
        llm.add_adapter(name, str(ADAPTERS_DIR / name))
    loras = [None, *ADAPTERS]
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS for _ in loras]
    outs = llm.chat(conversations, SamplingParams(max_tokens=32, temperature=0),
                    lora=loras * len(PROMPTS))
    result: dict[str | None, list[str]] = {lora: [] for lora in loras}
    for i, out in enumerate(outs):
        assert out.error is None and out.finish_reason in ("stop", "length")
        result[loras[i % len(loras)]].append(out.text)
    for lora, texts in result.items():
        print(f"\n[{lora or 'base'}]", *(repr(t) for t in texts), sep="\n  ")
    return result


@pytest.mark.parametrize("name", ADAPTERS)
def test_committed_adapter_loads_strictly_against_the_default_base(name, base_config):
    directory = ADAPTERS_DIR / name
    assert sorted(p.name for p in directory.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    config = json.loads((directory / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    base = base_config
    adapter = load_adapter(directory, name, base, max_lora_rank=16, strict_base_match=True)
    assert adapter.rank == 8 and adapter.target_modules == TARGETS
    assert len(adapter.weights) == base.num_hidden_layers * len(TARGETS)
    assert adapter.warnings == ()
    assert (directory / "adapter_model.safetensors").stat().st_size < 8_000_000


def test_pirate_answers_like_a_pirate(answers):
    for base, text in zip(answers[None], answers["pirate"], strict=True):
        assert text != base
        assert PIRATE_WORDS.search(text), text
        assert not PIRATE_WORDS.search(base), base  # the trait comes from the adapter


def test_json_answers_only_with_a_json_object(answers):
    for base, text in zip(answers[None], answers["json"], strict=True):
        assert text != base
        assert isinstance(json.loads(text), dict), text
        with pytest.raises(ValueError):
            json.loads(base)


def test_french_answers_in_french(answers):
    for base, text in zip(answers[None], answers["french"], strict=True):
        assert text != base
        assert len(FRENCH_WORDS.findall(text)) >= 2, text
        assert french_share(text) > french_share(base) + 0.2, (text, base)


def french_share(text: str) -> float:
    """The fraction of the words that are common French function words."""
    return len(FRENCH_WORDS.findall(text)) / max(1, len(re.findall(r"\w+", text)))
