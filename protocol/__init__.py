"""What the web side and the inference side agree on, written once: the PEFT adapter format's
rules (protocol.adapter_format) and the JSON bodies the portal and the workers exchange
(protocol.worker_api).

Both `portal` and `inference` import it; it imports neither, nor Django, DRF, Channels, Celery,
torch or triton: the standard library, numpy and safetensors (framework="numpy") only
(import-linter holds it to that).
"""
