"""Cross-implementation parity with Hugging Face transformers' GPT2LMHeadModel.

Every HF model here is random and tiny, built and saved locally: nothing is downloaded.

Tolerance: 1e-4 absolute on fp32 logits (of magnitude ~1-5 here). The two implementations
do the same arithmetic in different kernels and orders (Conv1D's addmm vs F.linear, HF's
eager/sdpa attention vs ours, different cache layouts), so rounding differs by a few fp32
ulps per op, ~1e-6 after a few layers (measured values are printed with -s). A real mapping
error (an untransposed weight, a wrong head split, a position off by one, a GELU variant)
moves logits by O(0.1..1), so 1e-4 still catches each one with 100x headroom.
"""

import inspect
import json
import subprocess
import sys

import pytest
import torch

from plumbing.checkpoint import BUNDLED, load_model, save_checkpoint
from conftest import ROOT, TINY_CONFIGS, byte_tokenizer_spec, run_script, tiny_model
from plumbing.script import CheckpointError, UserError
from export_hf import export
from plumbing.hf import load_hf_model
from generation.loop import generate_tokens
from kv_cache import CACHED_MODELS, KVCacheGPT

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()  # no warnings about random tiny configs
transformers.logging.disable_progress_bar()
from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast  # noqa: E402

ATOL = 1e-4
GEN_TOKENS = 100

# Several shapes, both weight formats, both HF attention kernels, both tanh-GELU names,
# head counts that are not powers of two (3, 6).
HF_CONFIGS = {
    "48d-3heads-safetensors-sdpa": dict(n_embd=48, n_head=3, n_layer=2, fmt="safetensors", attn="sdpa"),
    "96d-6heads-bin-eager": dict(n_embd=96, n_head=6, n_layer=3, fmt="bin", attn="eager"),
    "64d-4heads-tanh-upcast": dict(n_embd=64, n_head=4, n_layer=2, fmt="safetensors", attn="eager",
                                   activation_function="gelu_pytorch_tanh", reorder_and_upcast_attn=True),
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: one thread per op beats two fighting over 2 cores (3-10x here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def quiet(*_):
    pass


# ---------------------------------------------------------------------------- a tiny GPT-2 tokenizer

def gpt2_byte_chars():
    """GPT-2's byte -> character table written out from its definition (independently of
    plumbing.hf_tokenizer.byte_to_char): the printable ranges keep their characters, in this
    order, and the other 68 bytes become chr(256), chr(257), ... in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {b: chr(b) for b in kept} | {b: chr(256 + n) for n, b in enumerate(moved)}, kept + moved


MERGES = [("h", "e"), ("Ġ", "t"), ("Ġt", "he"), ("n", "d"), ("Ġ", "a"), ("Ġa", "nd")]  # ids 256..261
EOT_ID = 262


def write_tiny_tokenizer(path):
    """vocab.json + merges.txt in GPT-2's format: 256 byte tokens (in GPT-2's id order),
    six merges, <|endoftext|>."""
    chars, order = gpt2_byte_chars()
    vocab = {chars[b]: i for i, b in enumerate(order)}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = EOT_ID
    (path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (path / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES),
                                     encoding="utf-8")


# ---------------------------------------------------------------------------- HF models on disk

def make_hf_dir(path, n_embd, n_head, n_layer, fmt, attn, n_positions=160, **extra):
    """A random GPT2LMHeadModel saved to `path` with the tiny tokenizer. fmt 'bin' writes
    the layout of OpenAI's original pytorch_model.bin instead: no 'transformer.' prefix,
    no lm_head, and the causal-mask buffers attn.bias / attn.masked_bias."""
    torch.manual_seed(n_embd)
    config = GPT2Config(vocab_size=300, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                        n_head=n_head, bos_token_id=EOT_ID, eos_token_id=EOT_ID,
                        initializer_range=0.1,  # larger than 0.02: logits spread out, no argmax near-ties
                        attn_implementation=attn, **extra)
    hf = GPT2LMHeadModel(config).eval()
    hf.save_pretrained(path)
    if fmt == "bin":  # newer transformers always write safetensors, so write the old form here
        (path / "model.safetensors").unlink()
        sd = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
        mask = torch.ones(n_positions, n_positions).tril().view(1, 1, n_positions, n_positions)
        for i in range(n_layer):
            sd[f"h.{i}.attn.bias"] = mask
            sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
        torch.save(sd, path / "pytorch_model.bin")
    write_tiny_tokenizer(path)
    return hf


@pytest.fixture(params=list(HF_CONFIGS), scope="module")
def hf_pair(request, tmp_path_factory):
    """(HF model, our KVCacheGPT loaded from the same directory, name)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf_dir(path, **HF_CONFIGS[request.param])
    ours, _ = load_hf_model(CACHED_MODELS, path, report=quiet)
    return hf, ours, request.param


def hf_greedy(hf, prompt):
    """GEN_TOKENS greedy tokens from HF. eos_token_id=None: HF must not stop at (or, with
    min_new_tokens, suppress) end-of-text, which ours does not treat specially either."""
    return hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                       max_new_tokens=GEN_TOKENS, eos_token_id=None, pad_token_id=0)


