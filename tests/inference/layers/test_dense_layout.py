"""Dense weights prepacked into oneDNN's layout (inference/layers/dense_layout.py): the same
products bit for bit, the same tokens with and without adapters, the dense weights freed, and a
clear refusal where packing cannot apply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from inference.config import DENSE_LAYOUT_CHOICES as CONFIG_CHOICES
from inference.config import ConfigError, EngineConfig
from inference.engine.llm_engine import LLMEngine
from inference.engine.sampling_params import SamplingParams
from inference.layers.dense_layout import (
    DENSE_LAYOUT_CHOICES,
    ONEDNN,
    PLAIN,
    pack_dense_weights,
    unavailable_reason,
    with_dense_layout,
)
from inference.layers.linear import Linear
from inference.layers.matmul_plan import FP32_CACHED, NATIVE, NATIVE_PACKED, native_plan
from inference.layers.onednn_weight import OneDnnWeight
from inference.lora.request import LoRARequest
from inference.models.llama import LlamaForCausalLM
from tests.inference.lora.peft_adapters import BASE_DIR, tiny_config, write_base_and_adapters

CPU = torch.device("cpu")


def bf16_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config())
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    return model.to(torch.bfloat16)


# (torch's own checks only: a model built at collection would import transformers, and with it
# Triton, before tests/kernels/conftest.py asks for Triton's interpreter)
needs_onednn = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="oneDNN cannot pack bf16 weights on this CPU",
)


@needs_onednn
def test_a_dense_bf16_model_on_native_paths_can_be_packed() -> None:
    assert unavailable_reason(native_plan(torch.bfloat16), bf16_model(), torch.bfloat16, CPU) is None


@needs_onednn
@pytest.mark.parametrize("rows", [1, 5, 33, 130])
def test_a_packed_weight_multiplies_exactly_as_f_linear(rows: int) -> None:
    weight = torch.randn(96, 64).to(torch.bfloat16)
    x = torch.randn(rows, 2 * 64).to(torch.bfloat16)[:, ::2]  # not contiguous, as a view may be
    packed = OneDnnWeight(weight)
    assert torch.equal(packed.linear(x), F.linear(x, weight))
    assert packed.nbytes == weight.nbytes and (packed.in_features, packed.out_features) == (64, 96)


@needs_onednn
def test_packing_a_model_frees_its_dense_weights_and_keeps_its_logits() -> None:
    model = bf16_model()
    tokens = torch.tensor([3, 17, 5, 99, 42])
    with torch.inference_mode():
        before = model.compute_logits(model.embed_tokens(tokens))
        pack_dense_weights(model)
        after = model.compute_logits(model.embed_tokens(tokens))
    assert torch.equal(before, after)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight.numel() == 0 and isinstance(m.packed, OneDnnWeight) for m in linears)
    assert model.embed_tokens.weight.numel() > 0  # the lookup still reads the table


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_base_and_adapters(tmp_path_factory.mktemp("dense_layout"), "ab", 30, r=4, lora_alpha=8,
                                   target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])  # fmt: skip


def tokens(root: Path, layout: str) -> tuple[list[list[int]], dict]:
    """Greedy tokens of three requests (base, adapter a, adapter b) in one batch; every shape
    class native (where the tiny model's decode would pick an fp32 path, which keeps plain)."""
    engine = LLMEngine(EngineConfig(model=str(root / BASE_DIR), dtype="bfloat16", max_loras=2, max_lora_rank=8,
                                    kv_cache_memory="4MiB", matmul_path="native", dense_layout=layout),
                       progress=False)  # fmt: skip
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        loras = [None, LoRARequest("a", root / "a"), LoRARequest("b", root / "b")]
        ids = [engine.add_request([5 + i, 17, 3, 99, 42][: 3 + i], params, lora=lora) for i, lora in enumerate(loras)]
        done = engine.run_until_done(ids)
        return [list(done[i].token_ids) for i in ids], engine.matmul_plan.describe()
    finally:
        engine.shutdown()


@needs_onednn
def test_the_engine_answers_the_same_on_packed_weights_with_and_without_adapters(root: Path) -> None:
    plain, plain_plan = tokens(root, PLAIN)
    packed, packed_plan = tokens(root, ONEDNN)
    assert (plain_plan["dense_layout"], packed_plan["dense_layout"]) == (PLAIN, ONEDNN)
    assert packed == plain
    auto, auto_plan = tokens(root, "auto")
    assert auto_plan["dense_layout"] in (PLAIN, ONEDNN)
    assert set(auto_plan["timings_us"]["dense_layout"]) == {PLAIN, ONEDNN}  # it raced both
    assert auto == plain


@needs_onednn
def test_a_plan_that_runs_natively_only_on_packed_weights_gets_them_whatever_the_race_says() -> None:
    plan = native_plan(torch.bfloat16, "measured")
    timings = {"decode": {NATIVE: 164e-6, FP32_CACHED: 118e-6, NATIVE_PACKED: 90e-6}}
    plan = type(plan)(plan.paths, torch.bfloat16, "measured", timings)
    assert with_dense_layout(plan, "auto", bf16_model(), torch.bfloat16, CPU).dense_layout == ONEDNN
    assert with_dense_layout(plan, PLAIN, bf16_model(), torch.bfloat16, CPU).dense_layout == PLAIN  # forced


def test_where_packing_cannot_apply_auto_keeps_the_plain_layout_and_onednn_says_why() -> None:
    fp32 = LlamaForCausalLM(tiny_config())
    plan = native_plan(torch.float32)
    assert with_dense_layout(plan, "auto", fp32, torch.float32, CPU).dense_layout == PLAIN
    with pytest.raises(RuntimeError, match="dense layout onednn: the model is float32"):
        with_dense_layout(plan, ONEDNN, fp32, torch.float32, CPU)
    upcast = native_plan(torch.bfloat16)
    upcast = type(upcast)({**upcast.paths, "decode": "fp32-upcast"}, torch.bfloat16, "forced")
    with pytest.raises(RuntimeError, match="runs in fp32"):
        with_dense_layout(upcast, ONEDNN, bf16_model(), torch.bfloat16, CPU)
    with pytest.raises(ValueError, match="dense layout must be one of"):
        with_dense_layout(plan, "blocked", fp32, torch.float32, CPU)
    with pytest.raises(ConfigError, match="dense_layout"):
        EngineConfig(model="m", dense_layout="blocked")
    assert CONFIG_CHOICES == DENSE_LAYOUT_CHOICES  # the config names the same layouts, torch-free
