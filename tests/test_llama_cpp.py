"""llama.cpp runs our exported GGUF files and computes what we compute.

Needs llama-cpp-python (pip install -r requirements-llama.txt; it builds llama.cpp from
source, so it is not in requirements-dev.txt): without it this file skips in one line.

Tolerance: ATOL = 2e-2 on fp32 logits, 0.1% of their range (up to ~21 on the bundled
model). llama.cpp runs the same mathematics in its own kernels, and two of them round more
than fp32 does: it keeps the K/V cache in f16 by default (what its users run, so what is
tested here), and its CPU GELU reads a precomputed f16 table. Measured on the bundled
model's f32 file over a full 256-token context: max |diff| 8.4e-3 (2.9e-3 with an f32
K/V cache, the GELU table's share); on the random HF GPT-2 below 1.5e-3. (Two fp32 PyTorch
implementations agree to ~1e-6, tests/test_hf.py.) A real mapping error (an untransposed or
misnamed tensor, a head split, a position offset, a missing bias) moves logits by O(1)
and changes greedy text within a few tokens, which the 200-token comparisons catch.
"""

import pytest
import torch

from plumbing.checkpoint import BUNDLED, load_model
from export_gguf import export
from kv_cache import CACHED_MODELS
from benchmarks.cache_cost import bandwidth_floor
from benchmarks.decode_speed import decode_speed
from benchmarks.peers import llama_greedy

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: "
                    "pip install -r requirements-llama.txt")
pytest.importorskip("gguf", reason="gguf is not installed: pip install -r requirements-dev.txt")

ATOL = 2e-2
GEN_TOKENS = 200
HELDOUT = BUNDLED.parent / "heldout.txt"


def quiet(*_):
    pass


def report(what, value):
    print(f"\n  {what}: {value}")


def llama_logits(llm, ids):
    """llama.cpp's logits at every position of `ids` (T, V), from a fresh context."""
    llm.reset()
    llm.eval(ids)
    return torch.from_numpy(llm.scores[:len(ids)].copy())


@pytest.fixture(scope="module")
def bundled(tmp_path_factory):
    """(our model, our tokenizer, {outtype: llama.cpp on its export}) for the bundled model."""
    ours, enc = load_model(CACHED_MODELS, BUNDLED, report=quiet)
    folder = tmp_path_factory.mktemp("gguf")
    engines = {}
    for outtype in ("f32", "f16", "q8_0"):
        export(BUNDLED, folder / f"bundled-{outtype}.gguf", outtype, report=quiet)
        engines[outtype] = load_llama_all_logits(folder / f"bundled-{outtype}.gguf", ours.config.context_len)
    yield ours, enc, engines
    for llm in engines.values():
        llm.close()


def load_llama_all_logits(path, n_ctx, f32_cache=False):
    """llama.cpp on a file, keeping every position's logits; its K/V cache in f16 (its
    default, what its users run) or, with f32_cache, in f32 (then only the arithmetic differs)."""
    import llama_cpp
    cache = dict(type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32) if f32_cache else {}
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=torch.get_num_threads(),
                           logits_all=True, verbose=False, **cache)


# ---------------------------------------------------------------------------- the bundled model

def test_bundled_logits_match(bundled):
    """A held-out passage of a full context: every position's logits, f32 file."""
    ours, enc, engines = bundled
    ids = enc.encode_ordinary(HELDOUT.read_text(encoding="utf-8"))[:ours.config.context_len]
    with torch.no_grad():
        mine = ours(torch.tensor([ids]))[0][0]
    diff = (mine - llama_logits(engines["f32"], ids)).abs().max().item()
    report("max |logit diff| bundled f32, 256 positions", f"{diff:.2e}")
    assert diff < ATOL


@pytest.mark.parametrize("prompt", ["ROMEO:\n", "JULIET:\nO"])
def test_bundled_greedy_matches(bundled, prompt):
    ours, enc, engines = bundled
    ids = enc.encode_ordinary(prompt)
    with torch.no_grad():
        mine = ours.generate(torch.tensor([ids]), GEN_TOKENS, temperature=0)[0, len(ids):].tolist()
    theirs = llama_greedy(engines["f32"], ids, GEN_TOKENS)
    assert theirs == mine
    report(f"greedy {prompt!r}", f"{GEN_TOKENS} of {GEN_TOKENS} tokens equal")