def hf_step(hf, chunk, past):
    """One cached HF forward: (logits, cache). transformers 5.x renamed past_key_values
    to cache; either name works here."""
    key = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    out = hf(input_ids=chunk, use_cache=True, **{key: past})
    return out.logits, out[key]


def report(what, name, diff):
    print(f"\n  max |logit diff| {what:28s} {name:32s} {diff:.2e}")


# ---------------------------------------------------------------------------- import parity

@torch.no_grad()
def test_logits_match_hf(hf_pair):
    hf, ours, name = hf_pair
    idx = torch.randint(263, (2, 40), generator=torch.Generator().manual_seed(0))
    diff = (ours(idx)[0] - hf(idx).logits).abs().max().item()
    report("full forward", name, diff)
    assert diff < ATOL


@torch.no_grad()
def test_greedy_generation_matches_hf(hf_pair):
    hf, ours, name = hf_pair
    prompt = torch.randint(263, (1, 8), generator=torch.Generator().manual_seed(1))
    mine = ours.generate(prompt, GEN_TOKENS, temperature=0)
    theirs = hf_greedy(hf, prompt)
    assert mine.shape == theirs.shape == (1, 8 + GEN_TOKENS)
    assert mine.tolist() == theirs.tolist()


@pytest.mark.parametrize("kind", ["cat", None], ids=["cat", "prealloc"])
@torch.no_grad()
def test_batch_of_different_prompts_matches_hf_left_padding(hf_pair, kind):
    """HF's own way to batch different prompts: left padding plus attention_mask (from
    which GPT-2 derives per-row position ids). Both must give every row the same greedy
    tokens, and each row the tokens it gets alone."""
    hf, ours, name = hf_pair
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(263, (n,), generator=g).tolist() for n in (1, 7, 30, 5)]
    width = max(map(len, prompts))
    padded = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    theirs = hf.generate(padded, attention_mask=attention_mask, do_sample=False,
                         max_new_tokens=GEN_TOKENS, eos_token_id=None, pad_token_id=0)[:, width:]
    mine = generate_tokens(ours, prompts, GEN_TOKENS, temperature=0, cache_kind=kind)
    assert mine.tolist() == theirs.tolist()
    alone = ours.generate(torch.tensor([prompts[2]]), GEN_TOKENS, temperature=0)[0, len(prompts[2]):]
    assert mine[2].tolist() == alone.tolist()


@pytest.mark.parametrize("kind", ["cat", None], ids=["cat", "prealloc"])
@torch.no_grad()
def test_hf_cache_agrees_with_ours(hf_pair, kind):
    """Both caches fed the same chunks: each step's logits agree, so both index positions
    and masks the same way."""
    hf, ours, name = hf_pair
    idx = torch.randint(263, (2, 40), generator=torch.Generator().manual_seed(2))
    cache, past, start, diff = ours.new_cache(2, kind), None, 0, 0.0
    for size in [7, 1, 1, 5, 1, 12, 1, 3, 9]:
        chunk = idx[:, start:start + size]
        mine, cache = ours(chunk, cache)
        theirs, past = hf_step(hf, chunk, past)
        start += size
        diff = max(diff, (mine - theirs).abs().max().item())
    assert start == idx.size(1)
    report(f"chunked, {kind} cache", name, diff)
    assert diff < ATOL


# ---------------------------------------------------------------------------- the tokenizer

