"""LoRARequest: which adapter a request runs with, named and located by the caller.

    engine.add_request("Hello", params, lora=LoRARequest("support-bot", "adapters/support-bot"))

The name is how clients refer to the adapter (the OpenAI `model` field); the path is the
PEFT directory. The engine registers the pair on first use and loads it in the background.
A registered name can also be passed as a plain string.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LoRARequest:
    name: str
    path: str | Path
