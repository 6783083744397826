"""
The benchmark's results as Markdown tables on stdout, one printer per section, and the
cost curves and batch speeds as a PNG.
"""

from benchmarks.cache_cost import KINDS
from benchmarks.speculative import print_section as print_speculative
from plumbing.outputs import MARK, write_atomically


def fmt_spread(s, digits=1):
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def print_report(r):
    print(f"\n# kvcache-gpt benchmark, {r['date']}, {r['machine']}, torch {r['torch']}, "
          f"{r['device']}, batch 1, greedy; median [min-max] of {r['reps']} runs")
    print_seed_demo(r["seed_demo"], r["checkpoint"])
    print_cost_curves(r["cost_curves"])
    print_floor(r["floor"], r["peak_rss_mb"])
    print_decode_speed(r["decode_speed"])
    if "kernels" in r:
        print_kernels(r["kernels"], r["floor"])
    print_batches(r["batch"])
    print_transformers_peer(r)
    print_kv_dtypes(r["kv_dtypes"])
    print_quantized_peer(r["quantized_peer"])
    if "speculative" in r:
        print_speculative(r["speculative"])


def print_seed_demo(d, checkpoint):
    print(f"\n## The seed's demo: {d['tokens']} new tokens on {checkpoint}")
    print(f"without cache {fmt_spread(d['naive_tok_s'])} tok/s | with cache "
          f"{fmt_spread(d['cached_tok_s'])} tok/s | speedup {d['speedup']:.1f}x")


def print_cost_curves(c):
    print(f"\n## Cost vs generated length ({c['shape']} shape, random weights, "
          f"{c['prompt_tokens']}-token prompt)")
    print("| new tokens | naive total s | torch.cat total s | prealloc total s | "
          "naive ms/token | torch.cat ms/token | prealloc ms/token | prealloc vs naive |")
    print("|---|---|---|---|---|---|---|---|")
    cv = c["curves"]
    for n in c["lengths"]:
        nt = cv["naive"]["total_s"][n]
        mark = "" if not nt["estimated"] else " (est.)"
        print(f"| {n} | {nt['median']:.2f}{mark} | {cv['cat']['total_s'][n]['median']:.2f} | "
              f"{cv['prealloc']['total_s'][n]['median']:.2f} | {cv['naive']['latency_ms'][n]:.1f} | "
              f"{cv['cat']['latency_ms'][n]:.1f} | {cv['prealloc']['latency_ms'][n]:.1f} | "
              f"{nt['median'] / cv['prealloc']['total_s'][n]['median']:.1f}x |")
    for n, nt in cv["naive"]["total_s"].items():
        if not nt["estimated"]:
            print(f"(naive at {n} tokens measured: {nt['median']:.2f} s; the estimate gave "
                  f"{nt['estimate_was']:.2f} s)")
    first, last = c["lengths"][0], c["lengths"][-1]
    p = c["prompt_tokens"]
    print(f"per-token latency at position {p + last} vs {p + first}: prealloc "
          f"{cv['prealloc']['latency_ms'][last] / cv['prealloc']['latency_ms'][first]:.2f}x, "
          f"torch.cat {cv['cat']['latency_ms'][last] / cv['cat']['latency_ms'][first]:.2f}x, "
          f"naive {cv['naive']['latency_ms'][last] / cv['naive']['latency_ms'][first]:.2f}x")


def print_floor(f, peak_rss_mb):
    print(f"\n## The floor ({f['shape']} shape): every weight read once per token")
    print(f"weights {f['weight_bytes'] / 1e6:.0f} MB | matrix-vector {f['matvec_ms']:.1f} ms "
          f"({f['matvec_GBps']:.1f} GB/s; with row-major weights {f['matvec_row_major_ms']:.1f} ms) | "
          f"plain read {f['read_ms']:.1f} ms ({f['read_GBps']:.1f} GB/s)")
    print(f"our decode (ours fp32 eager in the decode-speed table) {f['decode_ms_per_token']:.1f} "
          f"ms/token = {f['decode_over_floor']:.2f}x the matrix-vector floor "
          f"({f['decode_over_row_major_floor']:.2f}x the row-major one)")
    print(f"KV cache for the full context: formula {f['cache_bytes_formula']:,} B, "
          f"allocated {f['cache_bytes_real']:,} B | peak RSS {peak_rss_mb:.0f} MB")


def agreement(same, tokens):
    """"k/n" greedy tokens as ours fp32 eager, or "-" where that reference did not run."""
    return "-" if same is None else f"{same}/{tokens}"


