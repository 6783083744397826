"""
Serve a checkpoint over HTTP with OpenAI's API (completions, chat completions), many
requests at once:

    python serve.py                                  # the bundled model on 127.0.0.1:8000
                                                     # (open http://127.0.0.1:8000/: the page)
    python serve.py --hf ~/models/gpt2 --port 8080
    python serve.py --chat-template chat.jinja       # /v1/chat/completions too
    python serve.py --kv-dtype int8                  # ~3.9x the blocks in the same memory
    python serve.py --speculate 8 --prompt-lookup 3  # speculative decoding, every request
    KVCACHE_API_KEY=secret python serve.py           # clients must send the key

    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "kvcache-gpt", "prompt": "ROMEO:", "max_tokens": 40}'

The engine is in serving/: a paged KV cache with prefix sharing, continuous batching, and
the step loop; serving/server.py is the HTTP side (aiohttp). Ctrl-C or SIGTERM (what docker
stop, systemd and Kubernetes send) stops it gracefully: every stream in flight ends with an
error event, then the process exits 130 (Ctrl-C) or ends by SIGTERM (status 143, 128 + 15);
a second signal ends it at once.
docs/clients.md shows it used from lm-evaluation-harness, guidellm, the openai package
and curl.
"""

import argparse
import os
import signal
import sys
from pathlib import Path

from plumbing.script import Terminated, UserError, begin, run

if __name__ == "__main__":  # run as a command; importing this file changes nothing
    begin()  # before torch: Ctrl-C during the slow imports ends quietly (plumbing/script.py)

from kv_cache import CACHED_MODELS  # noqa: E402
from kv_quant import KV_DTYPES  # noqa: E402
from plumbing.cli import (ArgumentParser, add_compile_cache_arg, add_model_args,  # noqa: E402
                          add_speculation_args, check_speculate, check_speculation_args, load_draft,
                          load_from_args, positive_int, use_compile_cache_arg)
from serving.admission import SERVING_CONTEXT_POLICIES, Limits  # noqa: E402
from serving.scheduler import MAX_STEP_TOKENS  # noqa: E402

API_KEY_VARIABLE = "KVCACHE_API_KEY"


