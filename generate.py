"""
Generate text from a checkpoint: prefill the prompt once, decode one token per step
through the KV cache, sample, stream the text, stop.

    python generate.py --prompt "ROMEO:"
    python generate.py --prompt "ROMEO:" --temperature 0 --stats
    python generate.py --prompt-file play.txt --num-samples 3 --stop "\\n\\n"
    python generate.py --prompt "ROMEO:" --prompt "JULIET:" --prompt "HAMLET:"   # one batch
    python generate.py --prompts-file prompts.jsonl --json
    python generate.py --score checkpoints/shakespeare/heldout.txt
    python generate.py --prompt "ROMEO:" --kv-dtype int4 --stats    # a quantized cache
    python generate.py --score checkpoints/shakespeare/heldout.txt --kv-dtype int8
    python generate.py --ckpt checkpoints/shakespeare-llama/ckpt.pt --prompt "ROMEO:" \
        --max-new-tokens 1000 --context-policy sinks    # past the context without recomputing
    python generate.py --prompt "ROMEO:" --temperature 0 --speculate 4 --prompt-lookup 3 --stats
    python generate.py --prompt "ROMEO:" --speculate 3 --draft checkpoints/shakespeare-draft/ckpt.pt
    python generate.py --prompt "ROMEO:" --repetition-penalty 1.3 --min-p 0.05 --bad-words thou
    python generate.py --prompt "Who? " --choice ROMEO --choice JULIET     # structured outputs:
    python generate.py --json-schema person.json --regex ... --grammar FILE  # see --help

This file is the command: it drives the generation loop (generation/loop.py: prefill,
decode one token at a time, sample), turns its tokens into text and decides when each row
stops. With --no-cache it drives the naive loop, base_model.GPT.stream, instead. Several
prompts are generated as one batch (left-padded: kv_cache.py explains why the positions
restart in every row); the output keeps their order, one section per prompt. --score
reads a text through the model instead (plumbing/scoring.py); --stats and --json report
what the run did (plumbing/stats_report.py).
"""

import sys
import time

from plumbing.script import UserError, begin, run

# the start that --stats' "from the start" counts from: this module's import, before torch's
# (the interpreter's own start-up, some tens of milliseconds, comes before it and is not counted)
IMPORTED_AT = time.perf_counter()

if __name__ == "__main__":  # run as a command; importing this file changes nothing
    begin()  # before torch: Ctrl-C during the slow imports ends quietly (plumbing/script.py)

import torch  # noqa: E402

from generation.loop import (CONTEXT_POLICIES, DEFAULT_SINKS, Generation, GenerationStats,  # noqa: E402
                             check_context_policy)
from generation.speculative import DraftModel  # noqa: E402
from kv_cache import CACHED_MODELS  # noqa: E402
from kv_quant import KV_DTYPES, dtype_name  # noqa: E402
from plumbing.checkpoint import NAIVE_MODELS  # noqa: E402
from plumbing.cli import (ArgumentParser, add_compile_cache_arg, add_model_args,  # noqa: E402
                          add_speculation_args, check_speculation_args, load_from_args, positive_int,
                          proposer_from_args, use_compile_cache_arg)
from plumbing.memory import check_fits_in_memory, generation_memory  # noqa: E402
from plumbing.outputs import json_text  # noqa: E402
from plumbing.processor_args import (FLAGS as PROCESSOR_FLAGS, add_processor_args,  # noqa: E402
                                     processor_flags_given, processors_from_args)
from plumbing.scoring import Progress, score  # noqa: E402
from plumbing.stats_report import print_stats, stats_report  # noqa: E402
from plumbing.text_input import encode_user_text, parse_prompts_file, read_text  # noqa: E402
from plumbing.text_stream import SampleText  # noqa: E402
from plumbing.user_text import as_prompt  # noqa: E402
from sample import check_sampling_args  # noqa: E402


