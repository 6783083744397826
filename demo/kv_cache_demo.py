"""
kv_cache.py's demo (`python kv_cache.py`), in five numbered parts: (1) correctness, parity
of incremental feeds with one full forward; (2) speed with and without the cache; (3) the
cache's size, against its formula; (4) a batch of different prompts; (5) speculative
decoding, the cache rolled back.

The cached models come in as an argument (kv_cache.CACHED_MODELS): kv_cache.py runs this
module, so this module never imports it back.
"""

import time

import torch

from generation.loop import GenerationStats, generate_tokens, synchronize
from generation.rows import Rows
from generation.speculative import PromptLookup, verify
from kv_quant import KV_DTYPES, cache_bytes, cache_formula, dtype_name
from plumbing.checkpoint import NAIVE_MODELS
from plumbing.cli import (ArgumentParser, add_compile_cache_arg, add_model_args, add_speculation_args,
                          check_speculate, load_from_args, positive_int, prepare_for_generation,
                          proposer_from_args, use_compile_cache_arg)
from plumbing.script import UserError
from plumbing.user_text import prompt_tokens


def parse_args():
    parser = ArgumentParser(description="KV-cache demo: parity with a full forward, "
                            "speed with and without the cache, the cache's size, a batch.")
    add_model_args(parser)
    parser.add_argument("--tokens", type=positive_int, default=200,
                        help="tokens to generate in the speed test (default: 200)")
    parser.add_argument("--compile", action="store_true", help="also time the cached loop "
                        "with its static-shape decode step compiled (generation/compiled_step.py)")
    add_compile_cache_arg(parser)
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, help="also store the cache as this "
                        "dtype (int8, int4: quantized; kv_quant.py) and use it in parts 2-5")
    add_speculation_args(parser)
    args = parser.parse_args()
    use_compile_cache_arg(parser, args)
    return args


def naive_twin(model, args, device):
    """The naive model of the same family, holding the cached model's weights. It takes the
    cached model's state dict as it is, and the same weight layout, so that the speed
    comparison measures only the cache."""
    config = model.config
    naive = NAIVE_MODELS[config.family](config).to(device=device, dtype=model.lm_head.weight.dtype).eval()
    naive.load_state_dict(model.state_dict(), strict=True)
    prepare_for_generation(naive, args)
    return naive


def incremental_logits(model, idx, chunk, kind):
    """Feed idx (B, T) through a cache of `kind` `chunk` tokens per forward (the seed's
    list form for "cat"); returns the logits (B, T, V) and the cache."""
    cache = None if kind == "cat" else model.new_cache(idx.size(0), kind)
    pieces = []
    for start in range(0, idx.size(1), chunk):
        logits, cache = model(idx[:, start:start + chunk], cache)
        pieces.append(logits)
    return torch.cat(pieces, dim=1), cache


def timed_generate(model, idx, n, vocab_limit, **loop_args):
    """(tokens, tokens per second) for a greedy generation of n tokens."""
    synchronize(idx.device)
    t0 = time.perf_counter()
    out = model.generate(idx, n, temperature=0, vocab_limit=vocab_limit, **loop_args)
    synchronize(idx.device)
    return out, n / (time.perf_counter() - t0)


@torch.no_grad()
def correctness_part(model, idx, kv_dtype):
    """Part 1: the logits of idx (1, T) fed token by token and in chunks, through each kind
    of cache, against one full forward."""
    print("\n1. Correctness: incremental feeds vs one full forward (max |full - incremental| logit)")
    full, _ = model(idx)
    kinds = [("cat", "torch.cat list cache"), (None, "preallocated KVCache")]
    if kv_dtype:
        kinds.append((kv_dtype, f"{kv_dtype} KVCache"))
    for kind, name in kinds:
        for chunk in (1, 5):
            logits, _ = incremental_logits(model, idx, chunk, kind)
            diff = (full - logits).abs().max().item()
            feed = "token by token " if chunk == 1 else f"chunks of {chunk}    "
            print(f"   {feed} {name:21s}: {diff:.2e}")
    print(f"   ({idx.size(1)} random tokens; not exactly 0 because the same math is batched differently"
          + (f"; {kv_dtype} also rounds what it stores" if kv_dtype else "") + ")")