def parse_args():
    p = ArgumentParser(description="An OpenAI-compatible server (POST /v1/completions, "
                       "/v1/chat/completions, /tokenize, /detokenize; GET /v1/models, /metrics, "
                       "/health) on a KV-cached GPT.")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, this machine only; "
                   "0.0.0.0 listens on every interface)")
    p.add_argument("--port", type=int, default=8000, help="default: 8000 (0: any free port)")
    p.add_argument("--served-model-name", default="kvcache-gpt",
                   help="the name clients pass as 'model' (default: kvcache-gpt)")
    p.add_argument("--max-batch", type=positive_int, default=64,
                   help="most sequences decoded together (default: 64)")
    p.add_argument("--num-blocks", type=positive_int, default=None,
                   help="KV blocks in the pool (default: room for --max-batch full "
                   "contexts, at most 1 GiB; the engine preempts when it runs out)")
    p.add_argument("--tokens-per-block", type=positive_int, default=16,
                   help="positions per KV block (default: 16)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                   help="how the pool stores keys and values (default: as the model computes): "
                   "int8 (one scale per head and token) or int4 (one per 32 channels) hold "
                   "~3.9x or ~7x a float32 pool's blocks in the same bytes (kv_quant.py; "
                   "--num-blocks counts blocks of this dtype)")
    p.add_argument("--max-prefill-tokens", type=positive_int, default=2048,
                   help="most padded prompt tokens prefilled in one step (default: 2048)")
    p.add_argument("--max-step-tokens", type=int, default=MAX_STEP_TOKENS,
                   help="a step's token budget: every decoding sequence's token, then chunks of "
                   "waiting prompts, so that a long prompt does not stall the streams decoding "
                   f"(0: each prompt prefilled whole in a step of its own; default: {MAX_STEP_TOKENS}, "
                   "docs/serving.md, chunked prefill)")
    p.add_argument("--attention", choices=["kernel", "gather"], default="kernel",
                   help="how decode steps run: compiled whole by torch.compile at start-up, a "
                   "paged attention kernel inside (default), or eager, with a plain-PyTorch "
                   "gather of the paged cache (starts at once)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="a request decoding alone goes through generate.py --compile's step "
                   "(AOTInductor), not the paged engine: faster for one user; a float32 model's "
                   "library holds a second copy of the weights. --compile builds it if it is not cached (seconds to "
                   "minutes, once per model and machine), and compiles the batch's step with its "
                   "weights frozen; --no-compile: neither; default: the lone step where its build "
                   "is cached, else the batch step while a child process builds it at a lower "
                   "priority, the lone step once built (serving/background_build.py)")
    p.add_argument("--build-only", action="store_true",
                   help="load the model, build the lone request's compiled step into the cache (what a "
                   "start without --compile takes) and exit: what the default start runs in the "
                   "background when none is cached")
    add_compile_cache_arg(p)
    p.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template for /v1/chat/completions (default: the --hf "
                   "directory's own, from tokenizer_config.json or chat_template.jinja; without "
                   "one, chat requests are refused with a 400 saying so)")
    p.add_argument("--api-key", metavar="KEY", default=os.environ.get(API_KEY_VARIABLE),
                   help="require 'Authorization: Bearer KEY' on every request but /health "
                   f"(default: ${API_KEY_VARIABLE} if set, else none; the variable keeps the key "
                   "out of the process list)")
    p.add_argument("--context-policy", metavar="{error,reprefill}", default="error",
                   help="a prompt plus max_tokens longer than the model's context: 'error' "
                   "refuses it with a 400 naming both, as OpenAI and vLLM do (default); "
                   "'reprefill' accepts it and keeps going past the context, keeping the newest "
                   "half (docs/generation.md, past the context). generate.py's 'sinks' is not "
                   "one of the server's: its paged pool does not move cached keys")
    add_speculation_args(p)
    add_limit_args(p)
    args = p.parse_args()
    use_compile_cache_arg(p, args)
    if args.build_only and (args.compile is False or args.no_compile_cache):
        p.error("--build-only builds the compiled step into the cache; drop --no-compile and "
                "--no-compile-cache")
    check_speculation_args(p, args)
    if args.context_policy not in SERVING_CONTEXT_POLICIES:
        why = (": sinks is generate.py's policy (the paged pool does not move cached keys)"
               if args.context_policy == "sinks" else "")
        p.error(f"--context-policy: one of {', '.join(SERVING_CONTEXT_POLICIES)}, "
                f"got {args.context_policy!r}{why}")
    if args.api_key == "":
        p.error(f"--api-key (or ${API_KEY_VARIABLE}) is empty; give a key or leave it unset")
    if not 0 <= args.port <= 65535:
        p.error(f"--port must be in 0..65535, got {args.port}")
    if not args.host.strip():
        p.error("--host is empty (an unset shell variable?); 127.0.0.1 listens on this machine "
                "only, 0.0.0.0 on every interface")
    if args.max_step_tokens < 0 or 0 < args.max_step_tokens <= args.max_batch:
        p.error(f"--max-step-tokens must be 0 (off) or more than --max-batch ({args.max_batch}), so "
                f"that a prompt chunk fits beside a full decode pass; got {args.max_step_tokens}")
    if args.max_waiting < args.max_request_sequences:
        p.error(f"--max-waiting ({args.max_waiting}) must be at least --max-request-sequences "
                f"({args.max_request_sequences}), or the largest request allowed could never wait")
    return args


def add_limit_args(p):
    """The admission limits (serving/admission.py): what one request may ask, how much may wait."""
    d = Limits()
    group = p.add_argument_group("admission limits", "a request past a per-request limit gets "
                                 "HTTP 400 naming it; one that would queue more than --max-waiting "
                                 "sequences gets HTTP 429 with Retry-After")
    group.add_argument("--max-request-sequences", type=positive_int, metavar="N", default=d.max_sequences,
                       help=f"prompts x n in one request (default: {d.max_sequences})")
    group.add_argument("--max-request-prompt-tokens", type=positive_int, metavar="N", default=d.max_prompt_tokens,
                       help=f"prompt tokens of one request, its prompts together (default: {d.max_prompt_tokens})")
    group.add_argument("--max-request-tokens", type=positive_int, metavar="N", default=d.max_new_tokens,
                       help="tokens one request may ask to generate, max_tokens x prompts x n "
                       f"(default: {d.max_new_tokens})")
    group.add_argument("--max-waiting", type=positive_int, metavar="N", default=d.max_waiting,
                       help=f"sequences waiting for a place in the batch, all requests together (default: {d.max_waiting})")