def test_tokenizer_from_vocab_and_merges(tmp_path):
    path = tmp_path / "tok"
    make_hf_dir(path, **HF_CONFIGS["48d-3heads-safetensors-sdpa"])
    _, enc = load_hf_model(CACHED_MODELS, path, report=quiet)
    # by hand: "the" -> t + he (no 't'+'he' merge); " and" -> nd, then Ġa, then Ġand;
    # " then" -> he, Ġt, Ġthe, then n; 't' and 'n' are printable: id = byte - ord('!')
    assert enc.encode_ordinary("the and then") == [ord("t") - 33, 256, 261, 258, ord("n") - 33]
    assert enc.eot_token == EOT_ID and enc.n_vocab == 263
    text = "Café naïve\tand\r\n  then 🎭 汉字 \x00\x7f\u200b the end"
    assert enc.decode(enc.encode_ordinary(text)) == text
    assert enc.encode_ordinary(text) == GPT2TokenizerFast.from_pretrained(path)(text)["input_ids"]


def test_tokenizer_json_only(tmp_path):
    """Newer transformers save tokenizer.json alone; the same tokenizer must come out."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    write_tiny_tokenizer(src)
    make_hf_dir(dst, **HF_CONFIGS["48d-3heads-safetensors-sdpa"])
    for name in ("vocab.json", "merges.txt"):
        (dst / name).unlink()
    GPT2TokenizerFast.from_pretrained(src).save_pretrained(dst)
    assert (dst / "tokenizer.json").exists() and not (dst / "vocab.json").exists()
    _, enc = load_hf_model(CACHED_MODELS, dst, report=quiet)
    assert enc.encode_ordinary("the and then") == [ord("t") - 33, 256, 261, 258, ord("n") - 33]


# ---------------------------------------------------------------------------- export round trips

def check_export(ours, enc, out, label):
    """from_pretrained loads `out` unchanged; logits and tokenization agree with ours."""
    hf = GPT2LMHeadModel.from_pretrained(out).eval()
    n = min(ours.config.context_len, 200)
    idx = torch.randint(enc.n_vocab, (2, n), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (ours(idx)[0] - hf(idx).logits).abs().max().item()
    report("export -> from_pretrained", label, diff)
    assert diff < ATOL
    text = "ROMEO:\nBut soft, what light through yonder window breaks?\n\nCafé 🎭 汉字 \t x"
    assert GPT2TokenizerFast.from_pretrained(out)(text)["input_ids"] == enc.encode_ordinary(text)
    return hf


@pytest.mark.parametrize("use_safetensors", [True, False], ids=["safetensors", "bin"])
def test_export_round_trip(config, use_safetensors, tmp_path):
    ckpt, out = tmp_path / "tiny.pt", tmp_path / "hf"
    save_checkpoint(ckpt, tiny_model(config), byte_tokenizer_spec())
    lines = []
    export(ckpt, out, report=lines.append, use_safetensors=use_safetensors)
    assert (out / ("model.safetensors" if use_safetensors else "pytorch_model.bin")).exists()
    assert "vocab.json + merges.txt" in lines[-1]
    ours, enc = load_model(CACHED_MODELS, ckpt, report=quiet)
    hf = check_export(ours, enc, out, f"{config.n_head}heads bias={config.bias}")
    assert hf.config.eos_token_id == enc.eot_token
    # and back through our importer: the same tensors, bit for bit (transposes are exact);
    # a model trained without biases comes back with zero biases, which compute the same
    back, _ = load_hf_model(CACHED_MODELS, out, report=quiet)
    mine = ours.state_dict()
    for key, value in back.state_dict().items():
        assert torch.equal(value, mine[key]) if key in mine else not value.any(), key


def test_export_says_when_tokenizer_is_not_gpt2_style(tmp_path):
    """A regex HF's GPT-2 tokenizer cannot use: weights exported, tokenizer plainly not."""
    ckpt, out = tmp_path / "tiny.pt", tmp_path / "hf"
    save_checkpoint(ckpt, tiny_model(TINY_CONFIGS[0]), byte_tokenizer_spec() | {"pat_str": r"\S+|\s+"})
    lines = []
    export(ckpt, out, report=lines.append)
    assert "tokenizer NOT exported" in lines[-1] and not (out / "vocab.json").exists()
    GPT2LMHeadModel.from_pretrained(out)


