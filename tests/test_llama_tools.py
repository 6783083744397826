"""Everything that works for GPT-2 works for a Llama-style checkpoint of ours (a tiny random
one, GQA 4/2, with the byte tokenizer): generate.py (batches, sampling, stop strings,
--score, --kv-dtype, --quantize, --context-policy), the checkpoint round trip and its
validation, export_hf.py to transformers and back, memory_plan.py's bytes against --stats
and the tensors, the server. (Parity with transformers is test_llama.py's; llama.cpp is
test_llama_cpp.py's; the sinks policy test_sinks.py's.)"""

import json
import math
import re
from dataclasses import replace

import pytest
import torch

from conftest import byte_tokenizer, byte_tokenizer_spec, run_script, spread_out, tiny_model
from generation.loop import generate_tokens
from kv_cache import CACHED_MODELS, KVCacheLlama
from kv_quant import cache_bytes
from llama import LlamaConfig
from plumbing.checkpoint import NAIVE_MODELS, load_model, save_checkpoint
from plumbing.model_config import config_from_dict
from plumbing.script import CheckpointError

CONFIG = LlamaConfig(context_len=48, vocab_size=260, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                     intermediate_size=64, rope_theta=5000.0)


def tiny_llama(config=CONFIG, seed=0):
    return spread_out(tiny_model(config, seed, KVCacheLlama), 0.2)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "tiny-llama.pt"
    save_checkpoint(path, tiny_llama(), byte_tokenizer_spec())
    return path


def generate(ckpt, *args):
    proc = run_script("generate.py", "--ckpt", ckpt, "--json", "--max-new-tokens", "20", *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# ---------------------------------------------------------------------------- checkpoints

def test_checkpoint_round_trip_keeps_the_family(ckpt):
    obj = torch.load(ckpt, weights_only=True)
    assert obj["config"]["family"] == "llama" and "lm_head.weight" in obj["model"]  # untied
    model, tokenizer = load_model(CACHED_MODELS, ckpt, report=lambda _: None)
    assert isinstance(model, KVCacheLlama) and model.config == CONFIG
    idx = torch.randint(256, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(idx)[0], tiny_llama()(idx)[0])
    naive, _ = load_model(NAIVE_MODELS, ckpt, report=lambda _: None)
    assert type(naive).__name__ == "Llama"


def test_tied_checkpoint_stores_the_table_once(tmp_path):
    tied = replace(CONFIG, tie_embeddings=True)
    save_checkpoint(tmp_path / "t.pt", tiny_llama(tied), byte_tokenizer_spec())
    assert "lm_head.weight" not in torch.load(tmp_path / "t.pt", weights_only=True)["model"]
    model, _ = load_model(CACHED_MODELS, tmp_path / "t.pt", report=lambda _: None)
    assert model.lm_head.weight is model.model.embed_tokens.weight


GOOD = {"family": "llama", **vars(CONFIG)}


@pytest.mark.parametrize("change, words", [
    (dict(n_kv_head=3), "n_head \\(4\\) is not a multiple of n_kv_head \\(3\\)"),
    (dict(n_kv_head=0), "n_kv_head must be a positive integer"),
    (dict(intermediate_size=1.5), "intermediate_size must be a positive integer"),
    (dict(head_dim=7), "head_dim must be null or an even positive integer"),
    (dict(rope_theta=float("nan")), "rope_theta must be a finite number above 1"),
    (dict(rope_theta="big"), "rope_theta must be"),
    (dict(norm_eps=0), "norm_eps must be a number in \\(0, 1\\)"),
    (dict(qkv_bias="yes"), "qkv_bias must be true or false"),
    (dict(tie_embeddings=1), "tie_embeddings must be true or false"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4}), "is not supported \\(rope_type one of default, linear, llama3\\)"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8}), "rope_scaling.low_freq_factor must be a positive number"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 1,
                        "original_max_position_embeddings": 16}), "high_freq_factor must be above"),
    (dict(family="mamba"), "family is 'mamba', expected one of gpt, llama"),
    (dict(n_embd=30, head_dim=None), "n_embd \\(30\\) is not divisible by n_head"),
    (dict(context_len=10 ** 12), "would need"),
])
def test_bad_llama_config_field_is_one_line(change, words):
    with pytest.raises(CheckpointError, match=words) as info:
        config_from_dict(GOOD | change, "ckpt.pt")
    assert "\n" not in str(info.value)