def parse_args():
    p = ArgumentParser(description="Generate text with a KV-cached GPT, or score a text file.")
    add_model_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", metavar="TEXT",
                     help="prompt text, or - to read standard input; repeat it for a batch of "
                     "prompts (default: empty, which starts from the end-of-text token)")
    src.add_argument("--prompt-file", metavar="PATH", help="read the prompt from a UTF-8 file")
    src.add_argument("--prompts-file", metavar="PATH", help="a batch of prompts, JSON Lines: "
                     'per line a JSON string or an object with a "prompt" string')
    src.add_argument("--score", metavar="FILE", help="instead of generating, print the model's "
                     "loss on a UTF-8 text file (nats per token, bits per character)")
    p.add_argument("--max-new-tokens", type=positive_int, default=200, help="default: 200")
    p.add_argument("--temperature", type=float, default=0.8, help="0 means greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample from the smallest set of tokens whose probability reaches p")
    p.add_argument("--min-p", type=float, default=None,
                   help="sample from the tokens at least min-p times as likely as the likeliest")
    p.add_argument("--num-samples", type=positive_int, default=1,
                   help="samples of each prompt, prefilled once and decoded as one batch")
    p.add_argument("--stop", action="append", default=[], metavar="STRING",
                   help="end a row at STRING, which is not printed (repeatable)")
    p.add_argument("--ignore-eot", action="store_true",
                   help="do not stop at the end-of-text token (fixed-length runs)")
    p.add_argument("--no-cache", action="store_true",
                   help="the naive loop: re-run the whole context every step (for comparison)")
    p.add_argument("--compile", action="store_true",
                   help="decode through a static-shape step compiled ahead of time (AOTInductor) "
                   "(compiling takes a while: --stats reports it apart from the decode speed)")
    add_compile_cache_arg(p)
    p.add_argument("--kv-dtype", choices=KV_DTYPES, help="store the KV cache as this dtype "
                   "(int8, int4: quantized, scales counted in --stats); attention still runs in "
                   "--dtype (default: the model's dtype). With --score: score through the cache")
    p.add_argument("--context-policy", choices=CONTEXT_POLICIES, default="reprefill",
                   help="past the context: reprefill (keep the newest half, compute it again; "
                   "any model) or sinks (keep the first --sinks tokens and the newest, move the "
                   "rest by a rotation: Llama-family models) (default: reprefill)")
    p.add_argument("--sinks", type=int, default=DEFAULT_SINKS,
                   help=f"first tokens that --context-policy sinks keeps (default: {DEFAULT_SINKS})")
    add_speculation_args(p)
    add_processor_args(p)
    p.add_argument("--no-stream", action="store_true", help="print once at the end")
    p.add_argument("--stats", action="store_true", help="timings and cache size, on stderr")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object with the texts and the stats")
    args = p.parse_args()
    try:
        check_sampling_args(args.temperature, args.top_k, args.top_p, args.min_p)
    except ValueError as e:
        p.error(str(e).replace("top_k", "--top-k").replace("top_p", "--top-p").replace("min_p", "--min-p")
                .replace("temperature", "--temperature", 1))
    if any(s == "" for s in args.stop):
        p.error("--stop: the stop string must not be empty")
    if args.compile and args.no_cache:
        p.error("--compile applies to the cached loop; drop --no-cache")
    if (args.prompt or []).count("-") > 1:
        p.error("--prompt -: standard input can be read only once")
    for flag, texts in (("--prompt", args.prompt or []), ("--stop", args.stop)):
        for text in texts:
            try:  # bytes that are not UTF-8 reach Python as lone surrogates, which have no bytes
                text.encode("utf-8")
            except UnicodeEncodeError:
                p.error(f"{flag}: not UTF-8 text (the shell passed bytes that are not UTF-8)")
    if args.kv_dtype and args.no_cache:
        p.error("--kv-dtype: --no-cache keeps no cache to store; drop one of them")
    if args.compile and args.kv_dtype:
        p.error("--compile: its static step writes the model-dtype cache; drop --kv-dtype or --compile")
    if args.context_policy == "sinks" and args.no_cache:
        p.error("--context-policy sinks: applies to generating through the cache; drop --no-cache")
    if args.sinks < 0:
        p.error(f"--sinks: must be >= 0, got {args.sinks}")
    if args.sinks != DEFAULT_SINKS and args.context_policy != "sinks":
        p.error("--sinks applies to --context-policy sinks; add it, or drop --sinks")
    if args.no_cache and processor_flags_given(p, args):
        p.error(f"{processor_flags_given(p, args)[0]}: logits processors run in the cached loop; "
                "drop --no-cache")
    if args.score is not None:
        refuse_generation_flags(p, args)
    check_speculation_args(p, args)
    use_compile_cache_arg(p, args)
    if args.speculate and args.no_cache:
        p.error("--speculate: speculative decoding rolls a cache back, and --no-cache keeps none; "
                "drop one of them")
    return args