def speed_part(model, naive, tokenizer, prompt, args, kv):
    """Part 2: greedy generations of prompt (1, T) with and without the cache (and with the
    compiled step, given --compile), and the text the cached one wrote."""
    device, n_tokens, n_vocab = prompt.device, args.tokens, tokenizer.n_vocab
    print(f"\n2. Speed: {n_tokens} new tokens, greedy, batch 1, {device.type}"
          + (f", {args.quantize} weights (both loops)" if args.quantize != "none" else "")
          + (f", {args.kv_dtype} cache" if kv else ""))
    timed_generate(model, prompt, 8, n_vocab, **kv)  # warm-up: first calls pay for allocation
    timed_generate(naive, prompt, 8, n_vocab)
    cached_out, cached_tps = timed_generate(model, prompt, n_tokens, n_vocab, **kv)
    naive_out, naive_tps = timed_generate(naive, prompt, n_tokens, n_vocab)
    naive_name = f"{type(naive).__module__}.{type(naive).__name__}.generate"  # base_model.GPT.generate
    print(f"   without cache ({naive_name}): {naive_tps:8.1f} tokens/s")
    cached_name = f"{type(model).__name__}.generate"                          # KVCacheGPT.generate
    print(f"   with cache    ({cached_name}){' ' * (len(naive_name) - len(cached_name))}: {cached_tps:8.1f} tokens/s")
    why = "float ties in argmax" + (f", or the {args.kv_dtype} cache's rounding" if kv else "")
    print(f"   speedup: {cached_tps / naive_tps:.2f}x; same tokens: "
          f"{'yes' if torch.equal(cached_out, naive_out) else f'no ({why})'}")
    if args.compile:
        stats = GenerationStats()
        timed_generate(model, prompt, 8, n_vocab, compile=True, stats=stats)  # compiles
        compiled_out, compiled_tps = timed_generate(model, prompt, n_tokens, n_vocab, compile=True)
        print(f"   with cache, compiled step               : {compiled_tps:8.1f} tokens/s "
              f"({compiled_tps / cached_tps:.2f}x eager; compiling took {stats.compile_seconds:.1f} s; "
              f"same tokens: {'yes' if torch.equal(compiled_out, cached_out) else 'no'})")
    text = tokenizer.decode(cached_out[0, prompt.size(1):].tolist())
    print("   continuation: " + repr(text[:120]) + ("..." if len(text) > 120 else ""))


@torch.no_grad()
def memory_part(model, idx, kv_dtype):
    """Part 3: what the cache's tensors hold, against the formula: the seed's list cache
    after idx's T tokens, the preallocated one for the whole context (and the kv_dtype one)."""
    config, T = model.config, idx.size(1)
    _, cat_cache = model(idx)  # the seed's list form: nothing passed in
    print("\n3. Memory: S_cache = 2 x n_layer x n_kv_head x L x head_dim x bytes (x batch)")
    weights = dtype_name(model.lm_head.weight.dtype)
    print(f"   {config.n_layer} layers, {config.n_kv_head} kv heads, head_dim {config.head_dim}, "
          f"{model.lm_head.weight.element_size()} bytes per value")
    print(f"   torch.cat cache after {T} tokens: formula {cache_bytes(config, T, 1, weights):,} B, "
          f"tensors hold {cat_cache.nbytes():,} B")
    print(f"   preallocated for L = context_len = {config.context_len}: formula "
          f"{cache_bytes(config, config.context_len, 1, weights):,} B, "
          f"tensors hold {model.new_cache(1).nbytes():,} B")
    if config.n_kv_head != config.n_head:  # grouped-query attention: the formula's N_kv_heads
        every_head = cache_bytes(config, config.context_len, 1, weights) * config.n_head // config.n_kv_head
        print(f"   grouped-query attention: {config.n_head} query heads share {config.n_kv_head} "
              f"key/value head{'s' if config.n_kv_head > 1 else ''}; one per query head would "
              f"hold {every_head:,} B, {config.n_head // config.n_kv_head}x as much")
    if kv_dtype:  # codes and their scales: kv_quant.py
        formula, text = cache_formula(config, config.context_len, 1, kv_dtype)
        print(f"   {kv_dtype}: {text} = {formula:,} B, "
              f"tensors hold {model.new_cache(1, kv_dtype).nbytes():,} B")


def batch_part(model, tokenizer, n_tokens, kv):
    """Part 4: three prompts of different lengths as one left-padded batch, each row against
    its prompt generated alone."""
    print("\n4. A batch of different prompts: left-padded, positions from 0 in every row")
    texts = ["ROMEO:", "JULIET:\nO Romeo, Romeo!", "KING HENRY:\nOnce more unto the breach"]
    prompts = [prompt_tokens(tokenizer, t) for t in texts]
    n = min(40, n_tokens)
    n_vocab = tokenizer.n_vocab
    batch = generate_tokens(model, prompts, n, temperature=0, vocab_limit=n_vocab, **kv)
    alone = [generate_tokens(model, [p], n, temperature=0, vocab_limit=n_vocab, **kv)[0] for p in prompts]
    for text, row, single in zip(texts, batch, alone):
        print(f"   {len(tokenizer.encode_ordinary(text)):2d}-token prompt {text.splitlines()[0]!r:14s}: "
              f"same {n} tokens as alone: {'yes' if torch.equal(row, single) else 'no'}")


def partly_right_proposal(ids, k, n, device):
    """The first point of the text ids where a prompt lookup (n-grams, k tokens) proposes
    something partly right: (end, proposals, the proposed tokens), the text so far being
    ids[:end]; None where there is no such point."""
    lookup = PromptLookup(n)
    for end in range(2, len(ids) - k):
        lookup.start([ids[:end]], device=device)
        proposals = lookup.propose(k)
        proposed = proposals.tokens[0, :proposals.counts[0]].tolist()
        right = next((i for i, (a, b) in enumerate(zip(proposed, ids[end:])) if a != b), len(proposed))
        if 0 < right < len(proposed):
            return end, proposals, proposed
    return None


