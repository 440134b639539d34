"""Multi-LoRA: adapter format and validation (adapter.py, validation.py), cache, LoRA layers."""
