"""Multi-LoRA end to end against PEFT itself: a tiny random fp32 Llama checkpoint, seven PEFT
adapters written by PEFT's `save_pretrained` (ranks 4…64, attention-only, MLP-only, all seven
projections, q+v, rsLoRA, layers skipped), and a mixed batch of requests over them and the base.

The oracle is PEFT's mixed-adapter generation (`generate(..., adapter_names=[...])`, "__base__"
for base rows) on a left-padded batch with its attention mask; PEFT's greedy choices are
checked to have clear margins, so "token for token" is a fair demand in fp32. Our engine gets
every request at once (`add_request(..., lora=LoRARequest(name, path))`) and must agree exactly,
alone or batched, with fewer slots than adapters in flight, next to adapters that fail
validation, and when many requests ask for the same cold adapter at once.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference.config import EngineConfig
from inference.engine.llm_engine import LLMEngine
from inference.engine.sampling_params import SamplingParams
from inference.lora.request import LoRARequest
from kernels import cpu_fused
from tests.inference.models.tiny_llama import write_tiny_checkpoint, write_word_tokenizer

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name -> LoraConfig kwargs
    "attn_r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp_r8": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all_r16": dict(r=16, lora_alpha=32, target_modules=ALL),
    "qv_r32": dict(r=32, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "rslora_r64": dict(r=64, lora_alpha=8, use_rslora=True, target_modules=ALL),
    "skip_layer1_r8": dict(
        r=8, lora_alpha=16, target_modules=ALL, layers_to_transform=[0, 2], layers_pattern="layers"
    ),
    "regex_r12": dict(r=12, lora_alpha=24, target_modules=r".*\.(k_proj|o_proj|up_proj)"),
}
NAMES = list(ADAPTERS)
BASE = None  # a base-only request
# 21 requests: every adapter three times, the base three times, prompts of 1…60 tokens.
PROMPT_LENS = [3, 9, 17, 25, 33, 41, 1, 50, 12, 7, 29, 60, 5, 21, 38, 14, 2, 44, 19, 27, 8]
ROUTES = [(NAMES + [BASE])[i % (len(NAMES) + 1)] for i in range(len(PROMPT_LENS))]
MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


# --- the checkpoint, the adapters, the requests -----------------------------------------------


def write_adapter(base_dir: Path, out: Path, seed: int, **lora_kwargs) -> None:
    """PEFT LoRA on a fresh copy of the base, random A and B (init_lora_weights=False), saved."""
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.LlamaForCausalLM.from_pretrained(base_dir).eval()
    torch.manual_seed(seed)
    peft_model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_kwargs))
    # save_embedding_layers=False: "auto" would ask the Hub whether the vocabulary changed
    peft_model.save_pretrained(out, save_embedding_layers=False)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """base/ (HF checkpoint + tokenizer.json) and one directory per adapter, plus two bad ones."""
    root = tmp_path_factory.mktemp("multi_lora")
    hf = write_tiny_checkpoint(root / "base")
    write_word_tokenizer(root / "base", hf.config.vocab_size)
    for i, (name, kwargs) in enumerate(ADAPTERS.items()):
        write_adapter(root / "base", root / name, seed=100 + i, **kwargs)
    # Refused by validation: a rank above max_lora_rank, and a NaN in otherwise good weights.
    write_adapter(root / "base", root / "bad_rank", seed=200, r=128, lora_alpha=16, target_modules=["q_proj"])
    shutil.copytree(root / "attn_r4", root / "bad_nan")
    weights_file = root / "bad_nan" / "adapter_model.safetensors"
    tensors = load_file(weights_file)
    key = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, weights_file, metadata={"format": "pt"})
    return root


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in PROMPT_LENS]


def lora_request(workdir: Path, name: str | None) -> LoRARequest | None:
    return None if name is None else LoRARequest(name, workdir / name)


# --- the oracle: PEFT mixed-adapter batches ---------------------------------------------------


@pytest.fixture(scope="module")
def peft_model(workdir: Path):
    """The base with every good adapter loaded under its name, eval mode, no EOS stop."""
    import transformers
    from peft import PeftModel

    base = transformers.LlamaForCausalLM.from_pretrained(workdir / "base").eval()
    model = PeftModel.from_pretrained(base, workdir / NAMES[0], adapter_name=NAMES[0])
    for name in NAMES[1:]:
        model.load_adapter(workdir / name, adapter_name=name)
    model.eval()
    model.generation_config.eos_token_id = None  # our requests use ignore_eos
    return model


def peft_generate(model, prompts: list[list[int]], routes: list[str | None]) -> tuple[list[list[int]], float]:
    """PEFT's greedy mixed-adapter batch, left padded -> (new tokens per row, the smallest gap
    between the chosen logit and the runner-up over every row and step)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            adapter_names=["__base__" if r is None else r for r in routes],
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_scores=True,
        )
    top2 = torch.stack(out.scores).topk(2, dim=-1).values  # [steps, rows, 2]
    return out.sequences[:, width:].tolist(), (top2[..., 0] - top2[..., 1]).min().item()


