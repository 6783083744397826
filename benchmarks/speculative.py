"""
Speculative decoding measured (generation/speculative.py, docs/speculative.md): a section of
benchmark.py, and a command of its own:

    python -m benchmarks.speculative            # prompt lookup; the draft model at K = 1..8
    python -m benchmarks.speculative --quick    # fewer prompts, K = 1 and 4, one run

Prompt lookup, on prompts from the held-out plays, greedy: ours plain and with prompt
lookup, transformers' generate() plain and with prompt_lookup_num_tokens=, llama.cpp plain
and with llama-cpp-python's LlamaPromptLookupDecoding (when installed). Every system's
speedup is over its own plain decoding in the same run; all of them on identical weights
(the checkpoint, exported), the same prompts, lengths and threads, taking turns.

The draft model, same prompts: ours with the draft at each K, next to transformers'
assisted generation (assistant_model= the same draft exported, num_assistant_tokens=K,
constant schedule); the acceptance rate, tokens per verification and speedup at each K,
and the cost model's prediction from step times measured here:

    speedup(K) = E x t_1 / (K x t_draft + t_verify(K))

E the tokens a verification gives (measured), t_1 the model's one-token step, t_draft the
draft's, t_verify(K) the model's pass over K + 1 tokens.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from plumbing.script import UserError, begin, run

if __name__ == "__main__":  # run as a command; importing this file changes nothing
    begin()  # before torch: Ctrl-C during the slow imports ends quietly (plumbing/script.py)

import torch  # noqa: E402

from benchmarks.peers import (leading_matches, llama_cpp_missing, llama_greedy, load_llama,  # noqa: E402
                              placeholder_tokenizer, transformers_twin)
from benchmarks.timing import alternate, repeat, spread  # noqa: E402
from generation.loop import GenerationStats, generate_tokens, synchronize  # noqa: E402
from generation.speculative import DraftModel, PromptLookup  # noqa: E402
from generation.rows import Rows  # noqa: E402
from kv_cache import CACHED_MODELS  # noqa: E402
from plumbing.checkpoint import ROOT  # noqa: E402
from plumbing.cli import (ArgumentParser, add_model_args, load_draft, load_from_args,  # noqa: E402
                          ngram_size, positive_int)
from plumbing.user_text import encode_text  # noqa: E402

HELDOUT = ROOT / "checkpoints" / "shakespeare" / "heldout.txt"
BUNDLED_DRAFT = ROOT / "checkpoints" / "shakespeare-draft" / "ckpt.pt"
PEER_LOOKUP = dict(tokens=10, ngram=2)  # transformers' and llama-cpp-python's defaults


def heldout_prompts(tokenizer, text, n_prompts, prompt_tokens):
    """n_prompts windows of prompt_tokens tokens, spread evenly over the text."""
    ids = encode_text(tokenizer, text)  # a file read strictly as UTF-8: no lone surrogate
    if len(ids) < prompt_tokens * n_prompts:
        raise UserError(f"--spec-text: the text has {len(ids)} tokens, fewer than {n_prompts} "
                        f"prompts of {prompt_tokens}")
    starts = torch.linspace(0, len(ids) - prompt_tokens, n_prompts).long().tolist()
    return [ids[s:s + prompt_tokens] for s in starts]


# ---------------------------------------------------------------------------- contestants
# each: a function that generates n greedy tokens after every prompt and returns
# (the token lists, seconds, stats or None)

def ours(model, prompts, n, **options):
    device = model.lm_head.weight.device

    def run():
        stats, outputs, seconds = GenerationStats(), [], 0.0
        for prompt in prompts:
            synchronize(device)
            t0 = time.perf_counter()
            out = generate_tokens(model, [prompt], n, temperature=0, stats=stats, **options)
            synchronize(device)
            seconds += time.perf_counter() - t0
            outputs.append(out[0].tolist())
        return outputs, seconds, stats
    return run


def transformers_run(theirs, prompts, n, **generate_args):
    device = theirs.device

    def run():
        outputs, seconds = [], 0.0
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            with torch.inference_mode():
                t0 = time.perf_counter()
                out = theirs.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
                                      **generate_args)
                seconds += time.perf_counter() - t0
            outputs.append(out[0, len(prompt):].tolist())
        return outputs, seconds, None
    return run


def llama_run(llm, prompts, n):
    def run():
        outputs, seconds = [], 0.0
        for prompt in prompts:
            t0 = time.perf_counter()
            outputs.append(llama_greedy(llm, prompt, n))
            seconds += time.perf_counter() - t0
        return outputs, seconds, None
    return run


def summarize(results, n_tokens, reference):
    """{name: row}: tokens/s (median [min-max] over the runs), greedy agreement with the
    reference contestant (leading tokens equal, summed over prompts), and the speculative
    counts of the last run."""
    rows = {}
    for name, runs in results.items():
        outputs, _, stats = runs[-1]
        same = sum(leading_matches(a, b) for a, b in zip(outputs, results[reference][-1][0]))
        rows[name] = {"tok_s": spread([n_tokens / seconds for _, seconds, _ in runs]),
                      "same_tokens": same, "of_tokens": n_tokens}
        if stats is not None and stats.verify_passes:
            per_pass = (stats.accepted + stats.verify_passes) / stats.verify_passes
            rows[name].update(proposed=stats.proposed, accepted=stats.accepted,
                              verify_passes=stats.verify_passes, tokens_per_verification=per_pass)
    return rows


def speedup(rows, name, plain):
    return rows[name]["tok_s"]["median"] / rows[plain]["tok_s"]["median"]


# ---------------------------------------------------------------------------- the sections

def prompt_lookup_section(model, prompts, n, reps, k, ngram, peers=True):
    """Ours, transformers and llama.cpp, each plain and with prompt lookup."""
    runs = {"ours plain": ours(model, prompts, n),
            f"ours lookup K={k} N={ngram}": ours(model, prompts, n, speculate=k,
                                                 proposer=PromptLookup(ngram))}
    notes = []
    theirs = transformers_twin(model, model.lm_head.weight.device) if peers else None
    if theirs is not None:
        runs["transformers plain"] = transformers_run(theirs, prompts, n)
        runs[f"transformers lookup {PEER_LOOKUP['tokens']}"] = transformers_run(
            theirs, prompts, n, prompt_lookup_num_tokens=PEER_LOOKUP["tokens"],
            max_matching_ngram_size=PEER_LOOKUP["ngram"])
    elif peers:
        notes.append("transformers skipped: not installed (pip install -r requirements-dev.txt)")
    missing = llama_cpp_missing() if peers else "skipped"
    with tempfile.TemporaryDirectory() as folder:
        engines = []
        if missing is None and model.lm_head.weight.device.type == "cpu":
            from export_gguf import write_gguf
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
            path = Path(folder) / "f32.gguf"
            write_gguf(path, model, placeholder_tokenizer(), "f32", "speculative")
            threads, ctx = torch.get_num_threads(), model.config.context_len
            engines = [load_llama(path, ctx, threads),
                       load_llama(path, ctx, threads, LlamaPromptLookupDecoding(
                           max_ngram_size=PEER_LOOKUP["ngram"], num_pred_tokens=PEER_LOOKUP["tokens"]))]
            runs["llama.cpp plain"] = llama_run(engines[0], prompts, n)
            runs[f"llama.cpp lookup {PEER_LOOKUP['tokens']}"] = llama_run(engines[1], prompts, n)
        elif peers:
            notes.append(f"llama.cpp {missing or 'skipped: it runs on the CPU only'}")
        try:
            rows = summarize(alternate(runs, reps), n * len(prompts), "ours plain")
        finally:
            for llm in engines:
                llm.close()
    for name in rows:
        system = name.split(" ")[0]
        rows[name]["speedup_over_own_plain"] = speedup(rows, name, f"{system} plain")
    return {"prompts": len(prompts), "prompt_tokens": len(prompts[0]), "tokens": n, "reps": reps,
            "rows": rows, "notes": notes}


def draft_section(model, draft, prompts, n, reps, ks, peers=True):
    """Ours with the draft at each K, transformers' assisted generation beside it, and the
    cost model from step times measured here."""
    runs = {"ours plain": ours(model, prompts, n)}
    for k in ks:
        runs[f"ours draft K={k}"] = ours(model, prompts, n, speculate=k, proposer=DraftModel(draft))
    theirs = transformers_twin(model, model.lm_head.weight.device) if peers else None
    notes = []
    if theirs is not None:
        from transformers.utils import logging as transformers_logging
        # its assisted generation warns about the arguments it passes its own assistant
        # (min_new_tokens with a generation config): nothing a caller can change
        transformers_logging.set_verbosity_error()
        assistant = transformers_twin(draft, draft.lm_head.weight.device)
        # a constant K, and no early stop on the assistant's confidence: the same K as ours
        assistant.generation_config.assistant_confidence_threshold = 0.0
        runs["transformers plain"] = transformers_run(theirs, prompts, n)
        for k in ks:
            runs[f"transformers assisted K={k}"] = transformers_run(
                theirs, prompts, n, assistant_model=assistant, num_assistant_tokens=k,
                num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)
    elif peers:
        notes.append("transformers skipped: not installed (pip install -r requirements-dev.txt)")
    rows = summarize(alternate(runs, reps), n * len(prompts), "ours plain")
    for name in rows:
        rows[name]["speedup_over_own_plain"] = speedup(rows, name, f"{name.split(' ')[0]} plain")
    times = step_times(model, draft, len(prompts[0]), ks, reps)
    for k in ks:
        row = rows[f"ours draft K={k}"]
        row["acceptance_from_E"] = acceptance_from_tokens_per_step(row["tokens_per_verification"], k)
        row["predicted_speedup"] = (row["tokens_per_verification"] * times["model_ms"]
                                    / (k * times["draft_ms"] + times["verify_ms"][k]))
    return {"prompts": len(prompts), "prompt_tokens": len(prompts[0]), "tokens": n, "reps": reps,
            "ks": ks, "draft_params_m": draft.num_params() / 1e6, "step_ms": times,
            "rows": rows, "notes": notes}


@torch.inference_mode()
def step_times(model, draft, position, ks, reps, steps=20):
    """Milliseconds (median of reps) of: the model's step over 1 token and over K + 1 tokens,
    and the draft's step over 1 token, each at `position` cached tokens, batch 1. Each pass
    is rolled back after it (generation/rows.py's rollback), so every one sees the same cache."""
    def time_pass(m, width):
        device = m.lm_head.weight.device
        rows = Rows(m.new_cache(1), 1, m.config.context_len, device)
        prompt = torch.zeros(1, position, dtype=torch.long, device=device)
        rows.record(prompt)
        m(prompt, rows.cache)
        tokens = torch.zeros(1, width, dtype=torch.long, device=device)
        keep = torch.tensor([position], device=device)

        def once():
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                rows.record(tokens)
                m(tokens, rows.cache)
                rows.rollback(keep)
            synchronize(device)
            return (time.perf_counter() - t0) / steps * 1e3
        return statistics.median(repeat(once, reps))
    return {"model_ms": time_pass(model, 1), "draft_ms": time_pass(draft, 1),
            "verify_ms": {k: time_pass(model, k + 1) for k in ks}}


def acceptance_from_tokens_per_step(tokens, k):
    """The acceptance rate a that gives `tokens` per verification with K proposals, if each
    proposal were accepted with probability a: E = (1 - a^(K+1)) / (1 - a) = 1 + a + ... + a^K,
    increasing in a, solved by bisection."""
    low, high = 0.0, 1.0
    for _ in range(50):
        a = (low + high) / 2
        if sum(a ** i for i in range(k + 1)) < tokens:
            low = a
        else:
            high = a
    return (low + high) / 2


def plan(args, model, tokenizer):
    """What the section will run, checked before any measuring (benchmark.py runs it last,
    after minutes of other sections): the prompts, the tokens after each, the draft model
    (None when there is none). A bad flag is one line (UserError)."""
    context_len = model.config.context_len
    for flag, ks in (("--spec-lookup-k", [args.spec_lookup_k]), ("--spec-ks", args.spec_ks)):
        if max(ks) >= context_len:  # a step feeds the newest token and K proposals
            raise UserError(f"{flag}: {max(ks)} proposals and the newest token do not fit in the "
                            f"model's context of {context_len}; use at most {context_len - 1}")
    if args.spec_prompt_tokens >= context_len:
        raise UserError(f"--spec-prompt-tokens {args.spec_prompt_tokens}: leaves no room to generate "
                        f"in the model's context of {context_len}")
    try:
        text = Path(args.spec_text).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--spec-text {args.spec_text}: cannot read it as UTF-8 text ({e})") from None
    prompts = heldout_prompts(tokenizer, text, args.spec_prompts, args.spec_prompt_tokens)
    n = min(args.spec_tokens, context_len - args.spec_prompt_tokens)  # no reprefill
    return {"prompts": prompts, "tokens": n, **draft_model(args, model, tokenizer)}


def draft_model(args, model, tokenizer):
    """{"draft": the --spec-draft model, loaded as generate.py --draft loads it (float32,
    unquantized, as the peers get it), "draft_path": its path}; without --spec-draft the
    bundled draft if it drafts for this model, else {"draft": None, "note": why}."""
    path = args.spec_draft or BUNDLED_DRAFT
    if args.spec_draft is None and not BUNDLED_DRAFT.exists():
        return {"draft": None, "note": f"skipped: {BUNDLED_DRAFT} is missing (--spec-draft PATH)"}
    fp32_args = argparse.Namespace(dtype="float32", quantize="none", group_size=None)
    try:
        draft = load_draft(CACHED_MODELS, str(path), tokenizer, model.lm_head.weight.device, fp32_args,
                           flag="--spec-draft" if args.spec_draft else "the bundled draft",
                           report=lambda line: None)
    except UserError as e:
        if args.spec_draft is not None:
            raise
        # the bundled draft drafts for the bundled model: another model goes on without it
        return {"draft": None, "note": f"skipped: {e} (--spec-draft PATH)"}
    return {"draft": draft, "draft_path": path}


def speculative_section(model, planned, args, peers=True):
    """Both parts, as benchmark.py runs them (planned: plan()'s); the draft part needs a
    draft model."""
    prompts, n, draft = planned["prompts"], planned["tokens"], planned["draft"]
    result = {"prompt_lookup": prompt_lookup_section(model, prompts, n, args.reps, args.spec_lookup_k,
                                                     args.spec_lookup_ngram, peers)}
    if draft is None:
        result["draft"] = {"note": planned["note"]}
        return result
    result["draft"] = draft_section(model, draft, prompts, n, args.reps, args.spec_ks, peers)
    result["draft"]["draft"] = str(planned["draft_path"])
    return result


def add_arguments(p):
    """The section's flags (benchmark.py's and this command's)."""
    p.add_argument("--spec-prompts", type=positive_int, help="held-out prompts (default: 4, quick 2)")
    p.add_argument("--spec-prompt-tokens", type=positive_int, default=128, help="default: 128")
    p.add_argument("--spec-tokens", type=positive_int, default=120,
                   help="greedy tokens after each prompt (default: 120)")
    p.add_argument("--spec-lookup-k", type=positive_int, default=8,
                   help="our prompt lookup's proposals per step (default: 8)")
    p.add_argument("--spec-lookup-ngram", type=ngram_size, default=2,
                   help="our prompt lookup's longest n-gram (default: 2, as the peers')")
    p.add_argument("--spec-ks", type=lambda t: sorted({positive_int(x) for x in t.split(",")}),
                   help="the draft model's K values (default: 1,...,8; quick 1,4)")
    p.add_argument("--spec-draft", metavar="CKPT_OR_DIR", help="the draft model, a checkpoint "
                   f"or a Hugging Face directory (default: {BUNDLED_DRAFT})")
    p.add_argument("--spec-text", default=str(HELDOUT), help="text the prompts come from "
                   "(default: the bundled held-out plays)")


def fill_defaults(args):
    args.spec_prompts = args.spec_prompts or (2 if args.quick else 4)
    args.spec_ks = args.spec_ks or ([1, 4] if args.quick else list(range(1, 9)))


# ---------------------------------------------------------------------------- the report

def print_section(s):
    lookup = s["prompt_lookup"]
    print(f"\n## Speculative decoding: prompt lookup ({lookup['prompts']} held-out prompts of "
          f"{lookup['prompt_tokens']} tokens, {lookup['tokens']} new tokens each, greedy)")
    print_contestants(lookup)
    draft = s["draft"]
    if "note" in draft:
        print(f"\n(draft model: {draft['note']})")
        return
    t = draft["step_ms"]
    print(f"\n## Speculative decoding: a draft model ({draft['draft_params_m']:.2f}M params), K = "
          f"{', '.join(map(str, draft['ks']))}")
    print_contestants(draft)
    print(f"\nThe cost model: step times at {draft['prompt_tokens']} cached tokens, batch 1: the model "
          f"{t['model_ms']:.2f} ms, the draft {t['draft_ms']:.2f} ms ({t['draft_ms'] / t['model_ms']:.2f} "
          "of the model's)")
    print("| K | model's pass over K+1 tokens, ms | E measured | a from E | predicted speedup | measured |")
    print("|---|---|---|---|---|---|")
    for k in draft["ks"]:
        row = draft["rows"][f"ours draft K={k}"]
        print(f"| {k} | {t['verify_ms'][k]:.2f} | {row['tokens_per_verification']:.2f} | "
              f"{row['acceptance_from_E']:.2f} | {row['predicted_speedup']:.2f}x | "
              f"{row['speedup_over_own_plain']:.2f}x |")


def print_contestants(table):
    """One section's contestants (prompt lookup's or the draft's), a row each, then its notes."""
    print("| contestant | tok/s | speedup over its own plain | tokens equal to ours plain | "
          "accepted / proposed | tokens per verification |")
    print("|---|---|---|---|---|---|")
    for name, row in table["rows"].items():
        print_row(name, row)
    for note in table["notes"]:
        print(f"({note})")


def print_row(name, row):
    tok_s = row["tok_s"]
    counts = (f"{row['accepted']} / {row['proposed']} ({row['accepted'] / max(1, row['proposed']):.0%})"
              if "proposed" in row else "")
    per = f"{row['tokens_per_verification']:.2f}" if "tokens_per_verification" in row else ""
    print(f"| {name} | {tok_s['median']:.1f} [{tok_s['min']:.1f}-{tok_s['max']:.1f}] | "
          f"{row['speedup_over_own_plain']:.2f}x | {row['same_tokens']} of {row['of_tokens']} | "
          f"{counts} | {per} |")


def main():
    parser = ArgumentParser(description="Speculative decoding: prompt lookup and a draft model, "
                            "next to transformers and llama.cpp (see the module docstring).")
    add_model_args(parser)
    add_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="2 prompts, K = 1 and 4, one run")
    parser.add_argument("--reps", type=positive_int, help="timed runs after a warm-up (default: 3, quick 1)")
    parser.add_argument("--no-peer", action="store_true", help="ours only")
    args = parser.parse_args()
    if args.dtype not in ("auto", "float32") or args.quantize != "none":
        parser.error("the peers get the checkpoint's weights as they are: run it in float32, "
                     "unquantized (drop --dtype and --quantize)")
    fill_defaults(args)
    args.reps = args.reps or (1 if args.quick else 3)
    model, tokenizer, _ = load_from_args(CACHED_MODELS, args)
    if model.lm_head.weight.dtype != torch.float32:
        parser.error("the peers get the checkpoint's weights as they are: run it in float32 "
                     "(--dtype float32)")
    print(f"# speculative decoding, {torch.get_num_threads()} threads, median [min-max] of {args.reps} runs")
    planned = plan(args, model, tokenizer)
    print_section(speculative_section(model, planned, args, peers=not args.no_peer))


if __name__ == "__main__":
    run(main)
