"""Does base_model_name_or_path name the served base? Compared by family and parameter count,
parsed from the model ids ("HuggingFaceTB/SmolLM2-135M-Instruct", a GGUF general.name such as
"Smollm2 135M 8k ...", "/models/Llama-3.1-8B").

A name that clearly names another model (another family or size) is refused. One that cannot be
compared (missing, a local path, an unrecognisable id, or a served base whose own name is
unrecognisable) is accepted with a warning, the tensor shapes having already matched, or
refused under `strict`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# A parameter-count token: "135m", "1.7b", "8b", "8x7b" (experts x size).
_SIZE_TOKEN = re.compile(r"(?:(?P<experts>\d+)x)?(?P<num>\d+(?:\.\d+)?)(?P<unit>[mbt])")
_UNITS = {"m": 1e6, "b": 1e9, "t": 1e12}


@dataclass(frozen=True)
class ModelName:
    """What a model id says about the model: family ("smollm2", "llama31") and parameter count."""

    family: str
    params: float

    def same_model(self, other: ModelName) -> bool:
        same_size = abs(self.params - other.params) <= 0.01 * max(self.params, other.params)
        # Lenient on family spelling: "llama31" vs "metallama31".
        return same_size and (self.family in other.family or other.family in self.family)


def parse_model_name(name: str) -> ModelName | None:
    """A model id -> ModelName; None when the last path component has no family followed by a
    size token (a bare local directory, "my-adapter-base", ...)."""
    last = re.split(r"[\\/]", name.strip().rstrip("/\\"))[-1].lower()
    tokens = [t for t in re.split(r"[-_\s]+", last) if t]
    for i, token in enumerate(tokens):
        m = _SIZE_TOKEN.fullmatch(token)
        if m is None:
            continue
        family = re.sub(r"[^a-z0-9]", "", "".join(tokens[:i]))
        if not re.search(r"[a-z]", family):
            return None
        return ModelName(family, float(m["num"]) * _UNITS[m["unit"]] * int(m["experts"] or 1))
    return None


def check_base_name(
    claimed: str | None, served: str, *, strict: bool = False
) -> tuple[list[str], str | None]:
    """(reasons, warning) for an adapter whose base_model_name_or_path is `claimed`, served on
    the base named `served`: a reason when it names another model (or, with `strict`, when it
    cannot be compared), a warning when it cannot be compared; neither when it names `served`."""
    served_name = parse_model_name(served)
    named = parse_model_name(claimed) if claimed else None
    if named is not None and served_name is not None:
        if named.same_model(served_name):
            return [], None
        return [
            f"base_model_name_or_path {claimed!r} names a different model than the served "
            f"base {served!r}"
        ], None
    why = (
        "is missing"
        if not claimed
        else f"{claimed!r} is not a recognisable model id"
        if named is None
        else f"{claimed!r} cannot be compared with the served base, whose name is not recognisable"
    )
    if strict:
        return [
            f"base_model_name_or_path {why}; strict_base_match requires it to name the served "
            f"base {served!r}"
        ], None
    return [], (
        f"base_model_name_or_path {why}; accepted because every tensor shape matches the served "
        f"base {served!r}"
    )