# what only generating uses: with --score each is refused rather than silently ignored
GENERATION_FLAGS = ["--max-new-tokens", "--temperature", "--top-k", "--top-p", "--num-samples",
                    "--stop", "--ignore-eot", "--compile", "--speculate", "--prompt-lookup", "--draft",
                    "--no-stream", "--stats", "--context-policy", "--sinks", "--min-p", *PROCESSOR_FLAGS]


def refuse_generation_flags(p, args):
    for flag in GENERATION_FLAGS:
        dest = flag.removeprefix("--").replace("-", "_")
        if getattr(args, dest) != p.get_default(dest):
            p.error(f"{flag} applies to generating; --score reads the file through the model "
                    "and generates nothing: drop one of them")


class Printer:
    """Writes every row to stdout, in order, as its prompt + continuation. The first streams
    live while the batch decodes; a later one catches up when the one before it is done.
    Called every step to stream, or once at the end. headers: a line before each row, or
    None when there is a single row."""

    def __init__(self, samples, prompts, headers):
        self.samples, self.prompts, self.headers = samples, prompts, headers
        self.current, self.shown = 0, None  # shown: characters printed; None: not begun

    def update(self):
        while self.current < len(self.samples):
            sample = self.samples[self.current]
            if self.shown is None:
                if self.headers:
                    sys.stdout.write(self.headers[self.current] + "\n")
                sys.stdout.write(self.prompts[self.current])
                self.shown = 0
            end = sample.ready()
            sys.stdout.write(sample.text[self.shown:end])
            self.shown = end
            if not sample.done:
                break
            sys.stdout.write("\n")
            self.current, self.shown = self.current + 1, None
        sys.stdout.flush()


def row_headers(n_prompts, n_samples):
    """'--- prompt 2 of 3, sample 1 of 2 ---' for each row (prompt-major), naming only what
    there is more than one of; None for a single row."""
    if n_prompts == n_samples == 1:
        return None
    headers = []
    for p in range(1, n_prompts + 1):
        for s in range(1, n_samples + 1):
            parts = ([f"prompt {p} of {n_prompts}"] if n_prompts > 1 else []) + \
                    ([f"sample {s} of {n_samples}"] if n_samples > 1 else [])
            headers.append(f"--- {', '.join(parts)} ---")
    return headers


def read_prompts(args):
    """The prompt texts from --prompt (repeatable; - reads standard input), --prompt-file
    or --prompts-file."""
    if args.prompt_file is not None:
        return [read_text(args.prompt_file, "--prompt-file")]
    if args.prompts_file is not None:
        return parse_prompts_file(read_text(args.prompts_file, "--prompts-file"), args.prompts_file)
    return [read_text("-", "--prompt") if p == "-" else p for p in args.prompt or [""]]


def encode_prompt(text, tokenizer, context_len):
    """Token ids of the prompt (user_text.as_prompt: an empty one starts from the
    end-of-text token, a Llama tokenizer's begin with its BOS)."""
    ids = as_prompt(tokenizer, encode_user_text(tokenizer, text, "the prompt"))
    if len(ids) > context_len:
        print(f"note: the prompt has {len(ids)} tokens and the context {context_len}; "
              f"keeping its last {context_len}", file=sys.stderr)
    return ids