def test_a_bare_llama_state_dict_is_refused(tmp_path):
    torch.save(tiny_llama().state_dict(), tmp_path / "bare.pt")
    with pytest.raises(CheckpointError, match="a Llama-family state dict without its config"):
        load_model(CACHED_MODELS, tmp_path / "bare.pt")


# ---------------------------------------------------------------------------- generate.py

def test_batch_rows_equal_the_prompts_alone(ckpt):
    prompts = ["ROMEO:", "JULIET: O Romeo, Romeo!", "KING"]
    batch = generate(ckpt, *sum((["--prompt", p] for p in prompts), []), "--temperature", "0",
                     "--ignore-eot")
    for prompt, text in zip(prompts, batch["texts"]):
        assert generate(ckpt, "--prompt", prompt, "--temperature", "0", "--ignore-eot")["texts"] == [text]


def test_sampling_is_seeded_and_stop_strings_cut(ckpt):
    text = generate(ckpt, "--prompt", "ROMEO:", "--top-k", "20", "--seed", "7", "--ignore-eot")["texts"][0]
    assert [text] == generate(ckpt, "--prompt", "ROMEO:", "--top-k", "20", "--seed", "7", "--ignore-eot")["texts"]
    stop = text[3:5]
    cut = generate(ckpt, "--prompt", "ROMEO:", "--top-k", "20", "--seed", "7", "--ignore-eot", "--stop", stop)
    assert cut["texts"][0] == text[:text.index(stop)]


def test_stats_kv_dtype_quantize_and_the_formula(ckpt):
    """--stats' formula has the model's n_kv_head, and equals the bytes the tensors hold;
    int8 weights and an int4 cache generate."""
    out = generate(ckpt, "--prompt", "ROMEO:", "--temperature", "0", "--ignore-eot")["stats"]
    assert "2 x 2 layers x 2 kv heads" in out["cache_formula"]
    assert out["cache_bytes_formula"] == cache_bytes(CONFIG, out["cache_positions"], 1)
    assert out["cache_bytes_allocated"] == cache_bytes(CONFIG, CONFIG.context_len, 1)
    for flags in (["--kv-dtype", "int4"], ["--quantize", "int8"], ["--quantize", "int4"]):
        assert len(generate(ckpt, "--prompt", "ROMEO:", "--ignore-eot", *flags)["texts"][0]) > 0


def test_score(ckpt, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("ROMEO: But soft, what light through yonder window breaks? " * 6)
    plain = json.loads(run_script("generate.py", "--ckpt", ckpt, "--score", text, "--json").stdout)
    cached = json.loads(run_script("generate.py", "--ckpt", ckpt, "--score", text, "--json",
                                   "--kv-dtype", "float32").stdout)
    assert plain["tokens"] > CONFIG.context_len  # several windows
    assert abs(plain["bits_per_char"] - cached["bits_per_char"]) < 1e-5


def test_context_policies_past_the_context(ckpt, tiny_ckpt):
    n = str(3 * CONFIG.context_len)
    sinks = generate(ckpt, "--prompt", "ROMEO:", "--ignore-eot", "--max-new-tokens", n,
                     "--context-policy", "sinks", "--temperature", "0")["stats"]
    assert sinks["evictions"] > 0 and sinks["reprefills"] == 0 and sinks["context_policy"] == "sinks"
    again = generate(ckpt, "--prompt", "ROMEO:", "--ignore-eot", "--max-new-tokens", n,
                     "--temperature", "0")["stats"]
    assert again["reprefills"] > 0 and again["evictions"] == 0
    proc = run_script("generate.py", "--ckpt", tiny_ckpt, "--prompt", "x", "--context-policy", "sinks")
    assert proc.returncode == 2 and "needs rotary positions" in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("generate.py: error: --context-policy sinks:")


# ---------------------------------------------------------------------------- the other tools

def test_memory_plan_counts_the_kv_heads(ckpt):
    """memory_plan.py's bytes per token for the checkpoint = kv_quant's formula with
    n_kv_head = what --stats reports per position and what a KVCache holds."""
    proc = run_script("memory_plan.py", "--ckpt", ckpt, "--kv-dtypes", "float32")
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| tiny-llama.pt | float32"))
    per_token = cache_bytes(CONFIG, 1, 1)
    assert per_token == 2 * 2 * 2 * 8 * 4  # 2 x layers x kv heads x head_dim x 4 B
    assert f"| {per_token} B |" in row
    model, _ = load_model(CACHED_MODELS, ckpt, report=lambda _: None)
    assert model.new_cache(1).nbytes() == per_token * CONFIG.context_len
    assert re.search(r"\| tiny-llama.pt \| 2 \| 4 / 2 \| 8 \|", proc.stdout)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "llama-tied"])