def speculative_step_by_hand(model, tokenizer, ids, k, n):
    """One step of speculative decoding done with the cache directly, printed: at the first
    point of the text ids (a greedy generation: the model's own choices) where a prompt-lookup
    proposal is partly right."""
    device = model.lm_head.weight.device
    found = partly_right_proposal(ids, k, n, device)
    if found is None:
        print("   (no proposal in this text is partly right: see the totals below)")
        return
    end, proposals, proposed = found
    show = lambda tokens: " ".join(repr(tokenizer.decode([t])) for t in tokens)  # noqa: E731
    cache = model.new_cache(1)
    model(torch.tensor([ids[:end - 1]], device=device), cache)  # the text so far, but its newest token
    print(f"   the text so far ends {tokenizer.decode(ids[max(0, end - 8):end])!r}; "
          f"the cache holds {cache.length} columns")
    print(f"   prompt lookup proposes {show(proposed)}")
    fed = torch.tensor([[ids[end - 1]] + proposed], device=device)
    logits, cache = model(fed, cache)  # the newest token and the proposals, one pass
    tokens, counts = verify(logits, proposals, temperature=0)
    accepted = int(counts[0]) - 1
    print(f"   one pass over the newest token + {len(proposed)} proposals: the cache holds "
          f"{cache.length}; the model's own choices {show(tokens[0].tolist())}")
    # the newest token + the accepted ones; Rows is the generation loop's owner of the cache's
    # rows and columns (one row here: no history to move with it)
    Rows(cache, 1, cache.length, device).rollback(torch.tensor([end + accepted], device=device))
    print(f"   it agrees with the first {accepted}, then adds its own "
          f"{show(tokens[0, accepted:accepted + 1].tolist())}: {accepted + 1} tokens for one pass")
    print(f"   rollback: the cache forgets the {len(proposed) - accepted} rejected and holds "
          f"{cache.length} columns, as if they had never been fed")


@torch.no_grad()
def speculative_part(model, tokenizer, prompt, n_tokens, k, n, draft, kv):
    """Part 5: a step by hand, then whole generations with each proposer against plain."""
    print("\n5. Speculative decoding: propose tokens, check them in one pass, roll the cache back")
    n_vocab = tokenizer.n_vocab
    plain, plain_tps = timed_generate(model, prompt, n_tokens, n_vocab, **kv)
    speculative_step_by_hand(model, tokenizer, plain[0].tolist(), k, n)
    proposers = {f"prompt lookup ({n}-grams)": PromptLookup(n)}
    if draft is not None:
        proposers[draft.describe()] = draft
    print(f"   {n_tokens} new tokens, greedy, up to {k} proposals per pass; plain: {plain_tps:.1f} tokens/s")
    for name, proposer in proposers.items():
        stats = GenerationStats()
        options = dict(speculate=k, proposer=proposer, **kv)
        timed_generate(model, prompt, 8, n_vocab, **options)  # warm-up
        out, tps = timed_generate(model, prompt, n_tokens, n_vocab, stats=stats, **options)
        print(f"   {name}: {stats.proposed} proposed, {stats.accepted} accepted "
              f"({stats.accepted / max(1, stats.proposed):.0%}), {stats.forward_passes} forward passes "
              f"for {n_tokens} tokens; {tps:.1f} tokens/s ({tps / plain_tps:.2f}x); same tokens: "
              f"{'yes' if torch.equal(out, plain) else 'no (float ties in argmax)'}")


def main(cached_models):
    """The demo, for the models of cached_models (family -> cached class)."""
    args = parse_args()
    model, tokenizer, device = load_from_args(cached_models, args)
    args.speculate = args.speculate or 4  # part 5: prompt lookup always, the draft if given
    check_speculate(args.speculate, model)
    draft = proposer_from_args(cached_models, args, model, tokenizer, device) if args.draft is not None else None
    kv = {"cache_kind": args.kv_dtype} if args.kv_dtype else {}  # the loop's, or its default
    try:
        model.new_cache(1, args.kv_dtype)
    except ValueError as e:
        raise UserError(f"--kv-dtype {args.kv_dtype}: {e}") from None
    naive = naive_twin(model, args, device)

    idx = torch.randint(tokenizer.n_vocab, (1, min(64, model.config.context_len)), device=device)
    correctness_part(model, idx, args.kv_dtype)
    prompt = torch.tensor([prompt_tokens(tokenizer, "ROMEO:\n")], device=device)
    speed_part(model, naive, tokenizer, prompt, args, kv)
    memory_part(model, idx, args.kv_dtype)
    batch_part(model, tokenizer, args.tokens, kv)
    speculative_part(model, tokenizer, prompt, args.tokens, args.speculate, args.prompt_lookup or 3, draft, kv)
