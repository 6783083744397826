"""
Past the context, the two policies of generation/loop.py measured on one text four times
the context: what each token costs (reprefill's spikes against the sinks policy's flat
line) and how well the model predicts the text (held-out bits per character).

    python -m benchmarks.context_policy --ckpt checkpoints/shakespeare-llama/ckpt.pt
    python benchmark.py --ckpt checkpoints/shakespeare-llama/ckpt.pt --context-policies

The text (the held-out plays by default, cut to 4 x context_len tokens) goes through the
generation loop itself, fed rather than sampled (Scoring.choose picks the text's own next
token and counts its loss), one token per step after a one-token prompt, exactly as a long
generation meets the end of the context:
  reprefill  when the cache is full, the newest half is computed again at positions 0..:
             a step of context_len/2 positions every context_len/2 steps, and the model
             sees between half a context and a whole one;
  sinks      (rotary models) the first 4 tokens stay, the oldest after them goes, the rest
             turn back one position: every step costs the same, and the model always
             sees a full context, though not a contiguous one.
One-pass windows (generate.py --score: windows of the context overlapping by half) are
given beside them for reference. A GPT-2 model has learned positions: reprefill only.
"""

import math
import statistics
import time

from plumbing.script import begin, run

if __name__ == "__main__":  # run as a command; importing this file changes nothing
    begin()  # before torch: Ctrl-C during the slow imports ends quietly (plumbing/script.py)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.report import fmt_spread  # noqa: E402
from benchmarks.timing import alternate, spread  # noqa: E402
from generation.loop import Generation, check_context_policy  # noqa: E402
from kv_cache import CACHED_MODELS  # noqa: E402
from plumbing.checkpoint import ROOT  # noqa: E402
from plumbing.cli import ArgumentParser, add_model_args, load_from_args, positive_int  # noqa: E402
from plumbing.outputs import check_output_path, publish_result  # noqa: E402
from plumbing.scoring import score  # noqa: E402
from plumbing.text_input import read_text  # noqa: E402
from plumbing.user_text import encode_text  # noqa: E402

HELDOUT = ROOT / "checkpoints" / "shakespeare" / "heldout.txt"


class Scoring(Generation):
    """The loop fed a given text: each step's token is the text's next one (ids (T,) after
    the one-token prompt ids[:1]), its loss under the step's logits is counted, and each
    step's seconds are kept (the step's forward passes, a reprefill's included)."""

    def __init__(self, model, ids, **options):
        super().__init__(model, [ids[:1].tolist()], ids.numel() - 1, temperature=0, **options)
        self.ids, self.fed, self.nats, self.step_seconds, self.last = ids, 0, 0.0, [], None

    def choose(self, logits):
        if self.last is not None:  # the step since the last choice (the first follows the prefill)
            self.step_seconds.append(time.perf_counter() - self.last)
        self.fed += 1
        target = self.ids[self.fed]  # the text's next token
        self.nats += F.cross_entropy(logits[:1].float(), target[None]).item()
        self.last = time.perf_counter()
        return target[None]


def policy_pass(model, ids, policy):
    """One pass of the text under `policy`: the Scoring loop, run to the end."""
    scoring = Scoring(model, ids, context_policy=policy)
    for _ in scoring:
        pass
    return scoring


def policy_summary(passes, chars):
    """Bits per character (the same in every pass) and the cost per token: the steps of
    every timed pass pooled (median, mean, 99th percentile, max), each pass's total."""
    ms = sorted(1e3 * s for scoring in passes for s in scoring.step_seconds)
    first = passes[0]
    return {"bits_per_char": first.nats / math.log(2) / chars, "tokens": first.ids.numel() - 1,
            "ms_per_token": {"median": statistics.median(ms), "mean": statistics.fmean(ms),
                             "max": ms[-1], "p99": ms[int(0.99 * (len(ms) - 1))]},
            "total_s": spread([sum(scoring.step_seconds) for scoring in passes]),
            "reprefills": first.stats.reprefills, "evictions": first.stats.evictions,
            "positions_processed": first.stats.positions_processed}


def context_policies(model, tokenizer, text, multiple=4, reps=3):
    """Both policies (reprefill only for a model without rotary positions) and the one-pass
    windows, on the first `multiple` contexts of text's tokens; the policies take turns,
    `reps` timed passes each after a warm-up (benchmarks.timing.alternate)."""
    n = multiple * model.config.context_len
    ids = torch.tensor([tokenizer.eot_token] + encode_text(tokenizer, text)[:n],
                       device=model.lm_head.weight.device)
    used = tokenizer.decode(ids[1:].tolist())
    result = {"context_len": model.config.context_len, "tokens": ids.numel() - 1,
              "chars": len(used), "reps": reps, "policies": {}, "skipped": {}}
    runs = {}
    for policy in ("reprefill", "sinks"):
        try:
            check_context_policy(model, policy, 4, None)
            runs[policy] = lambda policy=policy: policy_pass(model, ids, policy)
        except ValueError as e:
            result["skipped"][policy] = str(e)
    with torch.inference_mode():
        passes = alternate(runs, reps)
    for policy, timed in passes.items():
        result["policies"][policy] = policy_summary(timed, len(used))
    with torch.inference_mode():
        result["windows_bits_per_char"] = score(model, tokenizer, used, ids.device)["bits_per_char"]
    return result


def print_context_policies(r, checkpoint):
    print(f"\n## Past the context: {r['tokens']} tokens ({r['chars']:,} characters) of text, "
          f"{r['tokens'] / r['context_len']:.0f}x the {r['context_len']}-token context, fed one "
          f"token per step through the loop ({checkpoint}); per-token times pooled over "
          f"{r['reps']} passes each, in turns; total s median [min-max]")
    print("| policy | bits/char | ms/token median | mean | p99 | max | total s | recomputed | positions processed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, p in r["policies"].items():
        t = p["ms_per_token"]
        recomputed = f"{p['reprefills']} reprefills" if name == "reprefill" else f"{p['evictions']} evictions, none"
        print(f"| {name} | {p['bits_per_char']:.4f} | {t['median']:.2f} | {t['mean']:.2f} | "
              f"{t['p99']:.2f} | {t['max']:.2f} | {fmt_spread(p['total_s'], 2)} | {recomputed} | "
              f"{p['positions_processed']:,} |")
    print(f"| one pass per window (--score) | {r['windows_bits_per_char']:.4f} | | | | | | | |")
    for name, why in r["skipped"].items():
        print(f"{name}: skipped: {why}")


def main():
    p = ArgumentParser(description="Both context policies on a text four times the context: "
                       "cost per token and bits per character (see the module docstring).")
    add_model_args(p)
    p.add_argument("--text", default=str(HELDOUT), help="the text (default: the held-out plays)")
    p.add_argument("--multiple", type=positive_int, default=4,
                   help="contexts of text to feed (default: 4)")
    p.add_argument("--reps", type=positive_int, default=3,
                   help="timed passes of each policy, in turns, after a warm-up (default: 3)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args()
    if args.json is not None:
        check_output_path(args.json, "json")
    model, tokenizer, _ = load_from_args(CACHED_MODELS, args)
    result = context_policies(model, tokenizer, read_text(args.text, "--text"), args.multiple, args.reps)
    publish_result(result, "benchmarks.context_policy",
                   lambda r: print_context_policies(r, args.ckpt or args.hf or "the default checkpoint"), args.json)


if __name__ == "__main__":
    run(main)