def print_decode_speed(d):
    print(f"\n## Decode speed: ours and llama.cpp on identical weights, {d['prompt_tokens']}-token "
          f"prompt, greedy, {d['threads']} threads ({d['cpu_capability']}), in turns; tok/s of the "
          "whole generation")
    for note in (d["compile_note"], d["llama_cpp_note"]):
        if note:
            print(note)
    for t in d["models"]:
        print(f"{t['model']}: {t['params_m']:.2f}M parameters, {t['tokens']} new tokens, int4 in groups "
              f"of {t['int4_group_size']}, floor = bytes read per token / {t['read_GBps']:.1f} GB/s "
              "(plain read of its fp32 weights)")
        for name, why in t["skipped"].items():
            print(f"{t['model']}, {name}: skipped: {why}")
    baseline = any("vs_llama_cpp_f32" in row for t in d["models"] for row in t["rows"].values())
    print("| model | contestant | setup s | MB read per token | floor ms | tok/s | ms/token | x floor |"
          + (" vs llama.cpp f32 |" if baseline else "") + " greedy tokens as ours fp32 eager |")
    print("|---|---|---|---|---|---|---|---|" + ("---|" if baseline else "") + "---|")
    for t in d["models"]:
        for name, row in t["rows"].items():
            ratio = f" {row['vs_llama_cpp_f32']:.2f}x |" if baseline else ""
            print(f"| {t['model']} | {name} | {row['setup_s']:.1f} | {row['weight_bytes'] / 1e6:.1f} | "
                  f"{row['floor_ms']:.2f} | {fmt_spread(row['tok_s'])} | "
                  f"{1e3 / row['tok_s']['median']:.2f} | {row['over_floor']:.1f}x |{ratio} "
                  f"{agreement(row['greedy_leading_same'], t['tokens'])} |")
    for t in d["models"]:
        for pair, ratio in t.get("pairs", {}).items():
            print(f"{t['model']}: {pair} = {ratio:.2f}x")


def print_kernels(k, floor):
    print(f"\n## Weight-only quantization (weight_quant.py): the kernels ({k['shape']} shape, every "
          "Linear once on one vector)")
    print("| weights | MB | ms |\n|---|---|---|")
    for label, v in k["variants"].items():
        print(f"| {label} | {v['weight_bytes'] / 1e6:.1f} | {v['ms']:.1f} |")
    if floor["shape"] == k["shape"]:
        print(f"| plain read of the fp32 bytes (the floor section) | {floor['weight_bytes'] / 1e6:.1f} | "
              f"{floor['read_ms']:.1f} |")


def print_batches(batch):
    print("\n## Batches of different prompts (lengths 8-64): aggregate decode speed")
    print("| model | prompts | tok/s, all rows | vs batch 1 | ms per step | matmul GFLOP/s (of peak) "
          "| KV cache by the formula | allocated |")
    print("|---|---|---|---|---|---|---|---|")
    for t in batch:
        for b, row in t["sizes"].items():
            print(f"| {t['model']} | {b} | {fmt_spread(row['tok_s'])} | {row['vs_batch_1']:.1f}x | "
                  f"{fmt_spread(row['step_ms'])} | {row['gflop_s']:.1f} ({row['of_peak']:.0%}) | "
                  f"{row['cache_bytes_formula'] / 2**20:.1f} MiB | {row['cache_bytes_allocated'] / 2**20:.1f} MiB |")
    for t in batch:
        print(f"{t['model']}: peak = a {t['peak_size']}-square fp32 matmul, {t['peak_gflop_s']:.1f} GFLOP/s")


def print_transformers_peer(r):
    print("\n## Peer: transformers GPT2LMHeadModel.generate(), identical weights")
    if not r["peer"]:
        print(r["peer_note"])
    for p in r["peer"] or []:
        ops = p["operations_per_token"]
        static = (fmt_spread(p["hf_static_tok_s"]) if "hf_static_tok_s" in p
                  else p.get("hf_static_error", "n/a"))
        print(f"{p['shape']}: ours {fmt_spread(p['ours_tok_s'])} tok/s | HF {fmt_spread(p['hf_tok_s'])} "
              f"tok/s | HF static cache {static} | ours / HF {p['speedup_vs_hf']:.2f}x | "
              f"greedy tokens match: {p['greedy_tokens_match']} | torch operations a token: "
              f"ours {ops['ours']:.0f}, HF {ops['hf']:.0f}")


def print_kv_dtypes(k):
    sizes = list(next(iter(k["dtypes"].values())))
    print(f"\n## Cache dtypes: decode at position {k['position']} ({k['shape']} shape), ms per step "
          "(reading the cache back: dequantize or cast, all layers)")
    print("| kv dtype | " + " | ".join(f"batch {b}: ms/step | read back | cache allocated" for b in sizes) + " |")
    print("|---|" + "---|---|---|" * len(sizes))
    for kv, rows in k["dtypes"].items():
        print(f"| {kv} | " + " | ".join(
            f"{fmt_spread(rows[b]['step_ms'])} | {rows[b]['read_back_ms']['median']:.1f} | "
            f"{rows[b]['cache_bytes'] / 2**20:.1f} MiB" for b in sizes) + " |")


