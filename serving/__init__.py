"""Serving many requests on one model: a paged KV cache with prefix sharing
(paged_cache.py), continuous batching (scheduler.py), the step loop (engine.py), an
OpenAI-compatible HTTP server (server.py; the command is serve.py) and the workload
benchmark (bench.py)."""
