"""The lean loaders (plumbing/checkpoint.py build_model and fill_model, plumbing/hf.py): a model
built on the meta device and given the file's tensors one at a time must be the model that
eager construction + load_state_dict gives, bit for bit, with nothing left on meta and the
tied output layer still one tensor with the embedding; --dtype auto picks what its docstring
says; --quantize while loading is load-then-quantize; and loading a bfloat16 file in
bfloat16 holds no second copy of it."""

import argparse
import dataclasses
import json
import mmap
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from conftest import ROOT, TINY_CONFIGS, byte_tokenizer_spec, tiny_model
from generation import dense_matmul
from hf_llama_dirs import byte_level_tokenizer, hf_classes, make_hf_llama_dir
from kv_cache import CACHED_MODELS
from llama import Llama, LlamaConfig
from plumbing.checkpoint import (BUNDLED, BUNDLED_LLAMA, EMBEDDING, NAIVE_MODELS, auto_dtype,
                                 clean_state_dict, load_model, resolve_dtype, save_checkpoint,
                                 saved_dtype, split_checkpoint)
from plumbing.cli import load_source
from plumbing.hf import config_dtype, load_hf_model, read_config
from plumbing.mapped_pages import release_file_pages
from plumbing.model_config import make_config
from weight_quant import QuantizedLinear, quantize_model

TINY_LLAMA = LlamaConfig(context_len=64, vocab_size=260, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                         intermediate_size=96, tie_embeddings=True)
HF_VARIANTS = ["llama3-gqa-ropescaling", "llama2-mha-untied"]  # tied and untied output layer
PROMPT = torch.tensor([[5, 17, 42, 99, 3, 250]])


# ---------------------------------------------------------------------------- helpers

def eager_model(classes, path):
    """The model built the way the loaders did before building on meta: constructed for real
    (random initialisation, then overwritten) and load_state_dict-ed from torch.load's whole
    state dict, the tied lm_head given the embedding's tensor."""
    obj = torch.load(path, map_location="cpu", weights_only=True)
    state_dict, config_dict, _ = split_checkpoint(obj, path)
    state_dict = clean_state_dict(state_dict)
    config = make_config(config_dict, state_dict, path)
    if config.family == "gpt" or config.tie_embeddings:
        state_dict.setdefault("lm_head.weight", state_dict[EMBEDDING[config.family]])
    model = classes[config.family](config)
    model.load_state_dict(state_dict, strict=True)
    return model.eval()


def eager_hf_model(classes, path, hf_model):
    """An HF directory's model built eagerly, holding the HF model's own (float32) tensors."""
    _, config = read_config(path)
    model = classes[config.family](config)
    state_dict = clean_state_dict({k: v for k, v in hf_model.state_dict().items()
                                   if not k.endswith("rotary_emb.inv_freq")})
    model.load_state_dict(state_dict, strict=True)
    return model.eval()


def all_tensors(model):
    """{name: tensor} of every parameter (tied ones under each name), buffer and plain tensor
    attribute (a Llama's inv_freq) of every module."""
    tensors = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        own = {**module._parameters, **module._buffers,
               **{k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}}
        tensors.update({prefix + k: v for k, v in own.items() if v is not None})
    return tensors


def assert_bit_equal(loaded, eager):
    """Same names, dtypes, shapes and values (torch.equal: no tolerance) for every tensor."""
    a, b = all_tensors(loaded), all_tensors(eager)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


def assert_nothing_on_meta(model):
    meta = [name for name, t in all_tensors(model).items() if t.is_meta]
    assert meta == []


def embedding_of(model):
    return model.transformer.wte if hasattr(model, "transformer") else model.model.embed_tokens


def assert_tied(model):
    """The output layer and the embedding are one tensor (one Parameter, one storage)."""
    assert model.lm_head.weight is embedding_of(model).weight
    assert model.lm_head.weight.data_ptr() == embedding_of(model).weight.data_ptr()


def quiet(line):
    pass


def tiny_llama_ckpt(path):
    save_checkpoint(path, tiny_model(TINY_LLAMA, cls=Llama), byte_tokenizer_spec())
    return path


