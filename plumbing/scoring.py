"""
The model's loss on a text (`generate.py --score FILE`): nats per token and bits per
character, in context_len windows that overlap by half, each one forward pass, or the
same windows fed through a KV cache as generation feeds it (nats_through_cache), so that
a cache's storage (int8, int4) is scored by what it does to the predictions.
"""

import math

import torch
import torch.nn.functional as F

from plumbing.script import UserError
from plumbing.text_input import encode_user_text


@torch.no_grad()
def score(model, tokenizer, text, device, kv_dtype=None):
    """Loss of the model on text, scored in context_len windows that overlap by half, so that
    every token after the first window is predicted from at least context_len/2 tokens. Each
    window is one forward pass; with kv_dtype, the windows go through a cache of that kind
    instead (nats_through_cache), with the same windows and so the same contexts."""
    ids = torch.tensor([tokenizer.eot_token] + encode_user_text(tokenizer, text, "--score"), device=device)
    context_len, n_targets = model.config.context_len, ids.numel() - 1
    windows = score_windows(n_targets, context_len)
    if kv_dtype:
        total_nats = nats_through_cache(ids, windows, context_len,
                                        lambda rows: model.new_cache(rows, kv_dtype),
                                        lambda tokens, cache: model(tokens, cache)[0])
    else:
        total_nats = 0.0
        for window_start, end, first in windows:
            logits = model(ids[None, window_start:end])[0][0].float()
            total_nats += F.cross_entropy(logits[first:], ids[window_start + 1 + first:end + 1],
                                          reduction="sum").item()
    if not math.isfinite(total_nats):  # activations overflowed (float16 has a small range)
        raise UserError(f"the model's loss on this text is {total_nats} (its activations overflow "
                        "in this dtype); try --dtype float32")
    return {"chars": len(text), "tokens": n_targets, "nats_per_token": total_nats / n_targets,
            "bits_per_char": total_nats / math.log(2) / len(text)}


def score_windows(n_targets, context_len):
    """(window_start, end, first) per window: tokens window_start..end-1 predict targets
    window_start+1..end, of which those from index `first` of the window on were not scored
    by an earlier window."""
    windows, done, window_start = [], 0, 0  # targets 1..done are scored
    while done < n_targets:
        end = min(window_start + context_len, n_targets)
        windows.append((window_start, end, done - window_start))
        done, window_start = end, end - context_len // 2
    return windows


def nats_through_cache(ids, windows, context_len, new_cache, forward, rows=16):
    """The summed loss of score()'s windows when every prediction reads its keys and values
    back from a cache, fed as generation feeds it. new_cache(rows) makes an empty cache,
    forward(tokens, cache) returns the logits and extends the cache in place (a model from
    elsewhere fits too: benchmark.py scores transformers' quantized cache with this).

    A window starts a fresh cache at position 0 (learned positions: the loop's reprefill
    does the same), so the windows are independent and go through as the rows of
    one batch, right-padded (padding comes after the text: no query sees it). The first half
    of each window, the context it carries over, is prefilled; the rest is fed one token per
    step. The cache hands back what it stored, so the prefill's own predictions (scored in the
    first window only) read stored keys and values too."""
    total_nats = 0.0
    for i in range(0, len(windows), rows):
        batch = windows[i:i + rows]
        width = max(end - window_start for window_start, end, _ in batch)
        tokens = torch.zeros(len(batch), width, dtype=torch.long, device=ids.device)
        targets = torch.full_like(tokens, -1)  # -1: padding, or a target scored in an earlier window
        for row, (window_start, end, first) in enumerate(batch):
            tokens[row, :end - window_start] = ids[window_start:end]
            targets[row, first:end - window_start] = ids[window_start + 1 + first:end + 1]
        prefill = min(context_len // 2, *(end - window_start for window_start, end, _ in batch))
        cache = new_cache(len(batch))
        for start, stop in [(0, prefill), *((c, c + 1) for c in range(prefill, width))]:
            logits = forward(tokens[:, start:stop], cache).float()  # (rows, stop - start, V)
            total_nats += F.cross_entropy(logits.flatten(0, 1), targets[:, start:stop].flatten(),
                                          ignore_index=-1, reduction="sum").item()
    return total_nats
