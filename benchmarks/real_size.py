"""
What a user with a real checkpoint sees: a random Hugging Face directory of bf16 safetensors
at a real model's shape, run by `generate.py --hf DIR` and by llama.cpp's llama-server, each
a fresh process, in turns: the peak resident memory and the time from start to the first
token, per weight format.

    python -m benchmarks.real_size                  # Llama-3.2-1B shape (2.5 GB of bf16); ~10 min
    python -m benchmarks.real_size --shape 8b --formats int4   # Llama-3-8B shape (16 GB of bf16)
    python -m benchmarks.real_size --formats int4   # some formats only

The directory (and each GGUF file llama.cpp reads) is written once under --cache-dir and
reused by later runs: writing the 8B one takes minutes. The weights are random, in the
model's real shape (the 1B one's context cut to 2048 positions as in llama_speed.py); its
tokenizer is a placeholder of 256 bytes and an end-of-text token (peers.placeholder_tokenizer): both sides are
prompted with "ROMEO:", a handful of tokens, and make one greedy token.

The rows (ours / llama.cpp): fp32 (--dtype float32) / f32, bf16 (--dtype bfloat16; what
--dtype auto picks for a bf16 checkpoint on a CPU with AVX-512 BF16, fp32 on one without) / bf16, int8 (--quantize int8) / q8_0, int4 (--quantize int4)
/ q4_0. llama.cpp's files are made from the same weights by export_gguf.write_gguf (this
project's writer; llama.cpp's converter needs the model's real tokenizer). The figures:
  - peak: the most resident memory the process held, file pages it mapped included (both
    map their weights): ours from /usr/bin/time -v (the command exits after its token),
    llama-server's from its VmHWM in /proc once it has answered (a server does not exit);
  - first token: seconds from starting the process to its first token, taken here: ours
    when its first output reaches the pipe (the prompt and the token are written together),
    llama-server's when its answer to a /completion of one token arrives (asked every 50 ms
    from the start; it answers 503 while it loads);
  - the bound the issue sets ours: 1.2 x (weights in the run's format + the KV cache) + 300 MB
    (plumbing/memory.weight_bytes; the cache as generate.py sizes it, CACHE_COLUMNS_STEP columns).
"""

import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from plumbing.script import UserError, begin, run

if __name__ == "__main__":  # run as a command; importing this file changes nothing
    begin()  # before torch: Ctrl-C during the slow imports ends quietly (plumbing/script.py)

import tiktoken  # noqa: E402
import torch  # noqa: E402

from benchmarks.llama_cpp_build import build_folder, cpu_flags  # noqa: E402
from benchmarks.llama_speed import SHAPES as LLAMA_SPEED_SHAPES  # noqa: E402
from benchmarks.peers import placeholder_tokenizer  # noqa: E402
from benchmarks.server_peers import free_port  # noqa: E402
from benchmarks.timing import alternate  # noqa: E402
from export_hf import hf_llama_config, write_tokenizer  # noqa: E402
from generation.loop import CACHE_COLUMNS_STEP  # noqa: E402
from kv_quant import cache_bytes  # noqa: E402
from llama import Llama, LlamaConfig  # noqa: E402
from plumbing.checkpoint import NAIVE_MODELS, ROOT  # noqa: E402
from plumbing.cli import ArgumentParser, positive_int  # noqa: E402
from plumbing.memory import format_bytes, weight_bytes  # noqa: E402
from plumbing.outputs import check_output_path, new_directory, publish_result, write_atomically  # noqa: E402

SHAPES = {
    "1b": LLAMA_SPEED_SHAPES["llama-3.2-1b"],
    "8b": LlamaConfig(context_len=8192, vocab_size=128256, n_layer=32, n_head=32, n_kv_head=8,
                      n_embd=4096, intermediate_size=14336, rope_theta=500000.0, tie_embeddings=False),
    "tiny": LLAMA_SPEED_SHAPES["tiny"],  # seconds: a check of the benchmark itself
}
# format: (our flags, the weights' format for memory.weight_bytes, llama.cpp's GGUF type)
FORMATS = {"fp32": (["--dtype", "float32"], "float32", "f32"), "bf16": (["--dtype", "bfloat16"], "bfloat16", "bf16"),
           "int8": (["--quantize", "int8"], "int8", "q8_0"), "int4": (["--quantize", "int4"], "int4", "q4_0")}