@pytest.fixture(scope="module")
def expected(peft_model, prompts) -> list[list[int]]:
    tokens, margin = peft_generate(peft_model, prompts, ROUTES)
    assert margin > 1e-3, f"PEFT's greedy choices are near ties (margin {margin:g}); pick other seeds"
    assert all(len(t) == MAX_TOKENS for t in tokens)
    return tokens


# --- our engine ---------------------------------------------------------------------------------


def make_engine(workdir: Path, **kwargs) -> LLMEngine:
    config = dict(
        model=str(workdir / "base"), dtype="float32", max_lora_rank=64, kv_cache_memory=8 << 20
    )
    return LLMEngine(EngineConfig(**{**config, **kwargs}), progress=False)


def run(engine: LLMEngine, workdir: Path, prompts, routes) -> list:
    """Submit every request at once, step until all finish; outputs in submission order."""
    ids = [
        engine.add_request(p, GREEDY, lora=lora_request(workdir, r))
        for p, r in zip(prompts, routes, strict=True)
    ]
    done = engine.run_until_done(ids)
    return [done[i] for i in ids]


def mismatches(outs, expected, routes, indices=None) -> list[str]:
    """One line per request whose tokens differ: adapter, prompt length, first differing step."""
    lines = []
    for k, (out, want) in enumerate(zip(outs, expected, strict=True)):
        i = k if indices is None else indices[k]
        got = list(out.token_ids)
        if got != want:
            step = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
            lines.append(
                f"request {i} ({routes[k] or 'base'}, prompt {PROMPT_LENS[i]} tokens): first difference at "
                f"step {step}: ours {got[step:step + 3]} vs PEFT {want[step:step + 3]} "
                f"(finish {out.finish_reason}, error {getattr(out, 'error', None)})"
            )
    return lines


@pytest.fixture(scope="module", params=["fused", "torch"])
def engine(workdir, request) -> LLMEngine:
    """Each set of CPU kernels forced: the fused C++ ones (kernels/cpu_fused.py: the LoRA delta
    and the paged decode attention) and torch ops."""
    engine = make_engine(workdir, max_loras=8, max_cpu_loras=16, lora_kernel=request.param,
                         attention_kernel=request.param)  # fmt: skip
    assert engine.matmul_plan.lora_kernel == engine.matmul_plan.attention_kernel == request.param
    return engine


@pytest.fixture(scope="module")
def mixed(engine, workdir, prompts) -> list:
    return run(engine, workdir, prompts, ROUTES)


def test_mixed_batch_equals_peft_mixed_batch(mixed, expected):
    bad = mismatches(mixed, expected, ROUTES)
    assert not bad, "ours vs PEFT adapter_names batch:\n" + "\n".join(bad)
    assert all(o.finish_reason == "length" and o.error is None for o in mixed)


