"""export_gguf.py: the file llama.cpp reads, checked with the gguf package's own reader.

Every f32 tensor must come back bit for bit (the export only renames and copies). f16 and
q8_0 are lossy by design; their bounds are the formats' own: f16 keeps 11 significant bits
(relative error <= 2**-11); q8_0 stores each block of 32 values as int8 times one scale,
step = max|block| / 127, kept as f16: error <= half a step, plus up to 127 times the
scale's own f16 rounding (127 * 2**-11 of a step).
llama.cpp itself running the files is tests/test_llama_cpp.py.
"""

import subprocess
import sys

import numpy as np
import pytest
import torch

from plumbing.checkpoint import BUNDLED, load_model, save_checkpoint
from plumbing.script import UserError
from conftest import ROOT, TINY_CONFIGS, byte_tokenizer_spec, run_script, tiny_model
from export_gguf import export
from kv_cache import CACHED_MODELS

gguf = pytest.importorskip("gguf", reason="gguf is not installed: pip install -r requirements-dev.txt")

# 3 merges on top of the 256 bytes, then <|endoftext|>: 260 tokens, the first tiny config's
# vocabulary exactly; the second config's 300 rows leave 40 padding rows.
MERGES = [b"he", b" t", b" the"]


def bpe_tokenizer_spec():
    spec = byte_tokenizer_spec()
    ranks = spec["mergeable_ranks"] + MERGES
    return spec | {"name": "tiny-bpe", "mergeable_ranks": ranks,
                   "special_tokens": {"<|endoftext|>": len(ranks)}}


def quiet(*_):
    pass


@pytest.fixture
def bpe_ckpt(tmp_path, config):
    path = tmp_path / "tiny.pt"
    save_checkpoint(path, tiny_model(config), bpe_tokenizer_spec())
    return path


def read(path):
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    return fields, {t.name: t for t in reader.tensors}


def expected_tensors(model):
    """llama.cpp's gpt2 tensor names -> our tensors, written out independently of the
    exporter's own table (a wrong entry there would not be repeated here)."""
    sd = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["transformer.wte.weight"],
           "position_embd.weight": sd["transformer.wpe.weight"]}
    parts = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
             "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
    for kind in ("weight", "bias"):
        for i in range(model.config.n_layer):
            for theirs, ours in parts.items():
                key = f"transformer.h.{i}.{ours}.{kind}"
                # GPT-2 (and llama.cpp's graph) always has biases: zeros compute the same
                out[f"blk.{i}.{theirs}.{kind}"] = sd.get(key, torch.zeros(sd[key.replace(kind, 'weight')].size(0)))
        out[f"output_norm.{kind}"] = sd.get(f"transformer.ln_f.{kind}", torch.zeros(model.config.n_embd))
    return out


# ---------------------------------------------------------------------------- f32: exact

def test_f32_tensors_read_back_equal(bpe_ckpt, tmp_path):
    out = tmp_path / "tiny.gguf"
    export(bpe_ckpt, out, report=quiet)
    ours, _ = load_model(CACHED_MODELS, bpe_ckpt, report=quiet)
    _, tensors = read(out)
    expected = expected_tensors(ours)
    # no output.weight: llama.cpp then ties the output projection to token_embd, as we do
    assert set(tensors) == set(expected)
    for name, want in expected.items():
        t = tensors[name]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, name
        # ggml lists dimensions innermost first: (in, out) for our (out, in) weights
        assert list(t.shape) == list(reversed(want.shape)), name
        assert np.array_equal(t.data.reshape(want.shape), want.numpy()), name