def limits_from_args(args):
    return Limits(max_sequences=args.max_request_sequences, max_prompt_tokens=args.max_request_prompt_tokens,
                  max_new_tokens=args.max_request_tokens, max_waiting=args.max_waiting)


def main():
    args = parse_args()
    try:
        import aiohttp  # noqa: F401  (serve.py's own dependency)
    except ImportError:
        raise UserError("serve.py needs aiohttp: pip install -r requirements.txt") from None

    try:
        import prometheus_client  # noqa: F401  (for /metrics)
        import jinja2  # noqa: F401  (for chat templates)
    except ImportError as e:
        raise UserError(f"serve.py needs {e.name}: pip install -r requirements.txt") from None
    model, tokenizer, device = load_from_args(CACHED_MODELS, args)
    if args.speculate:
        check_speculate(args.speculate, model)
    # a draft proposes for the engine's speculating requests (serving/speculation.py); a
    # --build-only child builds the model's lone step, which needs none
    draft = (load_draft(CACHED_MODELS, args.draft, tokenizer, device, args)
             if args.draft is not None and not args.build_only else None)
    engine = make_engine(args, model, tokenizer, draft)
    if args.build_only:
        if engine.runner.lone is None:
            raise UserError(f"--build-only: a pool stored as {args.kv_dtype} decodes a request alone "
                            "with the batch step; there is no compiled step to build")
        print("the compiled single-stream step is in the cache: a start without --compile takes it",
              file=sys.stderr)
        return
    chat_template = load_chat_template(args, tokenizer)  # once the pool is sure to fit
    pool = engine.pool
    print(f"KV pool: {pool.num_blocks} blocks of {pool.tokens_per_block} positions, {pool.kv_dtype}, "
          f"{pool.nbytes() / 2**20:.1f} MiB (room for {pool.full_contexts(model.config.context_len)} "
          f"full contexts of {model.config.context_len})", file=sys.stderr)
    build = start_lone_step(args, engine, model)
    try:
        serve(args, engine, tokenizer, chat_template)
    finally:
        if build is not None:
            build.stop()


def make_engine(args, model, tokenizer, draft=None):
    """The engine the flags ask for (a --build-only child's: the same, compiling its lone
    step, so that the build is the one the parent's start looks up), with draft proposing."""
    from serving.engine import Engine
    from serving.model_runner import IF_CACHED
    try:
        return Engine(model, tokenizer, num_blocks=args.num_blocks,
                      tokens_per_block=args.tokens_per_block, max_batch=args.max_batch,
                      max_prefill_tokens=args.max_prefill_tokens, max_step_tokens=args.max_step_tokens,
                      attention=args.attention,
                      limits=limits_from_args(args), kv_dtype=args.kv_dtype,
                      compile=True if args.build_only else IF_CACHED if args.compile is None else args.compile,
                      speculate=args.speculate or 0, prompt_lookup=args.prompt_lookup or 3, draft=draft)
    except ValueError as e:  # before anything is allocated: a pool too small or too large, a
        # head size a quantized pool cannot pack
        raise UserError(f"--num-blocks {args.num_blocks or '(default)'}, --tokens-per-block "
                        f"{args.tokens_per_block}, --kv-dtype {args.kv_dtype or '(default)'}: {e}") from None


