"""The inference worker's HTTP server: `python -m inference serve`, an OpenAI-compatible API
(chat/completions, completions, models, vLLM's adapter routes), /health, /ready and /metrics,
in front of one engine that runs on its own thread (see async_engine.py)."""