PROMPT = "ROMEO:"
DEFAULT_CACHE = Path.home() / ".cache" / "kvcache-gpt" / "real-size"
LLAMA_CPP_BUILDS = Path.home() / ".cache" / "kvcache-gpt" / "llama-cpp"  # benchmarks/llama_cpp_build.py's
POLL_SECONDS = 0.05
READY_SECONDS = 900  # llama-server loading an 8B file on a busy machine


# ---------------------------------------------------------------------------- the files

def write_random_hf_dir(config, out):
    """A Hugging Face Llama directory of random bf16 weights in config's shape: config.json,
    the placeholder tokenizer as tokenizer.json, and one safetensors shard per block (and
    one for the embedding, the final norm and an untied head) with the index naming them,
    so that no more than one block's tensors are ever in memory here."""
    from safetensors.torch import save_file
    with torch.device("meta"):  # the names and shapes, without memory
        shapes = {k: v.shape for k, v in Llama(config).state_dict().items()
                  if not (k == "lm_head.weight" and config.tie_embeddings)}
    shards = {}  # shard file -> its tensor names
    for name in shapes:
        block = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        shards.setdefault(f"model-{block}.safetensors", []).append(name)
    generator = torch.Generator().manual_seed(0)
    with new_directory(out) as tmp:
        hf = {**hf_llama_config(config, eot=placeholder_with_end().eot_token), "torch_dtype": "bfloat16"}
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        write_tokenizer(placeholder_with_end(), tmp, config.context_len, family="llama")
        for file, names in shards.items():
            tensors = {n: random_weight(shapes[n], generator) for n in names}
            save_file(tensors, tmp / file, metadata={"format": "pt"})
        weight_map = {n: file for file, names in shards.items() for n in names}
        # transformers (5.x) reads metadata.total_size too: without it the index is refused
        total_size = sum(shapes[n].numel() * 2 for n in weight_map)  # bf16
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index))


def placeholder_with_end():
    """peers.placeholder_tokenizer with an end-of-text token, which a --hf directory's
    tokenizer must have (it starts an empty prompt and ends a text)."""
    base = placeholder_tokenizer()
    return tiktoken.Encoding(name="placeholder", pat_str=base._pat_str, mergeable_ranks=base._mergeable_ranks,
                             special_tokens={"<|endoftext|>": base.n_vocab})


def random_weight(shape, generator):
    """bf16 weights as an initialisation would give them: matrices N(0, 0.02), norms ones."""
    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)


def write_peer_gguf(hf_dir, out, outtype):
    """llama.cpp's file of the directory's weights in outtype (export_gguf.write_gguf from
    the model loaded in bf16, its file's pages, widened to fp32 a tensor at a time: exact).
    Run in a process of its own (gguf_for), which gives its memory back when it ends."""
    from export_gguf import write_gguf
    from plumbing.hf import load_hf_model
    model, _ = load_hf_model(NAIVE_MODELS, hf_dir, dtype=torch.bfloat16, report=lambda line: None)
    write_atomically(out, lambda tmp: write_gguf(tmp, model, placeholder_with_end(), outtype, out.stem))


def gguf_for(folder, hf_dir, outtype):
    """folder/<outtype>.gguf, written the first time it is asked for."""
    out = folder / f"{outtype}.gguf"
    if not out.is_file():
        print(f"writing {out} (once) ...", file=sys.stderr, flush=True)
        process = multiprocessing.get_context("spawn").Process(target=write_peer_gguf,
                                                               args=(hf_dir, out, outtype))
        process.start()
        process.join()
        if process.exitcode != 0 or not out.is_file():
            raise UserError(f"writing {out} failed (exit status {process.exitcode})")
    return out


# ---------------------------------------------------------------------------- the contestants

def run_ours(hf_dir, flags, log):
    """(seconds from start to the first token, peak resident bytes) of one generate.py run."""
    with tempfile.NamedTemporaryFile(mode="r", suffix=".time") as timing:
        command = ["/usr/bin/time", "-v", "-o", timing.name, sys.executable, str(ROOT / "generate.py"),
                   "--hf", str(hf_dir), "--prompt", PROMPT, "--max-new-tokens", "1", "--temperature", "0",
                   "--ignore-eot", *flags]
        t0 = time.perf_counter()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, cwd=ROOT)
        first = process.stdout.read(1)  # the prompt and the first token arrive together
        first_token = time.perf_counter() - t0
        process.stdout.read()
        if process.wait() != 0 or not first:
            raise UserError(f"generate.py {' '.join(flags)} failed (status {process.returncode}); "
                            f"see {log.name}")
        return first_token, maximum_resident_bytes(timing.read())