def tiny_gpt_ckpt(path, config_index):
    save_checkpoint(path, tiny_model(TINY_CONFIGS[config_index]), byte_tokenizer_spec())
    return path


def bf16_hf_dir(path, name, config_key="dtype"):
    """An HF directory of a random model saved in bfloat16 as safetensors, its config.json
    saying so under config_key (transformers 5 writes 'dtype', 4 wrote 'torch_dtype')."""
    hf, _ = make_hf_llama_dir(path, name)
    hf.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    config[config_key] = "bfloat16"
    config_file.write_text(json.dumps(config))
    return path


def file_tensors(file):
    from safetensors import safe_open
    with safe_open(file, "pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}


# ---------------------------------------------------------------------------- 1. the same model

@pytest.mark.parametrize("classes", [NAIVE_MODELS, CACHED_MODELS], ids=["naive", "cached"])
@pytest.mark.parametrize("source", ["gpt-4heads", "gpt-3heads-nobias", "llama-tiny", "gpt-bundled",
                                    "llama-bundled"])
def test_checkpoint_loads_bit_equal_to_eager(tmp_path, source, classes):
    """load_model's model == the eager one, every tensor bit for bit; nothing on meta; tied."""
    path = {"gpt-4heads": lambda: tiny_gpt_ckpt(tmp_path / "t.pt", 0),
            "gpt-3heads-nobias": lambda: tiny_gpt_ckpt(tmp_path / "t.pt", 1),
            "llama-tiny": lambda: tiny_llama_ckpt(tmp_path / "t.pt"),
            "gpt-bundled": lambda: BUNDLED, "llama-bundled": lambda: BUNDLED_LLAMA}[source]()
    loaded, _ = load_model(classes, path, report=quiet)
    eager = eager_model(classes, path)
    assert type(loaded) is type(eager)
    assert_nothing_on_meta(loaded)
    assert_bit_equal(loaded, eager)
    assert_tied(loaded)  # every source here ties its output layer
    assert not loaded.training


@pytest.mark.parametrize("name", HF_VARIANTS)
def test_hf_dir_loads_bit_equal_to_eager(tmp_path, name):
    """load_hf_model (float32 file, float32 run) == the eager model holding HF's tensors."""
    hf, _ = make_hf_llama_dir(tmp_path, name)
    loaded, _ = load_hf_model(NAIVE_MODELS, tmp_path, dtype=torch.float32, report=quiet)
    assert_nothing_on_meta(loaded)
    assert_bit_equal(loaded, eager_hf_model(NAIVE_MODELS, tmp_path, hf))
    if loaded.config.tie_embeddings:
        assert_tied(loaded)
    else:
        assert loaded.lm_head.weight.data_ptr() != loaded.model.embed_tokens.weight.data_ptr()


# ---------------------------------------------------------------------------- 2. the same text

@pytest.mark.parametrize("path", [BUNDLED, BUNDLED_LLAMA], ids=["gpt", "llama"])
def test_bundled_greedy_tokens_unchanged(path):
    """20 greedy tokens (through the cache) of the bundled models loaded now equal those of
    the eagerly built model: exact, as their weights are bit-equal (test above)."""
    loaded, _ = load_model(CACHED_MODELS, path, dtype="auto", report=quiet)
    assert loaded.lm_head.weight.dtype == torch.float32  # a float16 file without 'dtype': float32
    new = loaded.generate(PROMPT, 20, temperature=0)
    old = eager_model(CACHED_MODELS, path).generate(PROMPT, 20, temperature=0)
    assert new.shape == (1, PROMPT.size(1) + 20)
    assert torch.equal(new, old)


# ---------------------------------------------------------------------------- 3. bf16 files

@pytest.mark.parametrize("name", HF_VARIANTS)
def test_bf16_hf_dir_loaded_in_bf16_is_the_file(tmp_path, name):
    """dtype bfloat16: every parameter is bfloat16 and equals the file's tensor exactly."""
    path = bf16_hf_dir(tmp_path, name)
    saved = file_tensors(path / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    lines = []
    model, _ = load_hf_model(NAIVE_MODELS, path, dtype=torch.bfloat16, report=lines.append)
    assert_nothing_on_meta(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    assert {p.dtype for p in params.values()} == {torch.bfloat16}
    assert set(saved) <= set(params)  # a tied lm_head is saved once, as the embedding
    for key, tensor in saved.items():
        assert torch.equal(params[key], tensor), key
    assert len(lines) == 1  # what was loaded; no dtype line for a dtype the user chose
    assert model.inv_freq.dtype == torch.float32  # the rotary frequencies stay float32


def without_bf16_arithmetic(monkeypatch, native=False):
    """Run as on a CPU without (or, native=True, with) AVX-512 BF16, whichever this one is."""
    monkeypatch.setattr(dense_matmul, "computes_bf16_natively", lambda: native)


@pytest.mark.parametrize("config_key", ["dtype", "torch_dtype"])
@pytest.mark.parametrize("dtype", ["auto", torch.float32])
def test_bf16_hf_dir_computes_in_float32_on_cpu(tmp_path, monkeypatch, dtype, config_key):
    """dtype auto on a CPU without bf16 arithmetic (float32 computes faster there) and dtype
    float32: float32 parameters holding the file's values exactly (bf16 -> fp32 is exact);
    auto says so in one line, float32 (the user's choice) says nothing more."""
    without_bf16_arithmetic(monkeypatch)
    path = bf16_hf_dir(tmp_path, "llama2-mha-untied", config_key)
    saved = file_tensors(path / "model.safetensors")
    lines = []
    model, _ = load_hf_model(NAIVE_MODELS, path, dtype=dtype, report=lines.append)
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.float32}
    for key, tensor in saved.items():
        assert torch.equal(params[key], tensor.float()), key
    if dtype == "auto":
        assert len(lines) == 2 and lines[1].startswith("dtype float32 (")
        assert "bfloat16" in lines[1] and "--dtype" in lines[1]
    else:
        assert len(lines) == 1


def test_bf16_hf_dir_stays_bf16_on_a_cpu_with_bf16_arithmetic(tmp_path, monkeypatch):
    """Where the CPU multiplies bf16 in hardware, auto keeps the file's bf16, said in one line."""
    without_bf16_arithmetic(monkeypatch, native=True)
    path = bf16_hf_dir(tmp_path, "llama2-mha-untied", "torch_dtype")
    saved = file_tensors(path / "model.safetensors")
    lines = []
    model, _ = load_hf_model(NAIVE_MODELS, path, dtype="auto", report=lines.append)
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.bfloat16}
    for key, tensor in saved.items():
        assert torch.equal(params[key], tensor), key
    assert lines[1].startswith("dtype bfloat16 (") and "AVX-512 BF16" in lines[1]


def test_checkpoint_saved_in_bf16_runs_in_float32_on_cpu(tmp_path, monkeypatch):
    """Our own format: a model that computed in bfloat16 records it; auto on a CPU without bf16
    arithmetic loads float32."""
    without_bf16_arithmetic(monkeypatch)
    path = tmp_path / "bf16.pt"
    save_checkpoint(path, tiny_model(TINY_CONFIGS[0]).to(torch.bfloat16), byte_tokenizer_spec())
    assert torch.load(path, weights_only=True)["dtype"] == "bfloat16"
    lines = []
    model, _ = load_model(NAIVE_MODELS, path, dtype="auto", report=lines.append)
    assert model.lm_head.weight.dtype == torch.float32
    assert lines[-1].startswith("dtype float32 (")
    in_bf16, _ = load_model(NAIVE_MODELS, path, dtype=torch.bfloat16, report=quiet)
    assert_bit_equal(model, in_bf16.float())  # the same values, only wider


# ---------------------------------------------------------------------------- 4. --quantize

def quantized_pair(tmp_path, source, scheme):
    """(quantized while loading through load_source, loaded then quantize_model), both from
    the same file, int4 with its default group size."""
    args = argparse.Namespace(quantize=scheme, group_size=None)
    if source == "hf-untied":
        make_hf_llama_dir(tmp_path, "llama2-mha-untied")
        kw = {"hf": tmp_path}
        plain, _ = load_hf_model(CACHED_MODELS, tmp_path, report=quiet)
    else:
        path = {"gpt": lambda: tiny_gpt_ckpt(tmp_path / "t.pt", 0),
                "llama-tied": lambda: tiny_llama_ckpt(tmp_path / "t.pt")}[source]()
        kw = {"ckpt": path}
        plain, _ = load_model(CACHED_MODELS, path, report=quiet)
    while_loading, _ = load_source(CACHED_MODELS, **kw, quantize_args=args, report=quiet)
    return while_loading, quantize_model(plain, scheme)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("source", ["gpt", "llama-tied", "hf-untied"])
def test_quantize_while_loading_is_load_then_quantize(tmp_path, source, scheme):
    """The same modules with the same codes and scales (torch.equal), the same logits
    (torch.equal: both run the same kernels on the same bf16 inputs in the same order, so no
    tolerance is needed), and no float copy of any quantized weight kept."""
    while_loading, after = quantized_pair(tmp_path, source, scheme)
    assert_nothing_on_meta(while_loading)
    kinds = {name: type(m) for name, m in while_loading.named_modules()}
    assert kinds == {name: type(m) for name, m in after.named_modules()}
    quantized = {name: m for name, m in while_loading.named_modules() if isinstance(m, QuantizedLinear)}
    assert quantized  # every block's Linears at least
    assert_bit_equal(while_loading, after)  # codes, scales, and every float tensor left
    assert torch.equal(while_loading(PROMPT)[0], after(PROMPT)[0])

    tied = source != "hf-untied"
    assert isinstance(while_loading.lm_head, QuantizedLinear) == tied  # an untied head stays float
    linears = [name for name, m in while_loading.named_modules() if isinstance(m, nn.Linear)]
    assert linears == ([] if tied else ["lm_head"])
    for name, m in quantized.items():
        if m is while_loading.lm_head:  # the tied head's weight is the embedding itself, kept exact
            assert m.weight is embedding_of(while_loading).weight
            continue
        assert "weight" not in m._parameters, name
        full = [k for k, t in {**m._buffers, **vars(m)}.items() if isinstance(t, torch.Tensor)
                and t.is_floating_point() and t.shape == (m.out_features, m.in_features)]
        assert full == [], name


# ---------------------------------------------------------------------------- 5. --dtype auto

CPU, CUDA, MPS = torch.device("cpu"), torch.device("cuda"), torch.device("mps")


@pytest.mark.parametrize("saved, device, bf16_supported, chosen", [
    (torch.float32, CPU, None, torch.float32),
    (torch.bfloat16, CPU, False, torch.float32),    # no bf16 arithmetic: fp32 computes faster
    (torch.float16, CPU, False, torch.float32),
    (torch.bfloat16, CPU, True, torch.bfloat16),    # AVX-512 BF16: bf16 is the faster one
    (torch.float16, CPU, True, torch.bfloat16),     # fp16 has no such kernel: bf16 instead
    (torch.float32, CUDA, True, torch.float32),
    (torch.bfloat16, CUDA, True, torch.bfloat16),   # a GPU keeps half precision
    (torch.bfloat16, CUDA, False, torch.float32),   # unless it has no bf16
    (torch.float16, CUDA, False, torch.float16),
    (torch.bfloat16, MPS, None, torch.bfloat16),
    (torch.float16, MPS, None, torch.float16),
])
def test_auto_dtype_table(monkeypatch, saved, device, bf16_supported, chosen):
    """auto_dtype is a pure function of (saved dtype, device) and of whether the device
    computes bf16 (faked here, so every row runs on any machine)."""
    if bf16_supported is not None:
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_supported)
        without_bf16_arithmetic(monkeypatch, native=bf16_supported)
    dtype, why = auto_dtype(saved, device)
    assert dtype == chosen
    assert isinstance(why, str) and why


