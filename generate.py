"""
Generate text from a checkpoint: prefill the prompt once, decode one token per step
through the KV cache, sample, stream the text, stop.

    python generate.py --prompt "ROMEO:"
    python generate.py --prompt "ROMEO:" --temperature 0 --stats
    python generate.py --prompt-file play.txt --num-samples 3 --stop "\\n\\n"
    python generate.py --score checkpoints/shakespeare/heldout.txt

The token loop itself is KVCacheGPT.stream (kv_cache.py), or GPT.stream with --no-cache;
this file turns its tokens into text and decides when to stop.
"""

import codecs
import math
import sys
import time

# cli first, before torch: Ctrl-C during the slow imports then ends quietly (see cli.py)
from cli import (ArgumentParser, UserError, add_model_args, json_text, load_from_args,
                 positive_int, run)

import torch

from base_model import GPT
from kv_cache import KVCacheGPT, cache_bytes_formula, synchronize
from sample import check_sampling_args
from stop_strings import StopString
from validation import check_fits_in_memory, generation_memory, max_text_bytes


def parse_args():
    p = ArgumentParser(description="Generate text with a KV-cached GPT, or score a text file.")
    add_model_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="", help="prompt text, or - to read standard input "
                     "(default: empty, which starts from the end-of-text token)")
    src.add_argument("--prompt-file", metavar="PATH", help="read the prompt from a UTF-8 file")
    src.add_argument("--score", metavar="FILE", help="instead of generating, print the model's "
                     "loss on a UTF-8 text file (nats per token, bits per character)")
    p.add_argument("--max-new-tokens", type=positive_int, default=200, help="default: 200")
    p.add_argument("--temperature", type=float, default=0.8, help="0 means greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample from the smallest set of tokens whose probability reaches p")
    p.add_argument("--num-samples", type=positive_int, default=1,
                   help="samples of the same prompt, prefilled once and decoded as one batch")
    p.add_argument("--stop", action="append", default=[], metavar="STRING",
                   help="end a sample at STRING, which is not printed (repeatable)")
    p.add_argument("--ignore-eot", action="store_true",
                   help="do not stop at the end-of-text token (fixed-length runs)")
    p.add_argument("--no-cache", action="store_true",
                   help="the naive loop: re-run the whole context every step (for comparison)")
    p.add_argument("--no-stream", action="store_true", help="print once at the end")
    p.add_argument("--stats", action="store_true", help="timings and cache size, on stderr")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object with the texts and the stats")
    args = p.parse_args()
    try:
        check_sampling_args(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        p.error(str(e).replace("top_k", "--top-k").replace("top_p", "--top-p")
                .replace("temperature", "--temperature", 1))
    if any(s == "" for s in args.stop):
        p.error("--stop: the stop string must not be empty")
    for flag, texts in (("--prompt", [args.prompt]), ("--stop", args.stop)):
        for text in texts:
            try:  # bytes that are not UTF-8 reach Python as lone surrogates, which have no bytes
                text.encode("utf-8")
            except UnicodeEncodeError:
                p.error(f"{flag}: not UTF-8 text (the shell passed bytes that are not UTF-8)")
    return args


def read_text(path, what):
    """The contents of a UTF-8 text file, or one UserError line saying why not. No more is
    read than memory can tokenize: /dev/zero, say, never ends."""
    limit = max_text_bytes()
    if path == "-":
        if sys.stdin is None:  # started with <&-
            raise UserError(f"{what} -: standard input is closed")
        data = sys.stdin.buffer.read(limit + 1)
    else:
        try:
            with open(path, "rb") as f:
                data = f.read(limit + 1)
        except IsADirectoryError:
            raise UserError(f"{what} {path}: is a directory, expected a text file") from None
        except OSError as e:
            raise UserError(f"{what} {path}: cannot read it ({e.strerror})") from None
    if len(data) > limit:
        raise UserError(f"{what} {path}: more than {limit:,} bytes, more text than this "
                        "machine's memory can tokenize")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {path}: not UTF-8 text (byte {e.start}); convert it to UTF-8") from None


class SampleText:
    """The text of one sample, built token by token.

    Tokens are byte sequences, and one UTF-8 character can span two tokens: an incremental
    decoder holds back an incomplete character until its last byte arrives, so nothing
    printed is ever half a character. Text that might be the start of a stop string is
    held back too, until it is clear that it is not one."""

    def __init__(self, tokenizer, stops, stop_at_eot=True):
        self.tokenizer, self.stop_at_eot = tokenizer, stop_at_eot
        self.stops = [StopString(s) for s in stops]  # each reads every new character once
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text, self.tokens, self.done = "", 0, False

    def add(self, token):
        if token == self.tokenizer.eot_token and self.stop_at_eot:
            self.done = True
            return
        self.tokens += 1
        piece = self.decoder.decode(self.tokenizer.decode_single_token_bytes(token))
        start = len(self.text)
        self.text += piece
        # where each stop string's first match begins, if this piece completed one
        hits = [start + end - len(s.stop) for s in self.stops if (end := s.feed(piece)) is not None]
        if hits:
            self.text = self.text[:min(hits)]
            self.done = True

    def ready(self):
        """How many characters can be shown now: all but the end of the text that is the
        start of a stop string."""
        if self.done:
            return len(self.text)
        return len(self.text) - max((s.matched for s in self.stops), default=0)


class Printer:
    """Writes samples to stdout one after another, each as prompt + continuation. The first
    streams live while the batch decodes; a later one catches up when the one before it is
    done. Called every step to stream, or once at the end."""

    def __init__(self, samples, prompt):
        self.samples, self.prompt = samples, prompt
        self.current, self.shown = 0, None  # shown: characters printed; None: not begun

    def update(self):
        while self.current < len(self.samples):
            sample = self.samples[self.current]
            if self.shown is None:
                if len(self.samples) > 1:
                    sys.stdout.write(f"--- sample {self.current + 1} of {len(self.samples)} ---\n")
                sys.stdout.write(self.prompt)
                self.shown = 0
            end = sample.ready()
            sys.stdout.write(sample.text[self.shown:end])
            self.shown = end
            if not sample.done:
                break
            sys.stdout.write("\n")
            self.current, self.shown = self.current + 1, None
        sys.stdout.flush()


def read_prompt(args):
    """The prompt text from --prompt, --prompt-file or standard input (--prompt -)."""
    if args.prompt_file:
        return read_text(args.prompt_file, "--prompt-file")
    return read_text("-", "--prompt") if args.prompt == "-" else args.prompt


def encode_prompt(text, tokenizer, block_size):
    """Token ids of the prompt; an empty one starts from the end-of-text token."""
    ids = tokenizer.encode_ordinary(text) or [tokenizer.eot_token]
    if len(ids) > block_size:
        print(f"note: the prompt has {len(ids)} tokens and the context {block_size}; "
              f"keeping its last {block_size}", file=sys.stderr)
    return ids


def generate(args, prompt, model, tokenizer, device):
    rows_bytes = generation_memory(model.config, args.num_samples, model.lm_head.weight.element_size())
    check_fits_in_memory(rows_bytes, f"decoding {args.num_samples:,} samples together",
                         f"--num-samples {args.num_samples}")
    ids = encode_prompt(prompt, tokenizer, model.config.block_size)
    samples = [SampleText(tokenizer, args.stop, not args.ignore_eot) for _ in range(args.num_samples)]
    printer = Printer(samples, prompt)
    streaming = not (args.no_stream or args.json)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    stats = {}

    t_start = time.perf_counter()
    tokens = model.stream(torch.tensor([ids], device=device), args.max_new_tokens,
                          args.temperature, args.top_k, args.top_p, generator,
                          stats=stats, num_samples=args.num_samples, vocab_limit=tokenizer.n_vocab)
    steps, t_first = 0, None
    for step_tokens in tokens:
        for sample, token in zip(samples, step_tokens[:, 0].tolist()):  # .tolist() syncs
            if not sample.done:
                sample.add(token)
        steps += 1
        t_first = t_first or time.perf_counter()
        if streaming:
            printer.update()
        if all(s.done for s in samples):
            break
    tokens.close()  # ends the loop early if every sample stopped, and fills the cache stats
    t_end = time.perf_counter()
    for sample in samples:
        sample.done = True  # max_new_tokens reached: show what is held back for stop strings

    report = generation_stats(model, stats, len(ids), samples, steps, t_start, t_first, t_end)
    if args.json:
        print(json_text({"prompt": prompt, "texts": [s.text for s in samples], "stats": report}))
    else:
        printer.update()
    if args.stats:
        print_stats(report)


def generation_stats(model, stats, prompt_tokens, samples, steps, t_start, t_first, t_end):
    rows = len(samples)
    decode_seconds = t_end - t_first if t_first else 0.0
    report = {
        "prompt_tokens": min(prompt_tokens, model.config.block_size),
        "new_tokens": [s.tokens for s in samples],
        "decode_steps": steps,
        "prefill_seconds": stats.get("prefill_seconds"),
        "time_to_first_token_seconds": (t_first - t_start) if t_first else None,
        # every step after the first emits one token per row
        "decode_tokens_per_second": (steps - 1) * rows / decode_seconds if steps > 1 else None,
        "forward_passes": stats["forward_passes"],
        "prefill_passes": stats.get("prefill_passes", 0),
        "positions_processed": stats["positions_processed"],
    }
    if "cache_bytes" in stats:  # the cached loop; the naive one keeps no cache
        c = model.config
        bytes_per_value = model.lm_head.weight.element_size()
        report.update(
            cache_positions=stats["cache_positions"],
            cache_bytes_formula=cache_bytes_formula(c, stats["cache_positions"], rows, bytes_per_value),
            cache_bytes_allocated=stats["cache_bytes"],
            cache_formula=(f"2 x {c.n_layer} layers x {c.n_head} heads x L={stats['cache_positions']} "
                           f"x {c.head_dim} head_dim x {bytes_per_value} B x {rows} rows"),
            reprefills=stats["reprefills"])
    return report


def print_stats(r):
    def fmt(x, unit):
        return "n/a" if x is None else f"{x:.1f} {unit}"
    lines = [
        f"prompt tokens:       {r['prompt_tokens']}",
        f"new tokens:          {', '.join(map(str, r['new_tokens']))} in {r['decode_steps']} steps",
        f"prefill:             {fmt(r['prefill_seconds'] and r['prefill_seconds'] * 1e3, 'ms')}",
        f"time to first token: {fmt(r['time_to_first_token_seconds'] and r['time_to_first_token_seconds'] * 1e3, 'ms')}",
        f"decode:              {fmt(r['decode_tokens_per_second'], 'tokens/s')}",
        f"forward passes:      {r['forward_passes']}, {r['positions_processed']} positions processed",
    ]
    if "cache_bytes_allocated" in r:
        lines += [f"KV cache:            {r['cache_formula']} = {r['cache_bytes_formula']:,} B by the formula",
                  f"                     {r['cache_bytes_allocated']:,} B allocated "
                  f"(preallocated for the whole context); {r['reprefills']} re-prefills past block_size"]
    else:
        lines.append("KV cache:            none (--no-cache)")
    print("\n".join(lines), file=sys.stderr)


@torch.no_grad()
def score(model, tokenizer, text, device):
    """Loss of the model on text, scored in block_size windows that overlap by half, so that
    every token after the first window is predicted from at least block_size/2 tokens."""
    ids = torch.tensor([tokenizer.eot_token] + tokenizer.encode_ordinary(text), device=device)
    block, n_targets = model.config.block_size, ids.numel() - 1
    total_nats, done, begin = 0.0, 0, 0  # targets 1..done are scored
    while done < n_targets:
        end = min(begin + block, n_targets)
        logits = model(ids[None, begin:end])[0][0].float()
        nll = torch.nn.functional.cross_entropy(logits, ids[begin + 1:end + 1], reduction="none")
        total_nats += nll[done - begin:].sum().item()  # only targets not scored before
        done, begin = end, end - block // 2
    if not math.isfinite(total_nats):  # activations overflowed (float16 has a small range)
        raise UserError(f"the model's loss on this text is {total_nats} (its activations overflow "
                        "in this dtype); try --dtype float32")
    return {"chars": len(text), "tokens": n_targets, "nats_per_token": total_nats / n_targets,
            "bits_per_char": total_nats / math.log(2) / len(text)}


def main():
    args = parse_args()
    # read the input first: a bad file should fail before the model is loaded
    text = read_text(args.score, "--score") if args.score else read_prompt(args)
    if args.score and not text:
        raise UserError(f"--score {args.score}: the file is empty")
    model, tokenizer, device = load_from_args(GPT if args.no_cache else KVCacheGPT, args)
    if not args.score:
        return generate(args, text, model, tokenizer, device)
    result = score(model, tokenizer, text, device)
    if args.json:
        print(json_text(result))
    else:
        print(f"{args.score}: {result['chars']:,} characters, {result['tokens']:,} tokens, "
              f"{result['nats_per_token']:.4f} nats/token, {result['bits_per_char']:.4f} bits/char")


if __name__ == "__main__":
    run(main)
