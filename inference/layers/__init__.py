"""The building blocks a model file is written with, each in its own module:

    linear.py              Linear: y = x·Wᵀ (+ b), with the CPU fast path for bf16
    lora_linear.py         LoRALinear: a Linear that adds each token's adapter delta (multi-LoRA)
    norm.py                RMSNorm
    rotary.py              rotary position embedding (plain, linear, llama3, llama.cpp factors)
    rope_scaling.py        RopeScaling: the RoPE variants rotary.py implements (no torch)
    attention.py           paged attention over the KV cache (and the cache's layout)
    attention_metadata.py  the per-step indices and masks every attention layer shares

Layers know tensors and shapes, never a checkpoint format or an engine: models/ builds a
network from them and translates checkpoints at load time; the engine builds the per-step
metadata (attention's and the LoRA grouping) and passes it down through `forward`.
"""