def generate(args, prompts, model, tokenizer, device, proposer, processors=None):
    # checked before anything per row exists: 10**12 rows must not start to be listed
    n_rows = len(prompts) * args.num_samples
    kv_dtype = args.kv_dtype or dtype_name(model.lm_head.weight.dtype)
    rows_bytes = generation_memory(model.config, n_rows, kv_dtype)
    if isinstance(proposer, DraftModel):  # its own cache for every row
        draft = proposer.model
        rows_bytes += generation_memory(draft.config, n_rows, dtype_name(draft.lm_head.weight.dtype))
    check_fits_in_memory(rows_bytes, f"decoding {n_rows:,} rows together",
                         f"--num-samples {args.num_samples} with {len(prompts)} prompts")
    rows = [i for i in range(len(prompts)) for _ in range(args.num_samples)]  # prompt-major
    ids = [encode_prompt(p, tokenizer, model.config.context_len) for p in prompts]
    samples = [SampleText(tokenizer, args.stop, not args.ignore_eot) for _ in rows]
    printer = Printer(samples, [prompts[i] for i in rows], row_headers(len(prompts), args.num_samples))
    streaming = not (args.no_stream or args.json)
    loop_args = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                     min_p=args.min_p, generator=torch.Generator(device=device).manual_seed(args.seed),
                     stats=GenerationStats(), vocab_limit=tokenizer.n_vocab)

    t_start = time.perf_counter()
    if args.no_cache:  # the naive loop: one prompt, its samples as rows, every row to the end
        prompt = torch.tensor(ids, device=device).repeat_interleave(args.num_samples, dim=0)
        every_row = list(range(len(rows)))
        steps_out = ((every_row, tokens[:, 0])
                     for tokens in model.stream(prompt, args.max_new_tokens, **loop_args))
        generation = None
    else:
        generation = Generation(model, ids, args.max_new_tokens, num_samples=args.num_samples,
                                compile=args.compile, cache_kind=args.kv_dtype,
                                context_policy=args.context_policy, sinks=args.sinks,
                                speculate=args.speculate or 0, proposer=proposer,
                                processors=processors, **loop_args)
        steps_out = iter(generation)
    steps, decoded, t_first = 0, 0, None
    for step_rows, step_tokens in steps_out:
        step_tokens = step_tokens.tolist()  # .tolist() waits for the step to finish
        for row, token in zip(step_rows, step_tokens):
            samples[row].add(token)
            if samples[row].done and generation is not None:
                generation.finish(row)  # it leaves the batch before the next step
        steps += 1
        if t_first is None:
            t_first = time.perf_counter()
        else:  # decode speed counts every token the model made after the first step
            decoded += len(step_tokens)
        if streaming:
            printer.update()
        if all(sample.done for sample in samples):
            break
    steps_out.close()  # ends the loop early if every row stopped, and fills the cache stats
    t_end = time.perf_counter()
    for sample in samples:
        sample.finish()  # max_new_tokens reached: show what is held back for stop strings

    report = stats_report(model, args, loop_args["stats"], ids, samples, steps, decoded,
                          t_end - t_start, t_first and t_first - t_start, proposer,
                          start_to_first_token_seconds=t_first and t_first - IMPORTED_AT)
    if args.json:
        out = {"prompts": prompts, "texts": [s.text for s in samples], "stats": report}
        if len(prompts) == 1:
            out = {"prompt": prompts[0], **out}
        print(json_text(out))
    else:
        printer.update()
    if args.stats:
        print_stats(report)


def main():
    args = parse_args()
    # read the input first: a bad file should fail before the model is loaded
    if args.score is not None:
        text = read_text(args.score, "--score")
        if not text:
            raise UserError(f"--score {args.score}: the file is empty")
    else:
        prompts = read_prompts(args)
        if args.no_cache and len(prompts) > 1:
            raise UserError("--no-cache generates one prompt at a time (the naive loop has no "
                            "padding); pass a single prompt, or drop --no-cache")
    model, tokenizer, device = load_from_args(NAIVE_MODELS if args.no_cache else CACHED_MODELS, args)
    proposer = proposer_from_args(CACHED_MODELS, args, model, tokenizer, device)
    if args.kv_dtype:
        try:  # a quantized cache needs a head size it can pack
            model.new_cache(1, args.kv_dtype)
        except ValueError as e:
            raise UserError(f"--kv-dtype {args.kv_dtype}: {e}") from None
    try:  # sinks need rotary positions and a float cache: the model says which it has
        check_context_policy(model, args.context_policy, args.sinks, args.kv_dtype)
    except ValueError as e:
        raise UserError(f"--context-policy {args.context_policy}: {e}") from None
    if args.score is None:
        processors = processors_from_args(args, tokenizer)
        return generate(args, prompts, model, tokenizer, device, proposer, processors)
    # how far it is, on a terminal (not with --json, nor into a file or a pipe)
    progress = Progress(f"--score {args.score}", sys.stderr
                        if sys.stderr.isatty() and not args.json else None)
    try:
        result = score(model, tokenizer, text, device, args.kv_dtype, progress)
    except KeyboardInterrupt:
        print(("\n" if progress.stream and progress.done else "") + progress.stopped(), file=sys.stderr)
        raise
    if args.json:
        print(json_text(result))
    else:
        print(f"{args.score}: {result['chars']:,} characters, {result['tokens']:,} tokens, "
              f"{result['nats_per_token']:.4f} nats/token, {result['bits_per_char']:.4f} bits/char")


if __name__ == "__main__":
    run(main)
