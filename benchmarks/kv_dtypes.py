"""
The cache's dtypes (kv_quant.py) measured: at a long context, what a decode step costs with
each, how much of it is reading the cache back, and transformers' quantized cache as a peer
(benchmark.py's sections); and their quality, run on its own:

    python -m benchmarks.kv_dtypes     # bytes, round-trip error on real keys and values, greedy agreement
"""

import copy
import math
import statistics
import sys
import time
from pathlib import Path

from plumbing.script import UserError, begin, run

if __name__ == "__main__":  # run as a command; importing this file changes nothing
    begin()  # before torch: Ctrl-C during the slow imports ends quietly (plumbing/script.py)

import torch  # noqa: E402

from benchmarks.timing import repeat, spread  # noqa: E402
from generation.loop import generate_tokens, synchronize  # noqa: E402
from generation.rows import Rows  # noqa: E402
from kv_cache import CACHED_MODELS  # noqa: E402
from kv_quant import (INT4_GROUP_SIZE, KV_DTYPES, cache_bytes, dequantize, group_size,  # noqa: E402
                      head_bytes, head_bytes_text, quantize)
from plumbing.checkpoint import ROOT  # noqa: E402
from plumbing.cli import ArgumentParser, add_model_args, load_from_args, positive_int  # noqa: E402
from plumbing.scoring import nats_through_cache, score_windows  # noqa: E402
from plumbing.user_text import encode_text  # noqa: E402


@torch.inference_mode()
def kv_dtype_latency(model, shape, position, batch_sizes, reps, steps=8):
    """Per-token decode latency at a long context for each cache dtype (kv_quant.py), and
    how much of it is reading the cache back (dequantizing, or casting to the model's dtype).
    A prompt of `position` tokens (capped by the context) is prefilled once per dtype; for a batch of b rows
    its cache is copied to b rows (as num_samples does), then `steps` decode steps are timed."""
    device = model.lm_head.weight.device
    position = min(position, model.config.context_len - steps)
    prompt = torch.zeros(1, position, dtype=torch.long, device=device)
    result = {"shape": shape, "position": position, "steps": steps, "dtypes": {}}
    for kv in KV_DTYPES:
        prefilled = model.new_cache(1, kv)
        model(prompt, prefilled, last_only=True)
        result["dtypes"][kv] = rows = {}
        for b in batch_sizes:
            def step_and_read_ms():
                cache = copy.copy(prefilled)  # Rows.repeat gives the copy its own tensors
                Rows(cache, 1, position, device).repeat(b)
                token, times = torch.zeros(b, 1, dtype=torch.long, device=device), []
                for _ in range(steps):
                    synchronize(device)
                    t0 = time.perf_counter()
                    model(token, cache, last_only=True)  # what the loop's PlainStep runs
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
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.cache_utils import DynamicCache, QuantizedCache
    except ImportError as e:
        return {"note": f"skipped: {e.name} is not installed (pip install transformers optimum-quanto)"}
    from export_hf import hf_config, hf_state_dict
    device = model.lm_head.weight.device
    config = hf_config(model.config, eot=tokenizer.eot_token)  # GPT-2's, or a Llama family's
    theirs = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    theirs.load_state_dict(hf_state_dict(model), strict=False)  # a tied lm_head: its embedding
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
    ids = torch.tensor([tokenizer.eot_token] + encode_text(tokenizer, text), device=device)
    context_len = model.config.context_len
    windows = score_windows(ids.numel() - 1, context_len)
    position = min(position, context_len - steps)
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
        nats = nats_through_cache(ids, windows, context_len, new_cache, forward)
        result["caches"][name] = {"bits_per_char": nats / math.log(2) / len(text),
                                  "step_ms": spread(repeat(lambda: step_ms(new_cache, forward), reps))}
    return result


# ---------------------------------------------------------------------------- quality (python -m benchmarks.kv_dtypes)

def relative_error(x, y):
    return ((x - y).norm() / x.norm()).item()


def round_trip(x, bits, group, per_channel):
    """x (..., T, hd) quantized and read back, scales per token (groups of channels) or per
    channel (groups of `group` tokens, as KIVI does for keys)."""
    if per_channel:
        x = x.transpose(-1, -2)  # (..., hd, T): a channel's tokens along the last dim
    y = dequantize(*quantize(x, bits, group), torch.float32)
    return y.transpose(-1, -2) if per_channel else y


@torch.inference_mode()
def real_keys_and_values(model, ids, n_windows):
    """Keys and values (n_layer, n_windows, nh, context_len, hd) of windows spread over ids."""
    block = model.config.context_len
    starts = torch.linspace(0, ids.numel() - block, n_windows).long().tolist()
    cache = model.new_cache(n_windows, "float32")
    model(torch.stack([ids[s:s + block] for s in starts]), cache)
    keys, values = zip(*(cache[layer] for layer in range(len(cache))))  # the seed's list form
    return torch.stack(keys).float(), torch.stack(values).float()


