"""The PEFT LoRA adapter format as both sides serve it: which files an adapter directory holds,
what its adapter_config.json may say, which projections it adapts, what its safetensors must
hold, and whether it was trained on the served base. Every rule returns every reason it finds;
the portal shows them all to the tenant, the engine raises the first.

    check.py       check_adapter_dir: every step below, in order -> AdapterCheck
    shapes.py      BaseShapes: the served base as the rules see it; module names
    files.py       the files beside the adapter: pickles, companions, links, missing files
    settings.py    adapter_config.json -> LoRASettings
    targets.py     target_modules / layers_to_transform / rank_pattern / alpha_pattern, resolved
    tensors.py     the safetensors header, tensor names and shapes, NaN / Inf
    base_model.py  base_model_name_or_path against the served base's name
"""

from protocol.adapter_format.check import AdapterCheck, check_adapter_dir
from protocol.adapter_format.files import ADAPTER_FILES, CONFIG_FILE, WEIGHTS_FILE
from protocol.adapter_format.shapes import SUPPORTED_MODULES, BaseShapes, module_path

__all__ = [
    "ADAPTER_FILES",
    "CONFIG_FILE",
    "SUPPORTED_MODULES",
    "WEIGHTS_FILE",
    "AdapterCheck",
    "BaseShapes",
    "check_adapter_dir",
    "module_path",
]