def test_adapter_vs_base_on_the_same_prompt(peft_model, prompts, mixed):
    """Guard against a vacuous oracle: on one prompt every adapter changes PEFT's output, and our
    mixed-batch row for that prompt equals PEFT's batch of identical prompts."""
    tokens, _ = peft_generate(peft_model, [prompts[0]] * (len(NAMES) + 1), NAMES + [BASE])
    base = tokens[-1]
    assert all(t != base for t in tokens[:-1]), "an adapter left PEFT's output unchanged"
    assert mixed[0].token_ids == tokens[0]


def test_each_request_alone_equals_its_row_in_the_mixed_batch(engine, workdir, prompts, mixed):
    for i, route in enumerate(ROUTES[: len(NAMES) + 1]):  # every adapter once, and the base
        [alone] = run(engine, workdir, [prompts[i]], [route])
        assert alone.token_ids == mixed[i].token_ids, f"request {i} ({route or 'base'}) alone vs batched"


def test_fewer_slots_than_adapters_in_flight(workdir, prompts, expected):
    small = make_engine(workdir, max_loras=2, max_cpu_loras=3)
    outs = run(small, workdir, prompts, ROUTES)
    bad = mismatches(outs, expected, ROUTES)
    assert not bad, "max_loras=2, max_cpu_loras=3 vs PEFT:\n" + "\n".join(bad)
    stats = small.lora_stats()
    assert stats["evictions"]["device"] > 0
    assert stats["evictions"]["host"] > 0
    assert stats["load_failures"] == 0


@pytest.mark.parametrize(
    ("bad", "reason"),
    [("bad_rank", "r = 128 is above max_lora_rank = 64"), ("bad_nan", "contains nan values")],
)
def test_adapter_failing_validation_errors_alone(engine, workdir, prompts, expected, bad, reason):
    resident = {a.name for a in engine.list_adapters() if a.tier in ("device", "host")}
    indices = [0, 1, 2, 6]  # three adapters and the base around the bad one
    ids = [engine.add_request(prompts[i], GREEDY, lora=lora_request(workdir, ROUTES[i])) for i in indices]
    bad_id = engine.add_request(prompts[3], GREEDY, lora=LoRARequest(bad, workdir / bad))
    done = engine.run_until_done([*ids, bad_id])

    failed = done[bad_id]
    assert failed.finish_reason == "error" and list(failed.token_ids) == []
    assert f"adapter {bad!r}" in failed.error and reason in failed.error.lower()
    outs = [done[i] for i in ids]
    bad_lines = mismatches(outs, [expected[i] for i in indices], [ROUTES[i] for i in indices], indices)
    assert not bad_lines, f"next to {bad}:\n" + "\n".join(bad_lines)
    still = {a.name for a in engine.list_adapters() if a.tier in ("device", "host")}
    assert resident <= still, "a bad adapter evicted a resident one"


def test_concurrent_requests_for_one_cold_adapter_load_it_once(workdir, prompts, expected):
    fresh = make_engine(workdir, max_loras=2)
    indices = [i for i, r in enumerate(ROUTES) if r == "rslora_r64"]
    indices = (indices * 3)[:6]  # six requests for the same cold adapter, submitted together
    outs = run(fresh, workdir, [prompts[i] for i in indices], [ROUTES[i] for i in indices])
    bad = mismatches(outs, [expected[i] for i in indices], [ROUTES[i] for i in indices], indices)
    assert not bad, "\n".join(bad)
    stats = fresh.lora_stats()
    assert stats["loads"] == 1 and stats["load_failures"] == 0
    [info] = [a for a in fresh.list_adapters() if a.name == "rslora_r64"]
    assert info.rank == 64 and info.tier in ("device", "host")


def test_adapter_config_variants_are_what_peft_wrote(workdir):
    """The directories really hold what the test claims (PEFT wrote them, not us)."""
    cfg = {n: json.loads((workdir / n / "adapter_config.json").read_text()) for n in NAMES}
    assert {c["r"] for c in cfg.values()} >= {4, 8, 16, 32, 64}
    assert cfg["rslora_r64"]["use_rslora"] is True
    assert cfg["skip_layer1_r8"]["layers_to_transform"] == [0, 2]
    keys = load_file(workdir / "skip_layer1_r8" / "adapter_model.safetensors").keys()
    assert not any(".layers.1." in k for k in keys) and any(".layers.2." in k for k in keys)


