"""
The cache's dtypes (kv_quant.py) at a long context: what a decode step costs with each,
how much of it is reading the cache back, and transformers' quantized cache as a peer.
"""

import copy
import math
import statistics
import time

import torch

from base_model import GenerationStats
from benchmarks.timing import repeat, spread
from kv_cache import synchronize
from kv_quant import KV_DTYPES


@torch.inference_mode()
def kv_dtype_latency(model, shape, position, batch_sizes, reps, steps=8):
    """Per-token decode latency at a long context for each cache dtype (kv_quant.py), and
    how much of it is reading the cache back (dequantizing, or casting to the model's dtype).
    A prompt of `position` tokens (capped by the context) is prefilled once per dtype; for a batch of b rows
    its cache is copied to b rows (as num_samples does), then `steps` decode steps are timed."""
    device = model.lm_head.weight.device
    position = min(position, model.config.block_size - steps)
    prompt = torch.zeros(1, position, dtype=torch.long, device=device)
    result = {"shape": shape, "position": position, "steps": steps, "dtypes": {}}
    for kv in KV_DTYPES:
        prefilled = model.new_cache(1, kv)
        model(prompt, prefilled, last_only=True)
        result["dtypes"][kv] = rows = {}
        for b in batch_sizes:
            def step_and_read_ms():
                cache = copy.copy(prefilled)  # select_rows gives the copy its own tensors
                cache.select_rows(torch.zeros(b, dtype=torch.long, device=device))
                token, times = torch.zeros(b, 1, dtype=torch.long, device=device), []
                for _ in range(steps):
                    synchronize(device)
                    t0 = time.perf_counter()
                    model.decode_one(token, cache, GenerationStats())
                    synchronize(device)
                    times.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for layer in range(len(cache)):
                    cache[layer]  # what update() returns: every column, in the model's dtype
                synchronize(device)
                return 1e3 * statistics.median(times), 1e3 * (time.perf_counter() - t0)
            runs = repeat(step_and_read_ms, reps)
            rows[b] = {"step_ms": spread([r[0] for r in runs]), "read_back_ms": spread([r[1] for r in runs]),
                       "cache_bytes": model.new_cache(b, kv).nbytes()}
    return result


@torch.inference_mode()
def quantized_peer(model, tokenizer, text, position, reps, steps=8):
    """transformers' QuantizedCache (KIVI-style, optimum-quanto backend: 4 bits, groups of
    32, the newest tokens kept in full precision up to residual_length: 128, and 32) against
    our int4 cache, and both float32 caches, on the checkpoint's weights: bits/char on the
    text (score()'s windows, each through the cache) and ms per decode step at `position`
    (batch 1; capped by the context)."""
    try:
        import optimum.quanto  # noqa: F401  (transformers' quanto backend imports it)
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.cache_utils import DynamicCache, QuantizedCache
    except ImportError as e:
        return {"note": f"skipped: {e.name} is not installed (pip install transformers optimum-quanto)"}
    from export_hf import hf_config, hf_state_dict
    from generate import nats_through_cache, score_windows  # the scorer of generate.py --score
    device = model.lm_head.weight.device
    theirs = GPT2LMHeadModel(GPT2Config(**hf_config(model.config, eot=tokenizer.eot_token)))
    theirs.load_state_dict(hf_state_dict(model), strict=False)  # lm_head: tied to wte
    theirs = theirs.to(device).eval()
    caches = {  # name: (new_cache(rows), forward(tokens, cache) -> logits, extending the cache)
        "ours float32": (lambda rows: model.new_cache(rows, "float32"), lambda t, c: model(t, c)[0]),
        "ours int4": (lambda rows: model.new_cache(rows, "int4"), lambda t, c: model(t, c)[0]),
        "HF DynamicCache": (lambda rows: DynamicCache(config=theirs.config),
                            lambda t, c: theirs(t, past_key_values=c, use_cache=True).logits),
        # its default keeps the newest 128 tokens unquantized: in a window of 256 whose first
        # half is prefilled, no fed token is read back quantized; 32 is KIVI's group
        **{f"HF QuantizedCache quanto int4, residual {r}": (
            lambda rows, r=r: QuantizedCache("quanto", theirs.config, nbits=4, q_group_size=32,
                                             residual_length=r),
            lambda t, c: theirs(t, past_key_values=c, use_cache=True).logits) for r in (128, 32)},
    }
    ids = torch.tensor([tokenizer.eot_token] + tokenizer.encode_ordinary(text), device=device)
    block = model.config.block_size
    windows = score_windows(ids.numel() - 1, block)
    position = min(position, block - steps)
    prompt = torch.zeros(1, position, dtype=torch.long, device=device)

    def step_ms(new_cache, forward):
        cache, token, times = new_cache(1), prompt[:, :1], []
        forward(prompt, cache)
        for _ in range(steps):
            synchronize(device)
            t0 = time.perf_counter()
            forward(token, cache)
            synchronize(device)
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)
    result = {"chars": len(text), "tokens": ids.numel() - 1, "position": position, "caches": {}}
    for name, (new_cache, forward) in caches.items():
        nats = nats_through_cache(ids, windows, block, new_cache, forward)
        result["caches"][name] = {"bits_per_char": nats / math.log(2) / len(text),
                                  "step_ms": spread(repeat(lambda: step_ms(new_cache, forward), reps))}
    return result