def serve(args, engine, tokenizer, chat_template):
    """Warm the engine up, open the HTTP server and run the engine until stopped."""
    from serving.server import BackgroundServer
    if args.attention == "kernel":
        print("compiling the decode step (once: up to a minute)...", file=sys.stderr, flush=True)
    engine.warm_up()

    server = BackgroundServer(engine, tokenizer, args.served_model_name, args.host, args.port,
                              chat_template=chat_template, api_key=args.api_key,
                              context_policy=args.context_policy)
    try:
        url = server.open()  # HTTP on its own thread ...
    except OSError as e:
        host = f"[{args.host}]" if ":" in args.host else args.host
        raise UserError(f"cannot listen on {host}:{args.port} ({e.strerror or e}); "
                        "choose another --port or --host") from None
    try:
        extras = ", API key required" if args.api_key else ""  # never the key itself
        print(f"serving {args.served_model_name} on {url} (Ctrl-C stops{extras})\n"
              f"the page, to chat and watch the KV cache: {url.removesuffix('/v1')}/",
              file=sys.stderr, flush=True)
        run_until_stopped(engine)  # ... and the engine on this one, which loaded the model
    finally:
        # the engine has stopped: end what is in flight (each client gets an error), or
        # the server would wait for replies that no step will ever make
        engine.abort_all("the server is shutting down")
        server.close()


def start_lone_step(args, engine, model):
    """Where the default (no --compile or --no-compile) chose, one line on how a request
    alone decodes: the compiled single-stream step where its build is cached, else the
    batch step while a child process builds it (returned: a BackgroundBuild, which the
    engine's runner asks), or where there is no cache to build into, the batch step."""
    if args.compile is not None or engine.pool.kv.dtype != model.lm_head.weight.dtype:
        return None
    from generation.step_cache import cache_folder
    from serving.background_build import BackgroundBuild
    build = None
    if engine.runner.lone is not None:
        line = "the compiled single-stream step, its build cached (--no-compile: off)"
    elif cache_folder() is None:
        line = "the engine's batch step (no compile cache to build the single-stream step into)"
    else:
        build = BackgroundBuild(Path(__file__).resolve(), sys.argv[1:],
                                report=lambda said: print(said, file=sys.stderr, flush=True))
        engine.runner.lone_build = build
        line = ("the engine's batch step until the compiled single-stream step, building in the "
                "background (once per model and machine; --no-compile: off), is ready")
    print(f"a request alone: {line}", file=sys.stderr)
    return build


def run_until_stopped(engine):
    """engine.run() until Ctrl-C (SIGINT) or SIGTERM, either of which stops it after its
    current step; then raises KeyboardInterrupt (plumbing.script.run exits 130) or
    Terminated (run() ends the process by SIGTERM, status 143, once main's cleanup has ended
    every stream: systemd counts death by SIGTERM a clean stop, exit 143 a failure).
    Python's own SIGINT handler raises wherever the main thread is, and inside a
    torch.compile build (a recompile can start mid-serve) it was lost: the server went on
    serving, deaf to Ctrl-C; SIGTERM's default kills at once, cutting every stream without
    an error event. A second signal of either kind ends the process at once."""
    received = []

    def stop(signum, frame):
        received.append(signum)
        restore_default_handlers()  # the second signal is not caught
        engine.stop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)
    try:
        engine.run()
    finally:
        restore_default_handlers()
    # run() returns only when stopped
    if received[0] == signal.SIGTERM:
        raise Terminated(signal.SIGTERM)
    raise KeyboardInterrupt


def restore_default_handlers():
    signal.signal(signal.SIGINT, signal.default_int_handler)  # raises KeyboardInterrupt
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # ends the process


def load_chat_template(args, tokenizer):
    """--chat-template FILE, else the --hf directory's own template, else None; reports
    which, and the tokens it stops at."""
    from serving.chat import TemplateError, template_from_file, template_from_hf_dir
    try:
        if args.chat_template is not None:
            template = template_from_file(args.chat_template, tokenizer)
        elif args.hf is not None:
            template = template_from_hf_dir(args.hf, tokenizer)
        else:
            template = None
    except TemplateError as e:
        raise UserError(f"--chat-template: {e}") from None
    if template is None:
        print("no chat template: /v1/chat/completions refuses requests (--chat-template FILE "
              "gives one)", file=sys.stderr)
    else:
        ends = [tokenizer.decode([t]) for t in template.end_of_turn_ids]
        print(f"chat template: {template.origin} (a turn ends at {', '.join(ends) or 'end of text'})",
              file=sys.stderr)
    return template


if __name__ == "__main__":
    run(main)
