"""Multi-LoRA: adapter loading (adapter.py; the format's rules are protocol.adapter_format, wired in
validation.py), the adapter manager (manager.py), the two-tier cache (cache.py), device slots (slots.py)."""
