"""Serving many requests on one model: a paged KV cache with prefix sharing
(paged_cache.py, paged_attention.py), continuous batching (scheduler.py), the model's
passes and draws (model_runner.py), the step loop (engine.py, its request types in
requests.py), and an OpenAI-compatible HTTP server (server.py, its request bodies typed in
request_schema.py, read in request_parsing.py and answered in replies.py, tool calls in
tool_calls.py, chat templates in chat.py (rendered under
template_limits.py's budget), /metrics in metrics.py; the command is serve.py).
The workload benchmark that measures it is benchmarks/serving.py."""
