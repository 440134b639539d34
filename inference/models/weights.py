"""Which checkpoint tensors make up each tensor of our model.

Our model fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; checkpoints store them
apart. A loader describes its file's names with a `SourceNames` table and gets back a plan:
our name -> the source names concatenated (along dim 0, in order) to build it.

    plan = load_plan(config, HF_NAMES)
    plan["layers.0.self_attn.qkv_proj.weight"]
    # ['model.layers.0.self_attn.q_proj.weight', '...k_proj.weight', '...v_proj.weight']
"""

from __future__ import annotations

from dataclasses import dataclass

from inference.models.config import LlamaConfig


@dataclass(frozen=True)
class SourceNames:
    """A checkpoint format's tensor names; `{i}` is the layer index."""

    embed: str
    norm: str
    lm_head: str
    attn_norm: str
    q: str
    k: str
    v: str
    o: str
    mlp_norm: str
    gate: str
    up: str
    down: str
    bias_suffix: tuple[str, str] = (".weight", ".bias")  # how a weight's bias is named


def load_plan(config: LlamaConfig, names: SourceNames) -> dict[str, list[str]]:
    plan: dict[str, list[str]] = {"embed_tokens.weight": [names.embed]}
    weight, bias = names.bias_suffix

    def biased(our: str, sources: list[str], with_bias: bool) -> None:
        plan[our + ".weight"] = sources
        if with_bias:
            plan[our + ".bias"] = [s.removesuffix(weight) + bias for s in sources]

    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        plan[p + "input_layernorm.weight"] = [names.attn_norm.format(i=i)]
        biased(
            p + "self_attn.qkv_proj",
            [n.format(i=i) for n in (names.q, names.k, names.v)],
            config.attention_bias,
        )
        biased(p + "self_attn.o_proj", [names.o.format(i=i)], config.attention_bias)
        plan[p + "post_attention_layernorm.weight"] = [names.mlp_norm.format(i=i)]
        biased(
            p + "mlp.gate_up_proj", [n.format(i=i) for n in (names.gate, names.up)], config.mlp_bias
        )
        biased(p + "mlp.down_proj", [names.down.format(i=i)], config.mlp_bias)
    plan["norm.weight"] = [names.norm]
    if not config.tie_word_embeddings:
        plan["lm_head.weight"] = [names.lm_head]
    return plan
