"""
A load test: every request of a workload as its own streaming client of an
OpenAI-compatible completions server (serve.py's, or any other: vLLM's), each sent at its
arrival time, every server-sent event timed as it arrives; and the statistics the serving
benchmark reports for any way of serving (bench.py): output tokens/s, time to first token
and inter-token latency, p50 and p95.

    python -m serving.bench --url http://127.0.0.1:8000/v1 ...   # against a running server
"""

import asyncio
import json
import statistics
import time

from cli import UserError


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
    return sent, times, usage["completion_tokens"]


def load_test(url, requests):
    """Every request as its own streaming client, at its arrival time, against the
    OpenAI-compatible server at url (ours, or any other: vLLM's). Returns (t0, per
    request (sent, times, tokens) or the error's repr, the server's /health: ours reports
    its blocks, others {})."""
    import aiohttp

    async def all_clients():
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(timeout=timeout,
                                         connector=aiohttp.TCPConnector(limit=0)) as s:
            async with s.get(url + "/models") as response:
                model = (await response.json())["data"][0]["id"]  # the name it serves
            t0 = time.perf_counter()  # CLOCK_MONOTONIC: the same clock in every process
            results = await asyncio.gather(*(stream_one(s, url, model, t0, *r) for r in requests),
                                           return_exceptions=True)
            async with s.get(url.removesuffix("/v1") + "/health") as response:
                health = (await response.json() if response.content_type == "application/json"
                          else {})
        return t0, [repr(r) if isinstance(r, BaseException) else r for r in results], health
    return asyncio.run(all_clients())


def load_test_summary(t0, results, health, kv_bytes):
    errors = [r for r in results if isinstance(r, str)]
    ok = [r for r in results if not isinstance(r, str)]
    if not ok:
        raise UserError(f"every request failed; the first: {errors[0]}")
    result = summary([(sent, times) for sent, times, _ in ok], t0, kv_bytes)
    tokens = sum(n for _, _, n in ok)  # events can merge tokens (held-back text): count tokens
    result.update(output_tokens=tokens, tok_s=tokens / result["seconds"], errors=len(errors),
                  first_error=errors[0] if errors else None,
                  preemptions=health.get("preemptions"),
                  leaked_blocks=(health["blocks_total"] - health["blocks_free"]
                                 if "blocks_total" in health else None))
    return result


def run_url(url, requests):
    """The load test against a server that is already running (python serve.py, or
    vLLM's server on the same weights), from a process of its own: this one."""
    import aiohttp
    try:
        return load_test_summary(*load_test(url, requests), kv_bytes=None)
    except aiohttp.ClientConnectionError as e:
        raise UserError(f"--url: cannot reach {url} ({e}); start the server first "
                        "(python serve.py)") from None
