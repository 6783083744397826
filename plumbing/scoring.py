"""
The model's loss on a text (`generate.py --score FILE`): nats per token and bits per
character, in context_len windows that overlap by half, a batch of windows per forward
pass, or the same windows fed through a KV cache as generation feeds it
(nats_through_cache), so that a cache's storage (int8, int4) is scored by what it does to
the predictions.

The cost is the number of tokens: two forward positions per token (the windows overlap by
half). A million characters of whitespace is a million tokens for a tokenizer without
tokens of many spaces (the bundled one): ~8,000 windows of 256. score() reports each
batch to a progress callback, so a command can show how far it is and stop on Ctrl-C.
"""

import math
import time

import torch
import torch.nn.functional as F

from plumbing.script import UserError
from plumbing.text_input import encode_user_text


LOGITS_BUDGET = 1 << 26  # logits of one batch of windows, in floats (256 MB)


@torch.no_grad()
def score(model, tokenizer, text, device, kv_dtype=None, progress=None):
    """Loss of the model on text, scored in context_len windows that overlap by half, so that
    every token after the first window is predicted from at least context_len/2 tokens.
    Windows go through in batches, each one forward pass (as many rows as LOGITS_BUDGET
    holds the logits of); with kv_dtype, they go through a cache of that kind instead
    (nats_through_cache), with the same windows and so the same contexts. progress(done,
    total): called after each batch with the windows scored so far."""
    ids = torch.tensor([tokenizer.eot_token] + encode_user_text(tokenizer, text, "--score"), device=device)
    context_len, n_targets = model.config.context_len, ids.numel() - 1
    windows = score_windows(n_targets, context_len)
    rows = max(1, min(16, LOGITS_BUDGET // (context_len * model.config.vocab_size)))
    if kv_dtype:
        total_nats = nats_through_cache(ids, windows, context_len,
                                        lambda rows: model.new_cache(rows, kv_dtype),
                                        lambda tokens, cache: model(tokens, cache)[0], rows, progress)
    else:
        total_nats = 0.0
        for done, tokens, targets in window_batches(ids, windows, rows):
            logits = model(tokens)[0].float()  # (rows, width, V): padding comes last, unseen
            total_nats += F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                          ignore_index=-1, reduction="sum").item()
            if progress:
                progress(done, len(windows))
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


def window_batches(ids, windows, rows):
    """(windows done, tokens, targets) per batch of `rows` windows: tokens (rows, width),
    right-padded; targets the same shape, -1 where nothing is scored (padding, or a target
    an earlier window scored)."""
    for i in range(0, len(windows), rows):
        batch = windows[i:i + rows]
        width = max(end - window_start for window_start, end, _ in batch)
        tokens = torch.zeros(len(batch), width, dtype=torch.long, device=ids.device)
        targets = torch.full_like(tokens, -1)
        for row, (window_start, end, first) in enumerate(batch):
            tokens[row, :end - window_start] = ids[window_start:end]
            targets[row, first:end - window_start] = ids[window_start + 1 + first:end + 1]
        yield i + len(batch), tokens, targets


def nats_through_cache(ids, windows, context_len, new_cache, forward, rows=16, progress=None):
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
    for done, tokens, targets in window_batches(ids, windows, rows):
        batch = windows[done - len(tokens):done]
        prefill = min(context_len // 2, *(end - window_start for window_start, end, _ in batch))
        cache = new_cache(len(batch))
        for start, stop in [(0, prefill), *((c, c + 1) for c in range(prefill, tokens.shape[1]))]:
            logits = forward(tokens[:, start:stop], cache).float()  # (rows, stop - start, V)
            total_nats += F.cross_entropy(logits.flatten(0, 1), targets[:, start:stop].flatten(),
                                          ignore_index=-1, reduction="sum").item()
        if progress:
            progress(done, len(windows))
    return total_nats


class Progress:
    """score()'s progress callback: the windows done so far, and on a terminal (stream) one
    line kept up to date with the time taken and an estimate of the time left."""

    def __init__(self, label, stream=None):
        self.label, self.stream, self.done, self.total = label, stream, 0, None
        self.started = time.monotonic()

    def __call__(self, done, total):
        self.done, self.total = done, total
        if self.stream is not None:
            taken = time.monotonic() - self.started
            line = (f"{total:,} windows in {clock(taken)}" if done == total else
                    f"{done:,} of {total:,} windows, {clock(taken)} taken, "
                    f"~{clock(taken / done * (total - done))} left")
            print(f"\r{self.label}: {line:<60}", end="\n" if done == total else "",
                  file=self.stream, flush=True)

    def stopped(self):
        """The line that says how far it got, for a score stopped by Ctrl-C."""
        so_far = f"{self.done:,} of {self.total:,} windows" if self.total else "before the first window"
        return f"{self.label}: stopped by Ctrl-C ({so_far} scored)"


def clock(seconds):
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}"