@pytest.mark.parametrize("saved, device, chosen", [
    (torch.bfloat16, CPU, torch.bfloat16),  # the int kernels compute in bf16: the rest stays bf16
    (torch.float16, CPU, torch.bfloat16),
    (torch.float32, CPU, torch.float32),    # a float32 checkpoint is not made smaller
    (torch.bfloat16, MPS, torch.bfloat16),
])
def test_auto_dtype_with_quantize(saved, device, chosen):
    dtype, why = auto_dtype(saved, device, quantize="int4")
    assert dtype == chosen
    assert isinstance(why, str) and why


@pytest.mark.parametrize("requested, saved, chosen, says", [
    ("auto", torch.float32, torch.float32, False),   # a float32 checkpoint runs as it always did
    ("auto", torch.bfloat16, torch.float32, True),
    ("auto", torch.float16, torch.float32, True),
    (torch.bfloat16, torch.float32, torch.bfloat16, False),  # a dtype given is the dtype used
    (torch.float16, torch.bfloat16, torch.float16, False),
    (torch.float32, torch.bfloat16, torch.float32, False),
])
def test_resolve_dtype_on_cpu(monkeypatch, requested, saved, chosen, says):
    without_bf16_arithmetic(monkeypatch)  # (the rows with it: test_auto_dtype_table)
    dtype, line = resolve_dtype(requested, saved, "cpu")
    assert dtype == chosen
    assert (line is not None) == says
    if says:
        assert line.startswith("dtype float32 (") and str(saved).removeprefix("torch.") in line