def maximum_resident_bytes(time_report):
    """/usr/bin/time -v's 'Maximum resident set size (kbytes): N', in bytes."""
    for line in time_report.splitlines():
        if "Maximum resident set size" in line:
            return int(line.rsplit(":", 1)[1]) * 1024
    raise UserError(f"/usr/bin/time -v reported no maximum resident set size: {time_report[-200:]!r}")


def run_llama_server(binary, gguf, log, threads):
    """(seconds from start to the first token, peak resident bytes) of one llama-server: started,
    asked for one token until it answers, its VmHWM read, stopped."""
    port = free_port()
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", "1",
               "-c", str(CACHE_COLUMNS_STEP), "-t", str(threads), "-tb", str(threads), "--no-webui"]
    body = json.dumps({"prompt": PROMPT, "n_predict": 1, "temperature": 0}).encode()
    t0 = time.perf_counter()
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            if process.poll() is not None:
                raise UserError(f"llama-server exited with status {process.returncode}; see {log.name}")
            if time.perf_counter() - t0 > READY_SECONDS:
                raise UserError(f"llama-server gave no token within {READY_SECONDS} s; see {log.name}")
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body,
                                                 headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=READY_SECONDS) as response:
                    response.read()
                break
            except (urllib.error.URLError, ConnectionError):  # not listening yet, or 503 while loading
                time.sleep(POLL_SECONDS)
        first_token = time.perf_counter() - t0
        return first_token, vm_hwm_bytes(process.pid)
    finally:
        process.terminate()
        process.wait(timeout=60)