def greedy_agreement(model, prompts, n, vocab_limit):
    """For each kv dtype: the greedy tokens of every prompt, compared with the float32 cache's."""
    def run_kind(kind):
        return generate_tokens(model, prompts, n, temperature=0, vocab_limit=vocab_limit,
                               cache_kind=kind)
    reference = run_kind("float32")
    for kind in KV_DTYPES:
        same = run_kind(kind) == reference                       # (rows, n)
        first_diff = torch.where(same.all(1), n, (~same).int().argmax(1))
        yield kind, same.float().mean().item(), first_diff.tolist()


def main():
    parser = ArgumentParser(description="The quantized KV cache: bytes, round-trip error on the "
                            "model's real keys and values, greedy agreement with a float32 cache.")
    add_model_args(parser)
    parser.add_argument("--text", default=str(ROOT / "checkpoints" / "shakespeare" / "heldout.txt"),
                        help="text whose keys and values are measured (default: the held-out plays)")
    parser.add_argument("--tokens", type=positive_int, default=200,
                        help="greedy tokens compared per prompt (default: 200)")
    parser.add_argument("--prompts", type=positive_int, default=8,
                        help="prompts taken from --text for the greedy comparison (default: 8)")
    args = parser.parse_args()
    try:
        text = Path(args.text).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--text {args.text}: cannot read it as UTF-8 text ({e})") from None
    model, tokenizer, device = load_from_args(CACHED_MODELS, args)
    c, ids = model.config, torch.tensor(encode_text(tokenizer, text), device=device)
    if ids.numel() < 2 * c.context_len:
        raise UserError(f"--text {args.text}: needs at least {2 * c.context_len} tokens, has {ids.numel()}")

    print(f"\n1. Bytes per token: 2 x {c.n_layer} layers x {c.n_kv_head} kv heads x head bytes, scales counted")
    print(f"   {'kv dtype':9s} {'one head':>34s} {'per token':>10s} {'x context_len':>14s} {'tensors hold':>14s}")
    for kind in KV_DTYPES:
        held = model.new_cache(1, kind).nbytes()
        print(f"   {kind:9s} {head_bytes_text(c.head_dim, kind):>25s} = {head_bytes(c.head_dim, kind):3d} B "
              f"{cache_bytes(c, 1, 1, kind):8,} B {cache_bytes(c, c.context_len, 1, kind):12,} B {held:12,} B")

    n_windows = min(8, ids.numel() // c.context_len)
    keys, values = real_keys_and_values(model, ids, n_windows)
    print(f"\n2. Real keys and values ({n_windows} windows of {args.text}): round-trip error "
          "||x - read back|| / ||x||")
    for name, x in (("keys", keys), ("values", values)):
        channel_max = x.abs().amax(dim=(1, 3))  # (n_layer, nh, hd): each channel's largest |value|
        ratio = (channel_max.amax(-1) / channel_max.median(-1).values).amax().item()
        print(f"   {name:6s}: the largest channel's max |x| is up to {ratio:.1f}x the median channel's")
    group = math.gcd(INT4_GROUP_SIZE, c.context_len)  # tokens per per-channel scale
    print(f"   {'scheme':46s} {'keys':>7s} {'values':>7s}")
    for bits in (8, 4):
        schemes = [(f"int{bits} per token, groups of {group_size(c.head_dim, f'int{bits}')} channels",
                    group_size(c.head_dim, f"int{bits}"), False),
                   (f"int{bits} per channel, groups of {group} tokens (KIVI)", group, True)]
        for label, g, per_channel in schemes:
            print(f"   {label:46s} {relative_error(keys, round_trip(keys, bits, g, per_channel)):7.4f} "
                  f"{relative_error(values, round_trip(values, bits, g, per_channel)):7.4f}")

    prompt_len = min(32, c.context_len // 4)
    starts = torch.linspace(0, ids.numel() - prompt_len, args.prompts).long().tolist()
    prompts = [ids[s:s + prompt_len].tolist() for s in starts]
    print(f"\n3. Greedy agreement with the float32 cache: {args.prompts} prompts of {prompt_len} "
          f"tokens from the text, {args.tokens} new tokens each")
    for kind, same, first_diff in greedy_agreement(model, prompts, args.tokens, tokenizer.n_vocab):
        print(f"   {kind:9s}: {100 * same:5.1f}% of tokens the same; first difference at "
              f"{', '.join(map(str, first_diff))} (of {args.tokens})")
    print(f"\nbits/char through each cache: python generate.py --score {args.text} --kv-dtype int4",
          file=sys.stderr)


if __name__ == "__main__":
    run(main)
