"""Loaders: GGUF files laid out the way llama.cpp writes them, HF directories, and bad input.

GGUF files are written here from a random HF checkpoint (Q/K rows permuted as llama.cpp's
converter does). Stored as F32 they must reproduce the original HF model; quantized, they must
match transformers' own reading of the same file.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference.layers.rotary import rope_inv_freq
from inference.models.config import LlamaConfig, RopeScaling
from inference.models.gguf_loader import unpermute_qk
from inference.models.loader import load_model
from tests.inference.models.tiny_llama import (
    LLAMA3_ROPE,
    greedy,
    tiny_prompts,
    write_gguf,
    write_tiny_checkpoint,
)


def last_logits(model, prompts) -> torch.Tensor:
    return greedy(model, prompts, new_tokens=1)[1]


def hf_last_logits(hf, prompts) -> torch.Tensor:
    with torch.inference_mode():
        return torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])


# --- GGUF ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        dict(tie_word_embeddings=False),
        dict(tie_word_embeddings=True),
        dict(tie_word_embeddings=False, rope_scaling=LLAMA3_ROPE),  # becomes a rope_freqs tensor
    ],
    ids=["untied", "tied", "llama3_rope_freqs"],
)
def test_f32_gguf_reproduces_the_hf_checkpoint(overrides, tmp_path):
    hf = write_tiny_checkpoint(tmp_path / "hf", **overrides)
    path = write_gguf(hf, tmp_path / "tiny.gguf")
    ours = load_model(path, dtype=torch.float32, progress=False)
    assert ours.config.tie_word_embeddings == overrides["tie_word_embeddings"]
    assert ours.config.rope_theta == 5000.0 and ours.config.name == "tiny-llama"
    prompts = tiny_prompts()
    diff = (last_logits(ours, prompts) - hf_last_logits(hf, prompts)).abs().max().item()
    assert diff < 1e-4, diff


def test_quantized_gguf_matches_transformers_reading_it(tmp_path):
    from transformers import AutoModelForCausalLM

    hf = write_tiny_checkpoint(tmp_path / "hf")
    types = {  # one of each type the gguf package can also write
        "token_embd.weight": "Q8_0",
        "output.weight": "F16",
        "blk.0.attn_q.weight": "Q4_0",
        "blk.0.attn_k.weight": "Q4_1",
        "blk.0.attn_v.weight": "Q5_0",
        "blk.0.attn_output.weight": "Q5_1",
        "blk.1.attn_q.weight": "BF16",
        "blk.1.attn_k.weight": "Q8_0",
    }
    path = write_gguf(hf, tmp_path / "tiny.gguf", matrix_type="Q4_1", types=types)
    ours = load_model(path, dtype=torch.float32, progress=False)
    oracle = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="tiny.gguf", dtype=torch.float32
    ).eval()
    prompts = tiny_prompts()
    diff = (last_logits(ours, prompts) - hf_last_logits(oracle, prompts)).abs().max().item()
    assert diff < 1e-4, diff


def test_unpermute_inverts_llama_cpp_row_order():
    # head_dim 4: HF rows (h0: a0 a1 | b0 b1) are stored by llama.cpp as (a0 b0 a1 b1)
    gguf_rows = torch.tensor([[0.0], [10.0], [1.0], [11.0], [2.0], [12.0], [3.0], [13.0]])
    assert unpermute_qk(gguf_rows, n_heads=2).flatten().tolist() == [0, 1, 10, 11, 2, 3, 12, 13]
    bias = gguf_rows.flatten()
    assert unpermute_qk(bias, n_heads=2).tolist() == [0, 1, 10, 11, 2, 3, 12, 13]


def test_gguf_rope_freqs_equal_llama3_scaling(tmp_path):
    """llama.cpp's rope_freqs divisors and HF's llama3 parameters give the same frequencies."""
    from tests.inference.models.tiny_llama import llama3_rope_freq_factors

    base = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=5000.0,
    )
    hf_style = LlamaConfig(**base, rope_scaling=RopeScaling.from_hf(LLAMA3_ROPE))
    factors = tuple(llama3_rope_freq_factors(16, 5000.0, LLAMA3_ROPE).tolist())
    gguf_style = LlamaConfig(**base, rope_freq_factors=factors)
    assert len(set(factors)) > 2  # kept, slowed and blended bands all occur
    torch.testing.assert_close(
        rope_inv_freq(16, 5000.0, scaling=hf_style.rope_scaling),
        rope_inv_freq(16, 5000.0, freq_factors=gguf_style.rope_freq_factors),
        rtol=1e-6,
        atol=0,
    )


# --- HF directories ------------------------------------------------------------------------


def test_sharded_safetensors_with_index(tmp_path):
    hf = write_tiny_checkpoint(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    names = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, tmp_path / file)
        weight_map.update(dict.fromkeys(keys, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ours = load_model(tmp_path, dtype=torch.float32, progress=False)
    prompts = tiny_prompts()
    assert (last_logits(ours, prompts) - hf_last_logits(hf, prompts)).abs().max().item() < 1e-4


def test_weights_are_assigned_not_copied_and_progress_goes_to_stderr(tmp_path, capsys):
    write_tiny_checkpoint(tmp_path)
    model = load_model(tmp_path, dtype=torch.bfloat16, progress=True)
    err = capsys.readouterr().err
    assert "loading" in err and "tensor" in err
    # 1 embedding + per layer 2 norms, q/k/v, o, gate/up, down + final norm + lm_head
    assert f"{1 + 3 * 9 + 2}/{1 + 3 * 9 + 2}" in err
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in model.parameters())
    assert (
        model.rotary.cos_cache.device.type == "cpu"
        and model.rotary.cos_cache.dtype == torch.float32
    )
    assert not any(p.requires_grad for p in model.parameters())


# --- bad input -----------------------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model(tmp_path / "nope", progress=False)


def test_directory_without_config_json(tmp_path):
    write_tiny_checkpoint(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path, progress=False)


def test_directory_without_safetensors(tmp_path):
    write_tiny_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_model(tmp_path, progress=False)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            dict(architectures=["MistralForCausalLM"], model_type="mistral"),
            "architectures: unsupported",
        ),
        (dict(architectures=None, model_type="gpt2"), "model_type: unsupported 'gpt2'"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (
            dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=5000.0)),
            "rope_type: unsupported 'yarn'",
        ),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(intermediate_size=100), "mlp.gate_up_proj.weight.*shape"),
    ],
)
def test_bad_config_json(tmp_path, edit, match):
    write_tiny_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(edit)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match) as info:
        load_model(tmp_path, progress=False)
    assert str(tmp_path) in str(info.value)


def test_config_json_not_json(tmp_path):
    write_tiny_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        load_model(tmp_path, progress=False)


def test_safetensors_missing_a_tensor(tmp_path):
    write_tiny_checkpoint(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"missing tensors \['model.layers.1.self_attn.k_proj.weight'\]"
    ):
        load_model(tmp_path, progress=False)


def test_untied_checkpoint_without_lm_head(tmp_path):
    write_tiny_checkpoint(tmp_path, tie_word_embeddings=False)
    state = load_file(tmp_path / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_model(tmp_path, progress=False)


def test_unexpected_tensor(tmp_path):
    write_tiny_checkpoint(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected tensors.*q_norm"):
        load_model(tmp_path, progress=False)


@pytest.mark.parametrize("keep", [0.5, 0.001])  # tensor data cut short; header cut short
def test_truncated_safetensors(tmp_path, keep):
    write_tiny_checkpoint(tmp_path)
    file = tmp_path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(tmp_path, progress=False)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(path, progress=False)


def test_truncated_gguf(tmp_path):
    hf = write_tiny_checkpoint(tmp_path / "hf")
    path = write_gguf(hf, tmp_path / "tiny.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="tiny.gguf"):
        load_model(path, progress=False)


def test_gguf_of_another_architecture(tmp_path):
    import gguf

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="general.architecture: unsupported 'gpt2'"):
        load_model(path, progress=False)