def test_export_hf_round_trip(tmp_path, kind):
    """export_hf.py writes what transformers loads as LlamaForCausalLM (Qwen2 with qkv
    biases, Qwen3 with q/k norms) with our logits, and --hf reads it back."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = replace(CONFIG, qkv_bias=kind == "qwen2", qk_norm=kind == "qwen3",
                     tie_embeddings=kind == "llama-tied")
    model = tiny_llama(config, seed=4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1)  # biases and norms not trivial
    save_checkpoint(tmp_path / "c.pt", model, byte_tokenizer_spec())
    proc = run_script("export_hf.py", tmp_path / "c.pt", tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(kind, "LlamaForCausalLM")
    idx = torch.randint(256, (2, 30))
    with torch.no_grad():
        ours = model(idx)[0]
        assert (hf(idx).logits - ours).abs().max() < 1e-4
        back, tokenizer = load_model(CACHED_MODELS, tmp_path / "c.pt", report=lambda _: None)
        from plumbing.hf import load_hf_model
        again, hf_tokenizer = load_hf_model(CACHED_MODELS, tmp_path / "hf", report=lambda _: None)
        assert torch.equal(again(idx)[0], ours)
    text = "ROMEO: Café 🎭\n"
    assert hf_tokenizer.encode_ordinary(text) == tokenizer.encode_ordinary(text)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")(text).input_ids == tokenizer.encode_ordinary(text)


def test_the_server_on_a_llama(ckpt):
    """The OpenAI server on the Llama checkpoint gives generate.py's greedy text."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("aiohttp")
    from serving.engine import Engine
    from serving.server import BackgroundServer
    model, tokenizer = load_model(CACHED_MODELS, ckpt, report=lambda _: None)
    engine = Engine(model, tokenizer, tokens_per_block=8, attention="gather")
    engine.start()
    try:
        with BackgroundServer(engine, tokenizer, "tiny-llama") as url:
            client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
            reply = client.completions.create(model="tiny-llama", prompt=["ROMEO:", "JULIET: O"],
                                              max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True})
    finally:
        engine.stop()
    tok = byte_tokenizer()
    for choice, prompt in zip(sorted(reply.choices, key=lambda c: c.index), ["ROMEO:", "JULIET: O"]):
        ids = generate_tokens(model, [tok.encode_ordinary(prompt)], 12, temperature=0,
                              vocab_limit=tok.n_vocab)[0].tolist()
        assert choice.text == tok.decode(ids)


def test_sharded_weights_load_and_a_bad_index_is_one_line(tmp_path):
    """--hf reads weights split into shards by an index (as every large model ships), and
    refuses an index that names a file outside the directory or a tensor in no shard."""
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file, save_file
    from plumbing.hf import load_hf_model
    save_checkpoint(tmp_path / "c.pt", tiny_llama(seed=6), byte_tokenizer_spec())
    assert run_script("export_hf.py", tmp_path / "c.pt", tmp_path / "hf").returncode == 0
    state_dict = load_file(tmp_path / "hf" / "model.safetensors")
    (tmp_path / "hf" / "model.safetensors").unlink()
    names = sorted(state_dict)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: state_dict[k] for k in keys}, tmp_path / "hf" / shard, metadata={"format": "pt"})
    index = tmp_path / "hf" / "model.safetensors.index.json"
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model, _ = load_hf_model(CACHED_MODELS, tmp_path / "hf", report=lambda _: None)
    idx = torch.randint(256, (1, 16))
    with torch.no_grad():
        assert torch.equal(model(idx)[0], tiny_llama(seed=6)(idx)[0])
    for bad, words in [({**weight_map, names[0]: "../c.pt"}, "is not a file name of this directory"),
                       ({**weight_map, "model.extra.weight": shard}, "which is in none of its shards"),
                       ({}, "no weight_map")]:
        index.write_text(json.dumps({"weight_map": bad}))
        with pytest.raises(CheckpointError, match=words):
            load_hf_model(CACHED_MODELS, tmp_path / "hf", report=lambda _: None)


