"""lm-evaluation-harness against a real worker, the way a fine-tune served by vLLM is scored: its
`local-completions` model sends each (context, continuation) as token ids with `echo: true`,
`logprobs: 1`, `max_tokens: 1`, and sums the continuation's echoed prompt logprobs. A five-question
multiple-choice task from the repository (lm_eval_tasks/, local JSONL, nothing downloaded) runs
for the base and for an adapter; the base's per-choice loglikelihoods must equal transformers'
on the same tokens, the adapter's PEFT's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.inference.server.conftest import TINY
from tests.inference.server.server_process import ROOT

TASKS = Path(__file__).parent / "lm_eval_tasks"
TASK = "loraplex_tiny_mc"
TOLERANCE = 1e-4  # fp32 worker vs fp32 transformers, as tests/inference/models/test_llama_parity.py


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tiny_lora, tmp_path_factory) -> Path:
    """The tiny model's tokenizer.json with the config AutoTokenizer needs (lm-eval loads it)."""
    base, _ = tiny_lora
    out = tmp_path_factory.mktemp("lm_eval_tokenizer")
    shutil.copy(base / "tokenizer.json", out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0", "pad_token": "t0"}))
    return out


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """Nothing fetched from a hub; the datasets cache in tmp; the task's data_files path is
    relative to the repository root."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.chdir(ROOT)


def evaluate(server, model: str, tokenizer_dir: Path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    model_args = ",".join([
        f"model={model}", f"base_url={server.url}/v1/completions", "tokenizer_backend=huggingface",
        f"tokenizer={tokenizer_dir}", "batch_size=4", "max_length=200", "max_retries=1", "timeout=60",
    ])
    return lm_eval.simple_evaluate(
        model="local-completions", model_args=model_args, tasks=[TASK], log_samples=True,
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
    )


def choice_loglikelihoods(results: dict) -> dict[tuple[str, str], float]:
    """(context, continuation) -> the loglikelihood lm-eval got for it."""
    out = {}
    for sample in results["samples"][TASK]:
        for args, response in zip(sample["arguments"], sample["filtered_resps"], strict=True):
            context, continuation = args if isinstance(args, list | tuple) else (args["arg_0"], args["arg_1"])
            out[(context, continuation)] = float(response[0])
    return out


def oracle(model, context: str, continuation: str) -> float:
    """sum over the continuation's tokens of log p(token | everything before it)."""
    ctx = [int(w[1:]) for w in context.split()]
    ids = ctx + [int(w[1:]) for w in continuation.split()]
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [len, vocab]
    return sum(logprobs[p - 1, ids[p]].item() for p in range(len(ctx), len(ids)))


def test_lm_eval_multiple_choice_for_the_base_and_an_adapter(lora_server, tiny_lora, hf_tokenizer_dir, offline):
    import transformers
    from peft import PeftModel

    base_dir, adapters = tiny_lora
    base = evaluate(lora_server, TINY, hf_tokenizer_dir)
    tuned = evaluate(lora_server, "ad0", hf_tokenizer_dir)

    for results in (base, tuned):
        assert 0 <= results["results"][TASK]["acc,none"] <= 1
        assert len(results["samples"][TASK]) == 5
    base_ll, tuned_ll = choice_loglikelihoods(base), choice_loglikelihoods(tuned)
    assert len(base_ll) == 20 and base_ll.keys() == tuned_ll.keys()  # 5 questions x 4 choices

    hf = transformers.LlamaForCausalLM.from_pretrained(base_dir).eval()
    worst = max(abs(ll - oracle(hf, *pair)) for pair, ll in base_ll.items())
    peft = PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base_dir), adapters["ad0"]).eval()
    worst_adapter = max(abs(ll - oracle(peft, *pair)) for pair, ll in tuned_ll.items())
    print(f"\nmax |loglikelihood - oracle|: base vs transformers {worst:.3g}, ad0 vs PEFT {worst_adapter:.3g}")
    assert worst < TOLERANCE and worst_adapter < TOLERANCE
    assert max(abs(base_ll[p] - tuned_ll[p]) for p in base_ll) > 1e-2  # the adapter changes the scores