@pytest.mark.parametrize("record, dtype", [
    ({"dtype": "bfloat16"}, torch.bfloat16), ({"dtype": "float16"}, torch.float16),
    ({"dtype": "float32"}, torch.float32), ({}, torch.float32),  # says nothing: trained in fp32
    ({"dtype": "int8"}, torch.float32), ({"dtype": 3}, torch.float32), ("not a dict", torch.float32),
])
def test_saved_dtype(record, dtype):
    assert saved_dtype(record) == dtype


@pytest.mark.parametrize("hf, dtype", [
    ({"dtype": "bfloat16"}, torch.bfloat16), ({"torch_dtype": "float16"}, torch.float16),
    ({"dtype": "float32", "torch_dtype": "bfloat16"}, torch.float32),  # transformers 5's key first
    ({}, torch.float32), ({"torch_dtype": "float64"}, torch.float32),
])
def test_config_dtype(hf, dtype):
    assert config_dtype(hf) == dtype


# ---------------------------------------------------------------------------- 6. peak memory

# The peak is read from /proc/self/status's VmHWM (this process image's peak resident set),
# not getrusage's ru_maxrss: Linux carries ru_maxrss over fork and exec, so a process started
# by pytest (over 500 MB resident here) reports pytest's size until it outgrows it.
PEAK_SCRIPT = r"""
import json, re, sys
sys.path.insert(0, sys.argv[1])
import torch
from plumbing.checkpoint import NAIVE_MODELS
from plumbing.hf import load_hf_model

def peak_rss():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024

dtype = getattr(torch, sys.argv[4])
load_hf_model(NAIVE_MODELS, sys.argv[2], dtype=dtype, report=lambda line: None)  # imports, first calls
before = peak_rss()
model, _ = load_hf_model(NAIVE_MODELS, sys.argv[3], dtype=dtype, report=lambda line: None)
after = peak_rss()
print(json.dumps({"before": before, "after": after, "dtype": str(model.lm_head.weight.dtype)}))
"""