def test_export_bundled_model(tmp_path):
    """The real trained model: same logits, same greedy text, same tokenization of the
    whole held-out set through HF's own tokenizer."""
    out = tmp_path / "hf"
    export(BUNDLED, out, report=quiet)
    ours, enc = load_model(CACHED_MODELS, BUNDLED, report=quiet)
    hf = check_export(ours, enc, out, "bundled shakespeare")
    heldout = (BUNDLED.parent / "heldout.txt").read_text(encoding="utf-8")
    tok = GPT2TokenizerFast.from_pretrained(out)
    assert tok(heldout)["input_ids"] == enc.encode_ordinary(heldout)
    prompt = torch.tensor([enc.encode_ordinary("ROMEO:\n")])
    with torch.no_grad():
        mine = ours.generate(prompt, GEN_TOKENS, temperature=0)
        theirs = hf_greedy(hf, prompt)
    assert mine.tolist() == theirs.tolist()


def test_export_script(tmp_path, tiny_ckpt):
    out = tmp_path / "hf"  # as a user runs it, in a process of its own; the error in this process
    done = subprocess.run([sys.executable, str(ROOT / "export_hf.py"), str(tiny_ckpt), str(out)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert {"config.json", "vocab.json", "merges.txt"} <= {p.name for p in out.iterdir()}
    failed = run_script("export_hf.py", tmp_path / "missing.pt", tmp_path / "new")
    assert failed.returncode == 2
    assert failed.stderr.startswith("export_hf.py: error: ") and failed.stderr.count("\n") == 1
    with pytest.raises(UserError, match="not an empty directory"):  # never mixed with an old export
        export(tiny_ckpt, out, report=quiet)


# ---------------------------------------------------------------------------- import errors

def one_line_error(path):
    with pytest.raises(CheckpointError) as info:
        load_hf_model(CACHED_MODELS, path, report=quiet)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    make_hf_dir(path, **HF_CONFIGS["48d-3heads-safetensors-sdpa"])
    return path


def copy_with(src, dst, drop=(), **config_changes):
    """A copy of an HF directory without the files in `drop`, with config.json edited."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in drop:
            (dst / f.name).write_bytes(f.read_bytes())
    if config_changes:
        config = json.loads((src / "config.json").read_text()) | config_changes
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_error_missing_dir(tmp_path):
    assert "no such directory" in one_line_error(tmp_path / "nowhere")


def test_error_not_a_dir(tmp_path, tiny_ckpt):
    assert "not a directory" in one_line_error(tiny_ckpt)


def test_error_missing_config(tmp_path, hf_dir):
    assert "no config.json" in one_line_error(copy_with(hf_dir, tmp_path / "d", drop={"config.json"}))


def test_error_missing_weights(tmp_path, hf_dir):
    path = copy_with(hf_dir, tmp_path / "d", drop={"model.safetensors"})
    assert "no model.safetensors or pytorch_model.bin" in one_line_error(path)


@pytest.mark.parametrize("change, words", [
    (dict(model_type="bert"), "model_type is 'bert'; these can be loaded: gpt2, llama"),
    (dict(activation_function="relu"), "activation_function 'relu'"),
    (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    (dict(layer_norm_epsilon=1e-6), "layer_norm_epsilon"),
    (dict(n_head=5), "divisible"),
], ids=["model_type", "activation", "scale_by_layer", "ln_eps", "bad_heads"])
def test_error_unsupported_config(tmp_path, hf_dir, change, words):
    assert words in one_line_error(copy_with(hf_dir, tmp_path / "d", **change))


def test_error_without_safetensors(tmp_path, hf_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if not installed
    assert "pip install safetensors" in one_line_error(hf_dir)


def test_error_damaged_weights(tmp_path, hf_dir):
    path = copy_with(hf_dir, tmp_path / "d")
    (path / "model.safetensors").write_bytes(b"not really")
    assert "not a readable safetensors file" in one_line_error(path)


def test_cli_hf_flag(hf_dir):
    """plumbing.cli.load_from_args hands --hf DIR to load_hf_model (the contract generate.py relies on)."""
    from argparse import Namespace
    from plumbing.cli import load_from_args
    model, enc, device = load_from_args(CACHED_MODELS, Namespace(hf=str(hf_dir), ckpt=None, device="cpu",
                                                              dtype="float32", seed=0,
                                                              quantize="none", group_size=None))
    assert isinstance(model, KVCacheGPT) and enc.eot_token == EOT_ID and device.type == "cpu"