def test_tokenizer_json_problems_are_one_line(tmp_path):
    """What the tokenizer adapter cannot present as our tokenizer interface is refused in one
    line: a decoder of another kind, a special token the vocabulary lacks, a setting of the
    wrong type; and export_gguf.py --hf says it does not write a tokenizer.json to GGUF."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from plumbing.hf import load_hf_model
    save_checkpoint(tmp_path / "c.pt", tiny_llama(), byte_tokenizer_spec())
    assert run_script("export_hf.py", tmp_path / "c.pt", tmp_path / "hf").returncode == 0
    hf = tmp_path / "hf"
    proc = run_script("export_gguf.py", "--hf", hf, tmp_path / "x.gguf")
    assert proc.returncode == 2 and "tokenizer.json is not written to GGUF" in proc.stderr
    good_config = (hf / "tokenizer_config.json").read_text()
    for config, words in [({"eos_token": "<nope>"}, "eos_token '<nope>' is not a token"),
                          ({"add_bos_token": "yes", "bos_token": "<|endoftext|>"}, "add_bos_token must be true or false")]:
        (hf / "tokenizer_config.json").write_text(json.dumps(config))
        with pytest.raises(CheckpointError, match=words):
            load_hf_model(CACHED_MODELS, hf, report=lambda _: None)
    (hf / "tokenizer_config.json").write_text(good_config)
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece.decoder = decoders.WordPiece()
    wordpiece.save(str(hf / "tokenizer.json"))
    with pytest.raises(CheckpointError, match="neither byte-level BPE nor SentencePiece-style BPE"):
        load_hf_model(CACHED_MODELS, hf, report=lambda _: None)


def test_the_bundled_llama_style_model():
    """checkpoints/shakespeare-llama: the same tokenizer as the GPT-2-style model, at most
    half its cache bytes per token (a quarter: 1 key/value head for 4), held-out bits per
    character within the issue's 2.30, computed here as its build computed them (the
    figure the build recorded, 2.0793, to 1e-3: the same fp32 arithmetic in other batches),
    and cached greedy = naive greedy."""
    from plumbing.checkpoint import BUNDLED, BUNDLED_LLAMA
    gpt, gpt_tokenizer = load_model(CACHED_MODELS, BUNDLED, report=lambda _: None)
    model, tokenizer = load_model(CACHED_MODELS, BUNDLED_LLAMA, report=lambda _: None)
    assert isinstance(model, KVCacheLlama) and model.config.n_kv_head < model.config.n_head
    text = "ROMEO:\nBut soft, what light through yonder window breaks?"
    assert tokenizer.encode_ordinary(text) == gpt_tokenizer.encode_ordinary(text)
    assert 2 * cache_bytes(model.config, 1) <= cache_bytes(gpt.config, 1)
    assert model.new_cache(1).nbytes() == 3072 * model.config.context_len
    naive, _ = load_model(NAIVE_MODELS, BUNDLED_LLAMA, report=lambda _: None)
    heldout = (BUNDLED.parent / "heldout.txt").read_text(encoding="utf-8")
    bits_per_char = heldout_bits_per_char(naive, tokenizer, heldout)
    assert bits_per_char <= 2.30
    assert abs(bits_per_char - torch.load(BUNDLED_LLAMA, weights_only=True)["heldout_bits_per_char"]) < 1e-3
    prompt = torch.tensor([tokenizer.encode_ordinary("ROMEO:\n")])
    with torch.no_grad():
        assert torch.equal(model.generate(prompt, 40, temperature=0), naive.generate(prompt, 40, temperature=0))


@torch.no_grad()
def heldout_bits_per_char(model, tokenizer, text):
    """checkpoints/build.py's measure: the text's tokens in non-overlapping windows of the
    context (every token predicted once, from the start of its window), total nats / ln 2 /
    characters."""
    ids = torch.tensor(tokenizer.encode_ordinary(text))
    T = model.config.context_len
    n = (ids.numel() - 1) // T * T  # full windows, in batches; then the short tail
    inputs, targets = ids[:n].view(-1, T), ids[1:n + 1].view(-1, T)  # (windows, T)
    pieces = [(inputs[i:i + 32], targets[i:i + 32]) for i in range(0, n // T, 32)]
    pieces.append((ids[n:-1][None], ids[n + 1:][None]))
    nats = sum(model(x, y)[1].item() * y.numel() for x, y in pieces if y.numel())
    return nats / math.log(2) / len(text)