def peak_growth(small, big, dtype):
    """How much loading `big` raised the peak resident memory of a fresh process that had
    loaded `small` first (so imports and first-call allocations are in `before`)."""
    done = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(ROOT), str(small), str(big), dtype],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout.splitlines()[-1])
    return r["after"] - r["before"], r["dtype"]


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/status VmHWM: Linux")
def test_loading_bf16_holds_no_second_copy(tmp_path):
    """A ~90 MB bfloat16 safetensors Llama loaded in bfloat16 raises the peak resident memory
    by at most 1.5x the file + 50 MB. Why that bound: the parameters are the memory-mapped
    file's own pages, and checking every value reads each of them, so about 1x the file
    becomes resident; a second copy of the weights would be 2x (and an fp32 conversion 2x
    more than that: the fp32 tensors alone are twice the file). The 0.5x and 50 MB leave room
    for the allocator, module objects and the tokenizer. The fp32 load is measured too, to
    show the measurement sees copies: it must exceed 1.5x the file."""
    config_class, model_class = hf_classes()["llama"]
    tokenizer = byte_level_tokenizer()
    torch.manual_seed(0)
    config = config_class(hidden_size=512, num_hidden_layers=12, intermediate_size=1536,
                          num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
                          vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    big = tmp_path / "big"
    model_class(config).to(torch.bfloat16).save_pretrained(big, safe_serialization=True)
    tokenizer.save_pretrained(big)
    small = bf16_hf_dir(tmp_path / "small", "llama3-gqa-ropescaling")
    size = (big / "model.safetensors").stat().st_size
    assert 50e6 < size < 110e6

    growth, dtype = peak_growth(small, big, "bfloat16")
    assert dtype == "torch.bfloat16"
    assert growth <= 1.5 * size + 50e6, f"peak +{growth / 1e6:.0f} MB for a {size / 1e6:.0f} MB file"
    growth_fp32, dtype = peak_growth(small, big, "float32")
    assert dtype == "torch.float32"
    assert growth_fp32 > 1.5 * size, f"fp32: peak +{growth_fp32 / 1e6:.0f} MB for {size / 1e6:.0f} MB"


# ---------------------------------------------------------------------------- 7. file pages let go

BIG_VOCAB_LLAMA = LlamaConfig(context_len=64, vocab_size=8192, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                              intermediate_size=96, tie_embeddings=True)  # a 2 MB fp32 table: 512 pages


def mapped_fraction(tensor):
    """The share of tensor's whole pages this process has mapped in (bit 63 of each page's
    /proc/self/pagemap entry: present), whatever the kernel's page cache holds."""
    page = mmap.PAGESIZE
    first, last = -(-tensor.data_ptr() // page), (tensor.data_ptr() + tensor.nbytes) // page
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = pagemap.read((last - first) * 8)
    present = [int.from_bytes(entries[i:i + 8], "little") >> 63 for i in range(0, len(entries), 8)]
    return sum(present) / len(present)


def big_vocab_checkpoint(tmp_path, tied):
    model = tiny_model(dataclasses.replace(BIG_VOCAB_LLAMA, tie_embeddings=tied), cls=Llama)
    save_checkpoint(tmp_path / "big_vocab.pt", model, byte_tokenizer_spec())
    return tmp_path / "big_vocab.pt", model.model.embed_tokens.weight.detach().clone()


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="/proc/self/pagemap: Linux")
@pytest.mark.parametrize("tied, quantize, released", [
    (True, "int8", True),    # the tied head quantized: the table is read a row per token
    (True, "int4", True),
    (True, None, False),     # a float tied head reads the whole table every step: kept
    (False, None, True),     # an untied head: the table is read a row per token at once
])
def test_embedding_pages_let_go_once_read_by_rows(tmp_path, tied, quantize, released):
    """Loaded from a memory-mapped file in its own dtype, the token embedding's pages stay
    mapped only where something still reads the table whole; dropped, they come back with
    the file's bytes (the values and the lookup unchanged)."""
    path, table = big_vocab_checkpoint(tmp_path, tied)
    model, _ = load_model(NAIVE_MODELS, path, dtype=torch.float32, report=quiet, quantize=quantize)
    embedding = model.model.embed_tokens.weight
    fraction = mapped_fraction(embedding)
    assert (fraction < 0.05) if released else (fraction > 0.95), fraction
    assert torch.equal(model.model.embed_tokens(PROMPT)[0], table[PROMPT[0]])  # rows read back
    if released:  # those rows' pages only (the kernel maps up to 16 around each page read)
        assert 0 < mapped_fraction(embedding) < 6 * 16 / 512
    assert torch.equal(embedding.detach(), table)


def test_release_leaves_memory_that_is_not_a_files_alone():
    """A tensor of anonymous memory (a converted or copied one) would be zeroed by
    MADV_DONTNEED: release_file_pages refuses it and the values stay."""
    values = torch.randn(1 << 20)  # 4 MB: whole pages of the heap or an anonymous mapping
    kept = values.clone()
    assert release_file_pages(values) is False
    assert torch.equal(values, kept)