def test_metadata_llama_cpp_needs(bpe_ckpt, tmp_path, config):
    out = tmp_path / "tiny.gguf"
    export(bpe_ckpt, out, report=quiet)
    fields, _ = read(out)
    assert fields["general.architecture"] == "gpt2"
    assert fields["general.file_type"] == gguf.LlamaFileType.ALL_F32
    assert {k: fields[f"gpt2.{k}"] for k in ("context_length", "embedding_length", "feed_forward_length",
                                             "block_count", "attention.head_count")} == {
        "context_length": config.context_len, "embedding_length": config.n_embd,
        "feed_forward_length": 4 * config.n_embd, "block_count": config.n_layer,
        "attention.head_count": config.n_head}
    assert fields["gpt2.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    # the tokenizer: GPT-2 BPE, one token per embedding row, GPT-2's text form of bytes
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == config.vocab_size
    assert tokens[ord("A")] == "A" and tokens[ord(" ")] == "Ġ" and tokens[ord("\n")] == "Ċ"
    assert tokens[256:260] == ["he", "Ġt", "Ġthe", "<|endoftext|>"]
    assert fields["tokenizer.ggml.merges"] == ["h e", "Ġ t", "Ġt he"]
    token_type = gguf.TokenType
    assert types[:259] == [token_type.NORMAL] * 259 and types[259] == token_type.CONTROL
    assert types[260:] == [token_type.UNUSED] * (config.vocab_size - 260)  # padding rows
    assert fields["tokenizer.ggml.bos_token_id"] == fields["tokenizer.ggml.eos_token_id"] == 259
    assert fields["tokenizer.ggml.add_bos_token"] is False
    assert "kvcache-gpt" in fields["general.description"]  # how a later export knows it may replace it


def test_bundled_tokenizer_round_trips(tmp_path):
    """Every token of the bundled 4k BPE, read back and mapped through GPT-2's byte table,
    is our token's bytes; every merge joins two tokens into a third, in rank order."""
    out = tmp_path / "bundled.gguf"
    export(BUNDLED, out, report=quiet)
    _, enc = load_model(CACHED_MODELS, BUNDLED, report=quiet)
    fields, _ = read(out)
    from plumbing.hf_tokenizer import byte_to_char
    to_byte = {c: b for b, c in byte_to_char().items()}
    tokens = fields["tokenizer.ggml.tokens"]
    for rank, token in enumerate(tokens[:enc.eot_token]):
        assert bytes(to_byte[c] for c in token) == enc.decode_single_token_bytes(rank)
    assert tokens[enc.eot_token] == "<|endoftext|>"
    index = {t: i for i, t in enumerate(tokens)}
    merged = [index["".join(m.split(" "))] for m in fields["tokenizer.ggml.merges"]]
    assert merged == list(range(256, enc.eot_token))  # merge i made token 256 + i


# ---------------------------------------------------------------------------- f16, q8_0

@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_lossy_outtypes_within_format_bounds(bpe_ckpt, tmp_path, outtype):
    out = tmp_path / f"tiny-{outtype}.gguf"
    export(bpe_ckpt, out, outtype, report=quiet)
    ours, _ = load_model(CACHED_MODELS, bpe_ckpt, report=quiet)
    _, tensors = read(out)
    q_types = gguf.GGMLQuantizationType
    for name, want in expected_tensors(ours).items():
        t = tensors[name]
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(want.shape)
        want = want.numpy()
        # q8_0 needs rows of whole 32-value blocks: 48-wide rows fall back to f16
        quantized = outtype == "q8_0" and want.shape[-1] % 32 == 0
        if want.ndim == 1 or name.startswith("position_embd"):  # kept f32, as llama.cpp's converter does
            assert t.tensor_type == q_types.F32 and np.array_equal(got, want), name
        elif not quantized:
            assert t.tensor_type == q_types.F16, name
            assert np.all(np.abs(got - want) <= np.abs(want) * 2.0 ** -11 + 1e-7), name
        else:
            assert t.tensor_type == q_types.Q8_0, name
            blocks = np.abs(want).reshape(-1, 32).max(axis=1, keepdims=True)
            error = np.abs(got - want).reshape(-1, 32)
            step = blocks / 127  # the block's scale, which the file keeps as f16
            assert np.all(error <= step * (0.5 + 127 * 2.0 ** -11) + 1e-7), name


# ---------------------------------------------------------------------------- what is refused

def test_tokenizer_that_cannot_be_expressed(tmp_path):
    """A regex that is not GPT-2's, and a bytes-only BPE: one line each, no file."""
    for name, spec in {"regex": bpe_tokenizer_spec() | {"pat_str": r"\S+|\s+"},
                       "bytes-only": byte_tokenizer_spec()}.items():
        ckpt, out = tmp_path / f"{name}.pt", tmp_path / f"{name}.gguf"
        save_checkpoint(ckpt, tiny_model(TINY_CONFIGS[0]), spec)
        with pytest.raises(UserError, match="cannot be written for llama.cpp") as info:
            export(ckpt, out, report=quiet)
        assert "\n" not in str(info.value)
        assert list(tmp_path.glob("*.gguf*")) == [] and list(tmp_path.glob(".*.tmp")) == []


def test_overwrite_rules(tmp_path):
    """Only an empty file or an earlier export is ever replaced: never a checkpoint, a text
    file, or a GGUF model that came from elsewhere."""
    ckpt = tmp_path / "tiny.pt"
    save_checkpoint(ckpt, tiny_model(TINY_CONFIGS[0]), bpe_tokenizer_spec())
    with pytest.raises(UserError, match="must end in .gguf"):
        export(ckpt, ckpt, report=quiet)  # `export_gguf.py tiny.pt`: the output forgotten
    foreign = {"notes.gguf": b"not a GGUF file", "downloaded.gguf": b"GGUF\x03\x00\x00\x00 someone else's model"}
    for name, content in foreign.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(UserError, match="not written by kvcache-gpt"):
            export(ckpt, tmp_path / name, report=quiet)
        assert (tmp_path / name).read_bytes() == content
    out = tmp_path / "tiny.gguf"
    out.touch()  # an empty file holds nothing to lose
    export(ckpt, out, report=quiet)
    export(ckpt, out, "f16", report=quiet)  # our own export: replaced
    assert read(out)[0]["general.file_type"] == gguf.LlamaFileType.MOSTLY_F16


def test_failure_leaves_no_file(tmp_path, monkeypatch):
    """A failure in the middle of writing tensors: neither OUT nor a temporary file remains,
    and an existing OUT is left as it was."""
    ckpt, out = tmp_path / "tiny.pt", tmp_path / "tiny.gguf"
    save_checkpoint(ckpt, tiny_model(TINY_CONFIGS[0]), bpe_tokenizer_spec())
    export(ckpt, out, report=quiet)
    before = out.read_bytes()

    def broken(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", broken)
    with pytest.raises(UserError, match="nothing was written"):  # one line for the user
        export(ckpt, out, "q8_0", report=quiet)
    assert out.read_bytes() == before
    out.unlink()
    with pytest.raises(UserError, match="nothing was written"):
        export(ckpt, out, report=quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.pt"]


def test_without_the_gguf_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if not installed
    with pytest.raises(UserError, match="pip install gguf"):
        export(BUNDLED, tmp_path / "out.gguf", report=quiet)


def test_script(tmp_path):
    ckpt = tmp_path / "tiny.pt"
    save_checkpoint(ckpt, tiny_model(TINY_CONFIGS[0]), bpe_tokenizer_spec())

    # as a user runs it (in a process of its own, in a folder of theirs); the errors in this process
    done = subprocess.run([sys.executable, str(ROOT / "export_gguf.py"), str(ckpt), "out/tiny.gguf",
                           "--outtype", "q8_0"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "wrote out/tiny.gguf" in done.stderr + done.stdout and (tmp_path / "out" / "tiny.gguf").exists()
    new = tmp_path / "new.gguf"
    for args in [(tmp_path / "missing.pt", new), (ckpt, "--hf", tmp_path, new)]:
        failed = run_script("export_gguf.py", *args)
        assert failed.returncode == 2, args
        assert failed.stderr.startswith("export_gguf.py: error: ") and failed.stderr.count("\n") == 1, args
    assert not new.exists()