def test_tokenizes_heldout_like_us(bundled):
    """The two plays the model never saw, through llama.cpp's own tokenizer: our ids."""
    _, enc, engines = bundled
    for text in [HELDOUT.read_text(encoding="utf-8"),
                 "Café naïve\tand\r\n  then 🎭 汉字 \x00\x7f\u200b the end  \n\n\n x'll 12345 it's"]:
        assert engines["f32"].tokenize(text.encode("utf-8"), add_bos=False, special=False) == enc.encode_ordinary(text)


@pytest.mark.parametrize("outtype, worst, agree", [("f16", 0.5, 0.98), ("q8_0", 1.0, 0.95)])
def test_lossy_files_stay_close(bundled, outtype, worst, agree):
    """f16 and q8_0 change the weights (tests/test_gguf.py bounds by how much): the logits
    move, but the model's choices barely: the argmax agrees with ours at most positions."""
    ours, enc, engines = bundled
    ids = enc.encode_ordinary(HELDOUT.read_text(encoding="utf-8"))[:ours.config.context_len]
    with torch.no_grad():
        mine = ours(torch.tensor([ids]))[0][0]
    theirs = llama_logits(engines[outtype], ids)
    diff = (mine - theirs).abs().max().item()
    same = (mine.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    report(f"bundled {outtype}: max |logit diff| {diff:.2e}, argmax agrees at", f"{same:.1%} of positions")
    assert diff < worst and same >= agree


def test_benchmark_decode_speed(bundled):
    """benchmark.py's decode-speed table on the bundled model, with llama.cpp's rows:
    llama.cpp f32's greedy tokens are ours (q8_0 and q4_0 round the weights: fewer may be)."""
    ours, _, _ = bundled
    floors = {"bundled": bandwidth_floor(ours, reps=1)}
    r = decode_speed({"bundled": ours}, 40, 1, floors, compile_note="skipped", quantize=False)
    rows = r["models"][0]["rows"]
    assert list(rows) == ["ours fp32 eager", "ours bf16", "ours bf16, torch's matmul", "llama.cpp f32",
                          "llama.cpp f16", "llama.cpp q8_0", "llama.cpp q4_0"]
    assert rows["llama.cpp f32"]["greedy_leading_same"] == r["models"][0]["tokens"] == 40
    # the same weights, so the same bytes per step in f32; f16 half of them
    assert rows["llama.cpp f32"]["weight_bytes"] == rows["ours fp32 eager"]["weight_bytes"]
    assert rows["llama.cpp f16"]["weight_bytes"] == rows["llama.cpp f32"]["weight_bytes"] // 2
    assert rows["ours fp32 eager"]["vs_llama_cpp_f32"] > 0


# ---------------------------------------------------------------------------- a Hugging Face GPT-2

def test_hf_directory(tmp_path):
    """A random GPT2LMHeadModel saved by transformers, exported with --hf: llama.cpp agrees
    with our import of the same directory (3 heads; 263 tokens padded to 300 rows)."""
    pytest.importorskip("transformers", reason="transformers is not installed: pip install -r requirements-dev.txt")
    from plumbing.hf import load_hf_model
    from test_hf import HF_CONFIGS, make_hf_dir
    hf_dir, out = tmp_path / "hf", tmp_path / "hf.gguf"
    make_hf_dir(hf_dir, **HF_CONFIGS["48d-3heads-safetensors-sdpa"])
    export(hf_dir, out, hf=True, report=quiet)
    ours, enc = load_hf_model(CACHED_MODELS, hf_dir, report=quiet)
    llm = load_llama_all_logits(out, ours.config.context_len)
    try:
        ids = torch.randint(enc.n_vocab, (1, 100), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            mine = ours(ids)[0][0]
        diff = (mine - llama_logits(llm, ids[0].tolist())).abs().max().item()
        report("max |logit diff| HF GPT-2 directory", f"{diff:.2e}")
        assert diff < ATOL
        prompt = ids[0, :8].tolist()
        with torch.no_grad():
            greedy = ours.generate(torch.tensor([prompt]), 100, temperature=0)[0, 8:].tolist()
        assert llama_greedy(llm, prompt, 100) == greedy
        text = "the and then Café 🎭"
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == enc.encode_ordinary(text)
    finally:
        llm.close()


# ---------------------------------------------------------------------------- the Llama family

LLAMA_VARIANTS = {  # llama.cpp's architecture each exports to, and the settings that pick it
    "llama GQA 8/2, untied, Llama 3 rope scaling": ("llama", dict(
        n_head=8, n_kv_head=2, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})),
    "qwen2 MQA, qkv bias, tied": ("qwen2", dict(n_head=4, n_kv_head=1, qkv_bias=True,
                                                tie_embeddings=True, rope_theta=1e6)),
    "qwen3 GQA 4/2, q/k norm, head_dim 24": ("qwen3", dict(n_head=4, n_kv_head=2, qk_norm=True,
                                                           head_dim=24)),
}


@pytest.mark.parametrize("name", list(LLAMA_VARIANTS))
def test_llama_family_in_llama_cpp(tmp_path, name):
    """A random Llama-style model of ours in llama.cpp's own architecture for it (llama,
    qwen2, qwen3): logits within 1e-3 over 100 positions with llama.cpp's K/V cache in f32
    (measured 2.1e-5 on the first; with its default f16 cache they differ by up to 2e-2 at
    logits of ~7: the cache's rounding, as on the bundled model) and our 100 greedy tokens
    with the f16 cache. The 'llama' graph pairs rotary channels differently from ours: a
    wrong reordering of q and k, a wrong rope_freqs or a misread key/value head count moves
    logits by O(1)."""
    from export_gguf import write_gguf
    from benchmarks.peers import placeholder_tokenizer
    from kv_cache import KVCacheLlama
    from llama import LlamaConfig
    arch, settings = LLAMA_VARIANTS[name]
    torch.manual_seed(0)
    config = LlamaConfig(context_len=160, vocab_size=257, n_layer=2, n_embd=64, intermediate_size=128,
                         **settings)
    model = KVCacheLlama(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.2)  # norms near 1, biases and matrices spread
    path = tmp_path / "m.gguf"
    write_gguf(path, model, placeholder_tokenizer(), "f32", name)
    llm, exact = load_llama_all_logits(path, config.context_len), load_llama_all_logits(path, config.context_len, True)
    try:
        assert llm.metadata["general.architecture"] == arch
        ids = torch.randint(257, (1, 100), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            mine = model(ids)[0][0]
        diff = (mine - llama_logits(exact, ids[0].tolist())).abs().max().item()
        report(f"max |logit diff| {name}, f32 K/V cache (logits up to {mine.abs().max():.1f})", f"{diff:.2e}")
        assert diff < 1e-3
        prompt = ids[0, :8].tolist()
        with torch.no_grad():
            greedy = model.generate(torch.tensor([prompt]), 100, temperature=0)[0, 8:].tolist()
        assert llama_greedy(llm, prompt, 100) == greedy
    finally:
        llm.close()
        exact.close()


@pytest.mark.parametrize("prompt", ["ROMEO:\n", "JULIET:\nO"])
def test_bundled_llama_style_model_in_llama_cpp(tmp_path, prompt):
    """checkpoints/shakespeare-llama in llama.cpp's 'llama' architecture (q/k rows
    interleaved for its rotary pairing, 1 key/value head): our 200 greedy tokens, and our
    logits over a full context (f16 K/V cache, llama.cpp's default: ATOL)."""
    from plumbing.checkpoint import BUNDLED_LLAMA
    ours, enc = load_model(CACHED_MODELS, BUNDLED_LLAMA, report=quiet)
    export(BUNDLED_LLAMA, tmp_path / "llama.gguf", "f32", report=quiet)
    llm = load_llama_all_logits(tmp_path / "llama.gguf", ours.config.context_len)
    try:
        ids = enc.encode_ordinary(prompt)
        with torch.no_grad():
            mine = ours.generate(torch.tensor([ids]), GEN_TOKENS, temperature=0)[0, len(ids):].tolist()
        assert llama_greedy(llm, ids, GEN_TOKENS) == mine
        ids = enc.encode_ordinary(HELDOUT.read_text(encoding="utf-8"))[:ours.config.context_len]
        with torch.no_grad():
            diff = (ours(torch.tensor([ids]))[0][0] - llama_logits(llm, ids)).abs().max().item()
        report("max |logit diff| bundled Llama-style f32, 256 positions", f"{diff:.2e}")
        assert diff < ATOL
    finally:
        llm.close()