def vm_hwm_bytes(pid):
    """A live process's peak resident set so far (VmHWM of /proc/PID/status), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise UserError(f"/proc/{pid}/status has no VmHWM")


def llama_server_binary(path):
    """(llama-server's path, None) or (None, the one line saying why llama.cpp is skipped)."""
    if path is None:
        folder, _ = build_folder(LLAMA_CPP_BUILDS, "tools", cpu_flags())
        path = folder / "llama-server"
    if not Path(path).is_file() or not os.access(path, os.X_OK):
        return None, (f"llama.cpp skipped: no llama-server at {path} (build it: python -m "
                      f"benchmarks.llama_cpp_build tools {LLAMA_CPP_BUILDS})")
    return Path(path), None


# ---------------------------------------------------------------------------- the run

def real_size(args):
    config = SHAPES[args.shape]
    folder = Path(args.cache_dir).expanduser() / args.shape
    hf_dir = folder / "hf"
    if not (hf_dir / "config.json").is_file():
        print(f"writing {hf_dir} (once) ...", file=sys.stderr, flush=True)
        write_random_hf_dir(config, hf_dir)
    binary, llama_note = llama_server_binary(args.llama_server)
    threads = torch.get_num_threads()
    runs = {}
    with open(folder / "runs.log", "w") as log:
        for name in args.formats:
            flags, _, outtype = FORMATS[name]
            runs[f"ours {name}"] = said(f"ours {name}", lambda flags=flags: run_ours(hf_dir, flags, log))
            if binary is not None:
                gguf = gguf_for(folder, hf_dir, outtype)
                runs[f"llama.cpp {outtype}"] = said(f"llama.cpp {outtype}",
                                                    lambda gguf=gguf: run_llama_server(binary, gguf, log, threads))
        measured = alternate(runs, args.reps)
    rows = []
    for name in args.formats:
        flags, weights_format, outtype = FORMATS[name]
        dtype = "bfloat16" if name == "bf16" else "float32"  # the run's dtype, and its cache's
        planned = weight_bytes(config, weights_format) + cache_bytes(config, CACHE_COLUMNS_STEP, 1, dtype)
        row = {"format": name, "flags": " ".join(flags) or "(default)", "planned_bytes": planned,
               "bound_bytes": 1.2 * planned + 300e6, "ours": summary(measured[f"ours {name}"])}
        if binary is not None:
            row["llama_cpp"] = {"outtype": outtype, **summary(measured[f"llama.cpp {outtype}"])}
        rows.append(row)
    return {"shape": args.shape, "config": vars(config), "reps": args.reps, "threads": threads,
            "cpu": cpu_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "llama_cpp_note": llama_note, "rows": rows,
            "hf_dir_bytes": sum(f.stat().st_size for f in hf_dir.iterdir())}


def said(name, run_once):
    """run_once, its figures said on stderr as each run ends: a run of this benchmark is long."""
    def run_and_say():
        first_token, peak = run_once()
        print(f"{name}: first token {first_token:.1f} s, peak {format_bytes(peak)}", file=sys.stderr, flush=True)
        return first_token, peak
    return run_and_say


def summary(results):
    """The best first-token time of the runs (a shared machine only ever slows a run) and the
    highest peak (what the machine must be able to give)."""
    return {"first_token_s": min(t for t, _ in results), "peak_bytes": max(p for _, p in results),
            "runs": [{"first_token_s": t, "peak_bytes": p} for t, p in results]}


def cpu_name():
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def print_real_size(d):
    print(f"\n## Real size: a random {d['shape']}-shaped Hugging Face directory "
          f"({format_bytes(d['hf_dir_bytes'])} of bf16 safetensors), start to first token and peak "
          f"memory, fresh processes in turns")
    print(f"{d['command']}; {d['cpu']} ({d['cpu_capability']}), {d['threads']} threads, torch "
          f"{d['torch']}; best first token and highest peak of {d['reps']} runs after a warm-up each")
    if d["llama_cpp_note"]:
        print(d["llama_cpp_note"])
    llama = any("llama_cpp" in r for r in d["rows"])
    print("| format | ours: flags | weights + KV | bound 1.2x + 300 MB | ours peak | ours first token |"
          + (" llama.cpp | its peak | its first token | peak ours / its | first token ours / its |"
             if llama else ""))
    print("|---|---|---|---|---|---|" + ("---|---|---|---|---|" if llama else ""))
    for r in d["rows"]:
        ours = r["ours"]
        line = (f"| {r['format']} | {r['flags']} | {format_bytes(r['planned_bytes'])} | "
                f"{format_bytes(r['bound_bytes'])} | {format_bytes(ours['peak_bytes'])} | "
                f"{ours['first_token_s']:.1f} s |")
        if "llama_cpp" in r:
            theirs = r["llama_cpp"]
            line += (f" {theirs['outtype']} | {format_bytes(theirs['peak_bytes'])} | "
                     f"{theirs['first_token_s']:.1f} s | {ours['peak_bytes'] / theirs['peak_bytes']:.2f}x | "
                     f"{ours['first_token_s'] / theirs['first_token_s']:.2f}x |")
        print(line)


def format_list(text):
    names = [n.strip() for n in text.split(",") if n.strip()]
    wrong = [n for n in names if n not in FORMATS]
    if wrong or not names:
        raise ValueError(f"choose among {', '.join(FORMATS)}, got {text!r}")
    return names


def main():
    p = ArgumentParser(description="Peak memory and time to the first token of a real-size random "
                       "bf16 Hugging Face directory, ours beside llama.cpp (see the module docstring).")
    p.add_argument("--shape", choices=list(SHAPES), default="1b",
                   help="1b: Llama-3.2-1B (2.5 GB of bf16); 8b: Llama-3-8B (16 GB); tiny: a check "
                   "(default: 1b)")
    p.add_argument("--formats", type=format_list, default=list(FORMATS),
                   help=f"comma-separated, among {', '.join(FORMATS)} (default: all)")
    p.add_argument("--reps", type=positive_int, default=2, help="runs of each after a warm-up (default: 2)")
    p.add_argument("--cache-dir", default=str(DEFAULT_CACHE),
                   help=f"where the directory and the GGUF files are kept between runs (default: {DEFAULT_CACHE})")
    p.add_argument("--llama-server", metavar="PATH", help="llama-server to compare with (default: "
                   f"the build of benchmarks.llama_cpp_build under {LLAMA_CPP_BUILDS})")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args()
    if args.json is not None:
        check_output_path(args.json, "json")
    if not Path("/usr/bin/time").is_file():
        raise UserError("this benchmark reads peak memory from /usr/bin/time -v: apt-get install time")
    publish_result(real_size(args), "benchmarks.real_size", print_real_size, args.json)


if __name__ == "__main__":
    run(main)
