"""Which projections of the base PEFT would wrap, with each one's rank and alpha.

Matching follows PEFT's check_target_module_exists on the module names of an HF
LlamaForCausalLM: exclusions first; a regex must match the full module name; a list entry
matches a name equal to it (then layers_to_transform is not consulted, as in PEFT) or ending
with "." + entry (then the layer index, found by layers_pattern or PEFT's default, must be in
layers_to_transform). Anything selected that is not one of the seven projections (embed_tokens,
lm_head, norms, containers) is refused, and so is a list entry that matches nothing.
"""

from __future__ import annotations

import functools
import re

from protocol.adapter_format.settings import LoRASettings
from protocol.adapter_format.shapes import (
    ATTENTION_MODULES,
    MLP_MODULES,
    SUPPORTED_TEXT,
    BaseShapes,
    module_path,
)

Targets = dict[tuple[int, str], tuple[int, float]]  # (layer, module) -> (rank, alpha)


def resolve_targets(settings: LoRASettings, base: BaseShapes) -> tuple[Targets | None, list[str]]:
    """{(layer, module): (rank, alpha)} for every projection PEFT would wrap in `base`, or None
    and every reason the settings select something else (or nothing)."""
    targets, reasons = _resolve_targets(settings, base)
    return (None if targets is None else dict(targets)), list(reasons)


# Adapters trained from one recipe share their settings: resolved once (~1.2 ms for a 30-layer
# base, on a cold adapter's path), each caller handed a copy of its own.
@functools.lru_cache(maxsize=64)
def _resolve_targets(settings: LoRASettings, base: BaseShapes) -> tuple[Targets | None, tuple[str, ...]]:
    reasons: list[str] = []
    num_layers = base.num_hidden_layers
    # Exclusions judged once per name, not once per name and list entry (an adapter loads
    # while requests wait for it: ~430 names x 8 entries of string matching cost ~6 ms)
    names = [named for named in hf_module_names(num_layers) if not _excluded(settings, named[0])]
    out_of_range = sorted(i for i in settings.layers_to_transform or () if i >= num_layers)
    if out_of_range:
        reasons.append(
            f"layers_to_transform names layer {out_of_range[0]}; the base model has {num_layers} layers"
        )
    if isinstance(settings.target_modules, tuple):
        for entry in settings.target_modules:  # every entry must name projections and only those
            matched = [(n, m) for n, _, m in names if _name_matches(entry, n)]
            bad = [n for n, m in matched if m is None]
            if bad:
                reasons.append(_unsupported_target(repr(entry), bad[0]))
            elif not matched:
                reasons.append(
                    f"target_modules entry {entry!r} matches no module of the base model "
                    f"(supported: {SUPPORTED_TEXT})"
                )

    targets: Targets = {}
    for name, layer, module in names:
        if not _targeted(settings, name):
            continue
        if module is None:  # only a regex gets here: list entries were judged above
            if isinstance(settings.target_modules, re.Pattern):
                reasons.append(_unsupported_target(repr(settings.target_modules.pattern), name))
            continue
        targets[(layer, module)] = settings.rank_and_alpha(name)
    if not targets and not reasons:
        reasons.append("target_modules selects no projection of the base model")
    return (None, tuple(reasons)) if reasons else (targets, ())


@functools.lru_cache(maxsize=8)  # one base model per process, as a rule
def hf_module_names(num_layers: int) -> tuple[tuple[str, int | None, str | None], ...]:
    """Every named module of an HF LlamaForCausalLM (root excluded) -> (name, layer, projection);
    layer/projection are None for modules LoRA cannot adapt here (embeddings, norms, lm_head...)."""
    names: list[tuple[str, int | None, str | None]] = [
        (n, None, None)
        for n in ("model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb")
    ]
    for i in range(num_layers):
        prefix = f"model.layers.{i}"
        names += [(prefix, None, None), (f"{prefix}.self_attn", None, None)]
        names += [(module_path(i, m), i, m) for m in ATTENTION_MODULES]
        names += [(f"{prefix}.mlp", None, None)]
        names += [(module_path(i, m), i, m) for m in MLP_MODULES]
        names += [
            (f"{prefix}.mlp.act_fn", None, None),
            (f"{prefix}.input_layernorm", None, None),
            (f"{prefix}.post_attention_layernorm", None, None),
        ]
    names.append(("lm_head", None, None))
    return tuple(names)


def _unsupported_target(what: str, name: str) -> str:
    return (
        f"target_modules {what} selects {name}, which is not a supported target module "
        f"(supported: {SUPPORTED_TEXT})"
    )


def _name_matches(entry: str, name: str) -> bool:
    return name == entry or name.endswith("." + entry)


def _excluded(settings: LoRASettings, name: str) -> bool:
    ex = settings.exclude_modules
    if isinstance(ex, re.Pattern):
        return ex.fullmatch(name) is not None
    return any(_name_matches(e, name) for e in ex)


def _targeted(settings: LoRASettings, name: str) -> bool:
    targets = settings.target_modules
    if isinstance(targets, re.Pattern):
        return targets.fullmatch(name) is not None
    if name in targets:
        return True
    if not any(name.endswith("." + t) for t in targets):
        return False
    if settings.layers_to_transform is None:
        return True
    if settings.layers_pattern:
        match = next((m for p in settings.layers_pattern if (m := p.match(name))), None)
    else:  # PEFT: the first numbered segment after a named one
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
    return match is not None and int(match.group("idx")) in settings.layers_to_transform
