"""
GET /metrics: the server's state and latencies in Prometheus's text format, for a scraper
(Prometheus, Grafana's agent) or a glance with curl.

Two kinds of figure:
  - what the engine already counts (requests running and waiting, KV blocks used and free,
    preemptions, prefix-cache hits, speculative decoding's proposed and accepted tokens) is
    read from Engine.stats() when the page is scraped, by a collector, so nothing is
    counted twice;
  - what happens to requests (tokens in and out, time to first token, time between
    tokens) is recorded as it happens, from on_output on the engine's thread.

Each server has a registry of its own (not prometheus_client's global one), so several
servers in one process (the tests start many) keep separate figures. The names follow
vLLM's metrics with our prefix: kvcache_time_to_first_token_seconds is
vllm:time_to_first_token_seconds.
"""

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "kvcache_"
# seconds: a bundled-model step is a few ms, a GPT-2-sized prefill of many prompts seconds
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5)


class EngineCollector:
    """Engine.stats() as Prometheus metrics, read at each scrape."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        gauges = [("num_requests_running", "Requests in the running batch", s["running"]),
                  ("num_requests_waiting", "Requests waiting to be admitted", s["waiting"]),
                  ("kv_blocks_used", "KV blocks held by sequences", s["blocks_total"] - s["blocks_free"]),
                  ("kv_blocks_free", "KV blocks free (cached or empty)", s["blocks_free"]),
                  ("kv_blocks_total", "KV blocks in the pool", s["blocks_total"]),
                  ("kv_pool_bytes", f"Bytes of the KV pool (keys and values as {s['kv_dtype']})",
                   s["pool_bytes"]),
                  ("kv_pool_full_contexts", "Sequences of the full context the pool holds at once",
                   s["full_contexts"])]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        queried = s["prefilled_tokens"] + s["cached_tokens"]
        yield GaugeMetricFamily(PREFIX + "prefix_cache_hit_rate",
                                "Prompt tokens found in the prefix cache / prompt tokens admitted",
                                value=s["cached_tokens"] / queried if queried else 0.0)
        counters = [("num_preemptions", "Sequences preempted (recomputed later)", s["preemptions"]),
                    ("prefix_cache_queries", "Context tokens admitted (prefill)", queried),
                    ("prefix_cache_hits", "Context tokens found in the prefix cache", s["cached_tokens"]),
                    ("spec_decode_num_draft_tokens", "Tokens proposed by speculative decoding (checked)",
                     s["proposed_tokens"]),
                    ("spec_decode_num_accepted_tokens", "Proposed tokens the model accepted",
                     s["accepted_tokens"])]
        for name, doc, value in counters:
            yield CounterMetricFamily(PREFIX + name, doc, value=value)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of requests received",
                                     registry=self.registry)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated",
                                         registry=self.registry)
        self.requests = Counter(PREFIX + "requests", "Engine requests finished, by finish reason",
                                ["finish_reason"], registry=self.registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "From a request's arrival to its first token", buckets=TTFT_BUCKETS,
                              registry=self.registry)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Between a request's tokens",
                             buckets=ITL_BUCKETS, registry=self.registry)

    def received(self, prompt_tokens):
        self.prompt_tokens.inc(prompt_tokens)

    def output(self, request, output):
        """One Output of the engine (on its thread; prometheus_client's metrics are
        thread-safe)."""
        if output.token is not None:
            self.generation_tokens.inc()
            times = request.token_times
            if request.num_generated == 1:
                self.ttft.observe(times[-1] - request.arrival_time)
            elif len(times) >= 2:
                self.itl.observe(times[-1] - times[-2])
        if output.finish_reason is not None:
            self.requests.labels(output.finish_reason).inc()

    def page(self):
        return generate_latest(self.registry)
