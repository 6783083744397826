"""
What `generate.py --stats` and `--json` report about a run: the numbers (stats_report),
built from the loop's counters (generation.loop.GenerationStats), the command's timings
and the process's peak memory, and the lines --stats prints on stderr (print_stats).
"""

import sys

from kv_quant import cache_formula, dtype_name
from plumbing.memory import format_bytes, peak_rss_bytes


def stats_report(model, args, stats, ids, samples, steps, decoded, seconds, first_token_seconds,
                 proposer=None, start_to_first_token_seconds=None):
    """What a generation run did, as --json's "stats" and --stats print it: tokens in and
    out, time to the first token (from the generation's start, and from the command's:
    loading the model included) and decode speed, forward passes, speculation's counts,
    the process's peak resident memory so far, and the KV cache's bytes by the formula
    beside those allocated (none with --no-cache)."""
    rows = len(samples)
    decode_seconds = seconds - first_token_seconds if first_token_seconds is not None else 0.0
    report = {
        "prompt_tokens": [min(len(i), model.config.context_len) for i in ids],
        "new_tokens": [s.tokens for s in samples],
        "decode_steps": steps,
        "prefill_seconds": None if args.no_cache else stats.prefill_seconds,
        "compile_seconds": stats.compile_seconds if args.compile else None,
        "time_to_first_token_seconds": first_token_seconds,
        "start_to_first_token_seconds": start_to_first_token_seconds,
        "decode_tokens_per_second": decoded / decode_seconds if decoded else None,
        "forward_passes": stats.forward_passes,
        "prefill_passes": stats.prefill_passes,
        "positions_processed": stats.positions_processed,
        "peak_rss_bytes": peak_rss_bytes(),
        "speculative": proposer and {
            "speculate": args.speculate, "proposer": proposer.describe(),
            "proposed": stats.proposed, "accepted": stats.accepted,
            "acceptance_rate": stats.accepted / stats.proposed if stats.proposed else None,
            "verify_passes": stats.verify_passes, "draft_forward_passes": stats.draft_passes},
    }
    if not args.no_cache:  # the naive loop keeps no cache
        kv_dtype = args.kv_dtype or dtype_name(model.lm_head.weight.dtype)
        nbytes, formula = cache_formula(model.config, stats.cache_positions, rows, kv_dtype)
        report.update(
            cache_positions=stats.cache_positions,
            cache_bytes_formula=nbytes,
            cache_bytes_allocated=stats.cache_bytes,
            cache_formula=formula,
            context_policy=args.context_policy,
            reprefills=stats.reprefills,
            evictions=stats.evictions)
    return report


def print_stats(r):
    def fmt(x, unit):
        return "n/a" if x is None else f"{x:.1f} {unit}"
    lines = [
        f"prompt tokens:       {', '.join(map(str, r['prompt_tokens']))}",
        f"new tokens:          {', '.join(map(str, r['new_tokens']))} in {r['decode_steps']} steps",
        f"prefill:             {fmt(r['prefill_seconds'] and r['prefill_seconds'] * 1e3, 'ms')}",
        *([f"compile:             {fmt(r['compile_seconds'], 's')} (before the first token)"]
          if r["compile_seconds"] is not None else []),
        f"time to first token: {fmt(r['time_to_first_token_seconds'] and r['time_to_first_token_seconds'] * 1e3, 'ms')}",
        f"  from the start:    {fmt(r['start_to_first_token_seconds'] and r['start_to_first_token_seconds'] * 1e3, 'ms')}"
        " (the command's: imports and loading the model included)",
        f"decode:              {fmt(r['decode_tokens_per_second'], 'tokens/s')}",
        f"forward passes:      {r['forward_passes']}, {r['positions_processed']} positions processed",
        "peak memory:         " + ("n/a" if r["peak_rss_bytes"] is None else
                                   f"{format_bytes(r['peak_rss_bytes'])} resident (the process's most so far)"),
    ]
    spec = r["speculative"]
    if spec:
        rate = "n/a" if spec["acceptance_rate"] is None else f"{spec['acceptance_rate']:.1%}"
        drafts = spec["draft_forward_passes"]
        lines.append(f"speculative:         {spec['proposer']}, up to {spec['speculate']} per step: "
                     f"{spec['proposed']} proposed, {spec['accepted']} accepted ({rate}) in "
                     f"{spec['verify_passes']} verifying passes"
                     + (f"; {drafts} draft passes" if drafts else ""))
    if "cache_bytes_allocated" in r:
        lines += [f"KV cache:            {r['cache_formula']} = {r['cache_bytes_formula']:,} B by the formula",
                  f"                     {r['cache_bytes_allocated']:,} B allocated "
                  f"(the most its tensors held); past the context: "
                  + (f"{r['reprefills']} reprefills" if r["context_policy"] == "reprefill"
                     else f"{r['evictions']} tokens evicted (sinks)")]
    else:
        lines.append("KV cache:            none (--no-cache)")
    print("\n".join(lines), file=sys.stderr)
