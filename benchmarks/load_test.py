"""
A load test: every request of a workload as its own streaming client of an
OpenAI-compatible completions server (serve.py's, or any other: vLLM's), each sent at its
arrival time, every server-sent event timed as it arrives; and the statistics the serving
benchmark reports for any way of serving (serving.py): output tokens/s, time to first token
and inter-token latency, p50 and p95.

    python -m benchmarks.serving --url http://127.0.0.1:8000/v1 ...   # against a running server
"""

import asyncio
import json
import statistics
import time


def summary(records, t0, kv_bytes):
    """records: per request (arrival time, [token times]) on the perf_counter clock."""
    ttft = [times[0] - arrival for arrival, times in records]
    itl = [b - a for _, times in records for a, b in zip(times, times[1:])]
    tokens = sum(len(times) for _, times in records)
    seconds = max(times[-1] for _, times in records) - t0

    def pct(values, q):
        return 1e3 * statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else 1e3 * values[0]
    return {"output_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "ttft_p50_ms": pct(ttft, 50), "ttft_p95_ms": pct(ttft, 95),
            "itl_p50_ms": pct(itl, 50) if itl else None, "itl_p95_ms": pct(itl, 95) if itl else None,
            "peak_kv_bytes": kv_bytes}


async def stream_one(session, url, model, t0, arrival, prompt, n):
    """One streaming client: (sent, [arrival time of each event], tokens generated)."""
    await asyncio.sleep(max(0.0, t0 + arrival - time.perf_counter()))
    sent, times, usage = time.perf_counter(), [], None
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    async with session.post(url + "/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event["choices"]:
                times.append(time.perf_counter())
            usage = event.get("usage") or usage
    # tokens from the usage chunk: an event may carry several (held-back text); a server
    # that sends no usage (llama-server) sends a token per event
    return sent, times, usage["completion_tokens"] if usage else len(times)


class LoadTestError(Exception):
    """The server at the URL is not one to load-test (no OpenAI list of models there), or
    every request failed."""


async def served_model(session, url):
    """The name the server serves: the first of GET url/models, OpenAI's list of models."""
    async with session.get(url + "/models") as response:
        try:
            body = await response.json(content_type=None)
        except ValueError:  # not JSON
            body = None
    models = body.get("data") if isinstance(body, dict) else None
    if response.status != 200 or not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise LoadTestError(f"{url}/models did not answer with a list of models (HTTP "
                            f"{response.status}); the URL should end in /v1")
    return models[0]["id"]


async def server_health(session, url):
    """GET /health: ours reports the engine's counters (blocks, preemptions); others {}."""
    async with session.get(url.removesuffix("/v1") + "/health") as response:
        return await response.json() if response.content_type == "application/json" else {}


def load_test(url, requests, timeout=60.0):
    """Every request as its own streaming client, at its arrival time, against the
    OpenAI-compatible server at url (ours, or any other: vLLM's). Returns (t0, per
    request (sent, times, tokens) or the error's repr, the server's /health before and
    after the run). timeout: the seconds a connection may take, and a server may stay
    silent, before the request fails (a port that accepts and never answers must not
    hang the run: aiohttp.ServerTimeoutError)."""
    import aiohttp

    async def all_clients():
        timeout_s = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
        async with aiohttp.ClientSession(timeout=timeout_s,
                                         connector=aiohttp.TCPConnector(limit=0)) as s:
            model, before = await served_model(s, url), await server_health(s, url)
            t0 = time.perf_counter()
            results = await asyncio.gather(*(stream_one(s, url, model, t0, *r) for r in requests),
                                           return_exceptions=True)
            after = await server_health(s, url)
        results = [repr(r) if isinstance(r, BaseException) else r for r in results]
        return t0, results, (before, after)
    return asyncio.run(all_clients())


def load_test_summary(t0, results, health, kv_bytes):
    """summary() of what the clients saw, and from our server's /health (before, after):
    the preemptions during the run and the blocks still held after it (leaked, when
    nothing else uses the server)."""
    errors = [r for r in results if isinstance(r, str)]
    ok = [r for r in results if not isinstance(r, str)]
    if not ok:
        raise LoadTestError(f"every request failed; the first: {errors[0]}")
    result = summary([(sent, times) for sent, times, _ in ok], t0, kv_bytes)
    tokens = sum(n for _, _, n in ok)  # events can merge tokens (held-back text): count tokens
    before, after = health
    ours = "blocks_total" in after
    result.update(output_tokens=tokens, tok_s=tokens / result["seconds"], errors=len(errors),
                  first_error=errors[0] if errors else None,
                  preemptions=after["preemptions"] - before["preemptions"] if ours else None,
                  leaked_blocks=after["blocks_total"] - after["blocks_free"] if ours else None)
    return result