def print_quantized_peer(q):
    print("\n## Quantized caches, ours and transformers' (QuantizedCache, quanto), identical weights")
    if "note" in q:
        print(q["note"])
        return
    print(f"bits/char on the first {q['chars']:,} characters of the held-out text ({q['tokens']:,} "
          f"tokens), ms per decode step at position {q['position']}, batch 1")
    print("| cache | bits/char | ms/step |")
    print("|---|---|---|")
    for name, c in q["caches"].items():
        print(f"| {name} | {c['bits_per_char']:.4f} | {fmt_spread(c['step_ms'])} |")


# ---------------------------------------------------------------------------- the plot

def plot(r, path, plt):
    c = r["cost_curves"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4))
    for kind, label in KINDS.items():
        cv = c["curves"][kind]
        ax1.plot(c["lengths"], [cv["total_s"][n]["median"] for n in c["lengths"]], "o-", label=label)
        ax2.plot(c["lengths"], [cv["latency_ms"][n] for n in c["lengths"]], "o-", label=label)
    ax1.set(xlabel="new tokens", ylabel="total seconds", title="Total time (naive: quadratic)")
    ax2.set(xlabel="new tokens", ylabel="ms per token", title="Per-token latency", yscale="log")
    ax1.legend(fontsize=8)
    for t in r["batch"]:
        sizes = list(t["sizes"])
        ax3.plot(sizes, [t["sizes"][b]["tok_s"]["median"] for b in sizes], "o-", label=t["model"])
    ax3.set(xlabel="different prompts decoded together", ylabel="tokens/s, all rows",
            title="Batching: aggregate decode speed", xscale="log", yscale="log")
    ax3.set_xticks([b for t in r["batch"][:1] for b in t["sizes"]], minor=False)
    ax3.set_xticklabels([str(b) for t in r["batch"][:1] for b in t["sizes"]])
    ax3.legend(fontsize=8)
    fig.suptitle(f"{c['shape']} shape, {r['machine']}, {r['date']}")
    fig.tight_layout()
    # the Software text chunk marks the PNG as ours (cli.check_output_path)
    write_atomically(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110,
                                                   metadata={"Software": f"{MARK} benchmark.py"}))


def print_prefill(p):
    """benchmarks/llama_speed.py's prefill table, and llama-bench's decode beside ours'."""
    peaks = p["peak_GFLOPs"]
    print(f"\n## Prefill: prompt tokens/s of one pass, ours beside llama-bench -p; roofline: "
          f"torch's matmul here {peaks['fp32']:.0f} GFLOP/s in fp32, {peaks['bf16']:.0f} in bf16; "
          "each row against the peak of the dtype its products run in (the quantized forms: bf16 "
          "where the CPU has bf16 arithmetic, else fp32)")
    if p["llama_bench_note"]:
        print(p["llama_bench_note"])
    print("| ours | prompt tokens | tok/s | GFLOP/s | x of its peak | llama-bench | its pp tok/s "
          "| ours / llama-bench |")
    print("|---|---|---|---|---|---|---|---|")
    for form, row in p["ours"].items():
        theirs = p["llama_bench"].get(f"llama.cpp {p['pairs'][form]}", {}).get("pp", {})
        for T in p["lengths"]:
            peak = peaks["bf16" if row["multiplies_in"] == "bfloat16" else "fp32"]
            pp = theirs.get(T)
            versus = f"{row['tok_s'][T]['median'] / pp:.2f}x" if pp else "-"
            print(f"| {form} | {T} | {fmt_spread(row['tok_s'][T])} | {row['GFLOPs'][T]:.1f} | "
                  f"{row['GFLOPs'][T] / peak:.2f} | {p['pairs'][form]} | {pp or 0:.1f} | {versus} |")
    if p["llama_bench"]:
        print("| llama-bench | tg tok/s | MB read per token | floor ms | x floor | ours' decode tok/s "
              "(after the prefill), same format | ours / llama-bench tg |")
        print("|---|---|---|---|---|---|---|")
        for name, row in p["llama_bench"].items():
            for ours in p.get("ours_decode", {}).get(name) or [None]:  # each of ours in its format
                versus = (f"{ours[0]}: {fmt_spread(ours[1])} | {ours[1]['median'] / row['tg']:.2f}x" if ours
                          else "- | -")
                print(f"| {name} | {row['tg']:.1f} | {row['weight_bytes'] / 1e6:.1f} | {row['floor_ms']:.2f} | "
                      f"{1e3 / row['tg'] / row['floor_ms']:.1f}x | {versus} |")
