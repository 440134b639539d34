"""validate_adapter_dir judges a PEFT directory as the engine does, collecting every reason."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from portal.adapters.validation import SMOLLM2_135M, BaseShapes, validate_adapter_dir
from tests.portal.adapters.peft_files import TINY, peft_config, write_peft

Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def reasons_for(tmp_path, **kwargs) -> list[str]:
    result = validate_adapter_dir(write_peft(tmp_path / "a", **kwargs), TINY)
    assert not result.ok
    return result.reasons


def test_a_good_adapter_passes_with_its_facts(tmp_path) -> None:
    result = validate_adapter_dir(write_peft(tmp_path / "a", rank=4), TINY)
    assert result.ok and result.reasons == []
    assert (result.rank, result.alpha, result.target_modules) == (4, 8.0, ["q_proj", "v_proj"])
    assert result.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert set(result.file_sha256) == {"adapter_config.json", "adapter_model.safetensors"}
    assert result.size_bytes == sum(p.stat().st_size for p in (tmp_path / "a").iterdir())


def test_the_default_models_shapes(tmp_path) -> None:
    result = validate_adapter_dir(write_peft(tmp_path / "a", SMOLLM2_135M, rank=2), SMOLLM2_135M)
    assert result.ok, result.reasons
    assert not validate_adapter_dir(write_peft(tmp_path / "b", TINY), SMOLLM2_135M).ok


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (peft_config(use_dora=True), "DoRA adapters are not supported"),
        (peft_config(modules_to_save=["lm_head"]), "modules_to_save"),
        (peft_config(r=16), "r = 16 is above the fleet's max LoRA rank of 8"),
        (peft_config(target_modules=["lm_head"]), "not a supported target module"),
        (peft_config(target_modules=["nope"]), "matches no module of the base model"),
        (peft_config(peft_type="IA3"), "peft_type 'IA3' is not supported"),
        (peft_config(bias="all"), "bias 'all' is not supported"),
        (peft_config(init_lora_weights="pissa"), "modified in place"),
        (peft_config(base_model_name_or_path="meta-llama/Llama-3.1-8B"), "names a different model"),
        (peft_config(lora_alpha="x"), "lora_alpha must be a finite number"),
        (peft_config(rank_pattern={"q_proj": 32}), "rank_pattern['q_proj'] = 32 is above"),
    ],
)
def test_config_reasons(tmp_path, config, reason) -> None:
    reasons = reasons_for(tmp_path, config=config, rank=config["r"] if config["r"] <= 8 else 4)
    assert any(reason in r for r in reasons), reasons


def test_an_unreadable_config(tmp_path) -> None:
    directory = write_peft(tmp_path / "a")
    (directory / "adapter_config.json").write_text("{not json")
    assert any("adapter_config.json is not valid JSON" in r for r in validate_adapter_dir(directory, TINY).reasons)
    (directory / "adapter_config.json").write_text("[1, 2]")
    assert validate_adapter_dir(directory, TINY).reasons == ["adapter_config.json must hold a JSON object, got list"]


def test_pickle_files_and_missing_files(tmp_path) -> None:
    directory = tmp_path / "a"
    directory.mkdir()
    (directory / "adapter_model.bin").write_bytes(b"\x80\x04pickle")
    reasons = validate_adapter_dir(directory, TINY).reasons
    assert any("adapter_model.bin is a pickle file" in r for r in reasons)
    assert "missing adapter_config.json" in reasons and "missing adapter_model.safetensors" in reasons


def test_wrong_shapes(tmp_path) -> None:
    def widen(t):
        t[Q_A] = np.zeros((4, 17), np.float32)

    reasons = reasons_for(tmp_path, edit=widen)
    assert any(f"tensor {Q_A!r} has shape [4, 17]" in r and "[4, 16]" in r for r in reasons), reasons


@pytest.mark.parametrize(("value", "word"), [(np.nan, "NaN"), (np.inf, "Inf"), (-np.inf, "Inf")])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_nan_and_inf(tmp_path, value, word, dtype) -> None:
    def poison(t):
        for k in t:
            t[k] = t[k].astype(dtype)
        t[Q_A][1, 3] = value

    assert reasons_for(tmp_path, edit=poison) == [f"tensor {Q_A!r} contains {word} values"]


def test_bf16_nan_is_found_without_torch(tmp_path) -> None:
    directory = write_peft(tmp_path / "a")
    # Rewrite one tensor as BF16 by hand (numpy has no bfloat16): 0x7FC0 is a NaN.
    path = directory / "adapter_model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    begin, end = header[Q_A]["data_offsets"]
    header[Q_A]["dtype"] = "BF16"
    header[Q_A]["shape"] = [4, 16]
    body = bytearray(data[8 + n :])
    bf16 = np.full(64, 0x3F80, np.uint16)
    bf16[5] = 0x7FC0
    body[begin : begin + 128] = bf16.tobytes()
    header[Q_A]["data_offsets"] = [begin, begin + 128]
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(body))
    assert f"tensor {Q_A!r} contains NaN values" in validate_adapter_dir(directory, TINY).reasons


@pytest.mark.parametrize("cut", [4, 100, -10])
def test_truncated_safetensors(tmp_path, cut) -> None:
    directory = write_peft(tmp_path / "a")
    path = directory / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:cut])
    reasons = validate_adapter_dir(directory, TINY).reasons
    assert len(reasons) == 1 and "adapter_model.safetensors is corrupt or truncated" in reasons[0]


def test_independent_reasons_are_all_reported(tmp_path) -> None:
    def break_it(t):
        t[Q_A] = np.full((4, 17), np.nan, np.float32)

    config = peft_config(use_dora=True, modules_to_save=["lm_head"], base_model_name_or_path="Qwen/Qwen2-7B")
    reasons = reasons_for(tmp_path, config=config, edit=break_it)
    for expected in ("DoRA", "modules_to_save", "has shape [4, 17]", "contains NaN values"):
        assert any(expected in r for r in reasons), (expected, reasons)


def test_a_missing_base_name_is_a_warning_only(tmp_path) -> None:
    result = validate_adapter_dir(write_peft(tmp_path / "a", config=peft_config(base_model_name_or_path=None)), TINY)
    assert result.ok and "is missing" in result.warnings[0]


def test_base_shapes_from_a_worker_config() -> None:
    shapes = BaseShapes.from_config({"name": "x", "num_hidden_layers": 30, "hidden_size": 576,
                                     "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3})
    assert shapes.module_shapes() == SMOLLM2_135M.module_shapes()
    assert BaseShapes.from_config({"hidden_size": 5}) is None and BaseShapes.from_config(None) is None


# --- parity with the engine: the portal accepts exactly what the inference worker would load ----


def _edits():
    def nan(t):
        t[Q_A][0, 0] = np.nan

    def shape(t):
        t[Q_A] = np.zeros((4, 15), np.float32)

    def lone(t):
        del t["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]

    def extra(t):
        t["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"] = np.zeros((4, 32), np.float32)
        t["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"] = np.zeros((16, 4), np.float32)

    def layer(t):
        t["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = np.zeros((4, 16), np.float32)

    def ints(t):
        t[Q_A] = np.zeros((4, 16), np.int32)

    return [None, nan, shape, lone, extra, layer, ints]


PARITY_CONFIGS = [
    peft_config(),
    peft_config(target_modules="all-linear"),
    peft_config(target_modules=r".*\.(q|v)_proj"),
    peft_config(target_modules=r".*"),
    peft_config(layers_to_transform=[0]),
    peft_config(layers_to_transform=[5]),
    peft_config(exclude_modules=["v_proj"]),
    peft_config(rank_pattern={"v_proj": 2}),
    peft_config(use_dora=True),
    peft_config(r=9),
    peft_config(base_model_name_or_path="meta-llama/Llama-3.1-8B"),
    peft_config(base_model_name_or_path="/local/dir"),
    peft_config(lora_bias=True),
]


@pytest.mark.parametrize("config_index", range(len(PARITY_CONFIGS)))
def test_same_verdict_as_the_engine(tmp_path, config_index) -> None:
    torch = pytest.importorskip("torch")  # noqa: F841 -- the engine's loader needs it
    from inference.lora.adapter import load_adapter
    from inference.lora.validation import AdapterError
    from inference.models.config import LlamaConfig

    engine_base = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                              name=TINY.name)
    for i, edit in enumerate(_edits()):
        directory = write_peft(tmp_path / f"a{i}", config=PARITY_CONFIGS[config_index], edit=edit)
        if PARITY_CONFIGS[config_index].get("rank_pattern"):
            def fix(t, edit=edit):
                for k in [k for k in t if "v_proj" in k]:
                    t[k] = t[k][:2] if "lora_A" in k else t[k][:, :2]
                if edit:
                    edit(t)
            directory = write_peft(tmp_path / f"b{i}", config=PARITY_CONFIGS[config_index], edit=fix)
        try:
            load_adapter(directory, "x", engine_base, max_lora_rank=8)
            engine_ok, engine_reason = True, ""
        except AdapterError as e:
            engine_ok, engine_reason = False, e.reason
        result = validate_adapter_dir(directory, TINY)
        assert result.ok == engine_ok, (i, engine_reason, result.reasons)
        if not engine_ok:
            assert result.reasons, engine_reason


def test_base_shapes_from_the_fleet(db, monkeypatch) -> None:
    from portal.adapters import selectors
    from portal.fleet.models import InferenceWorker

    monkeypatch.undo()  # the autouse fixture replaced base_shapes_current with TINY
    assert selectors.base_shapes_current() == SMOLLM2_135M  # nothing polled yet: the default
    InferenceWorker.objects.create(
        url="http://w1:8001", healthy=True, base_model="smollm2",
        base_config={"name": "smollm2", "checkpoint_name": "Smollm2 135M 8k Lc100K Mix1 Ep2", "num_hidden_layers": 2,
                     "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "head_dim": 8, "max_lora_rank": 32},
    )
    shapes = selectors.base_shapes_current()
    assert (shapes.num_hidden_layers, shapes.max_lora_rank, shapes.name) == (2, 32, "Smollm2 135M 8k Lc100K Mix1 Ep2")