# --- bf16 on each matmul path ---------------------------------------------------------------


def first_logprobs(model, prompts) -> torch.Tensor:
    """PEFT's log-probabilities of each request's first new token, fp32 [requests, vocab]."""
    with torch.inference_mode():
        rows = [model(input_ids=torch.tensor([p]), adapter_names=["__base__" if r is None else r]).logits[0, -1]
                for p, r in zip(prompts, ROUTES, strict=True)]  # fmt: skip
    return torch.stack(rows).float().log_softmax(-1)


@pytest.fixture(scope="module")
def peft_first(peft_model, prompts) -> tuple[torch.Tensor, torch.Tensor]:
    """(PEFT fp32 first-token logprobs: the truth; PEFT's own bf16 error on PEFT's top-5 tokens,
    per request)."""
    import copy

    truth = first_logprobs(peft_model, prompts)
    bf16 = first_logprobs(copy.deepcopy(peft_model).to(torch.bfloat16), prompts)
    top5 = truth.topk(5, dim=-1).indices
    return truth, (bf16.gather(1, top5) - truth.gather(1, top5)).abs().amax(1)


@pytest.mark.parametrize(
    ("path", "kernel"),
    [("auto", "auto"), ("native", "amx"),
     *((p, k) for p in ("native", "fp32-upcast", "fp32-cached") for k in ("fused", "torch"))],
)  # fmt: skip
def test_bf16_mixed_batch_as_accurate_as_peft_bf16_on_every_matmul_path(workdir, prompts, peft_first, path, kernel):
    """A bf16 engine (the default dtype) on each matmul path, forced or as calibration picks it,
    LoRA deltas on that path's stacks and dtype, by each set of CPU kernels (LoRA delta and decode attention). bf16 rounds differently in every
    implementation, so the oracle is accuracy: over the mixed batch our first-token logprobs of
    PEFT's fp32 top-5 are about as close to the fp32 truth as PEFT's own bf16, and wherever the
    truth's choice is clear of that error our greedy token is the truth's."""
    truth, peft_err = peft_first
    if kernel == "amx" and (cpu_fused.fused_op() is None or not cpu_fused.tiles_bf16()):
        pytest.skip("no AMX-BF16 tiles here")
    attention = "fused" if kernel == "amx" else kernel  # amx: the fused LoRA kernel's tile products
    engine = make_engine(
        workdir, dtype="bfloat16", matmul_path=path, lora_kernel=kernel, attention_kernel=attention, max_loras=8,
        max_cpu_loras=16,
    )
    if path != "auto":
        assert set(engine.matmul_plan.paths.values()) == {path}
        assert engine.matmul_plan.lora_dtype == (torch.bfloat16 if path == "native" else torch.float32)
        assert (engine.matmul_plan.lora_kernel, engine.matmul_plan.attention_kernel) == (kernel, attention)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=20)
    ids = [engine.add_request(p, one, lora=lora_request(workdir, r)) for p, r in zip(prompts, ROUTES, strict=True)]
    done = engine.run_until_done(ids)
    ours_err, wrong = [], []
    for i, rid in enumerate(ids):
        [lp] = done[rid].delta_logprobs
        ours = dict(lp.top)
        top5 = truth[i].topk(5).indices.tolist()
        assert all(t in ours for t in top5), f"request {i}: PEFT's top 5 not in our top 20"
        ours_err.append(max(abs(ours[t] - truth[i, t].item()) for t in top5))
        top2 = truth[i].topk(2).values
        if top2[0] - top2[1] > 2 * peft_err.max() and lp.token_id != top5[0]:
            wrong.append(f"request {i} ({ROUTES[i] or 'base'}): ours {lp.token_id} vs {top5[0]}")
    print(f"\n[bf16 {path}] max logprob error vs fp32: ours {max(ours_err):.3g}, PEFT bf16 {peft_err.max():.3g}")
    assert max(ours_err) < 2 * peft_err.max().item()
    assert not wrong, f"bf16 on {path}:\n" + "\n".join(wrong)
