"""The shared loader: accepted layouts, and one clear line for every broken file."""

import pytest
import tiktoken
import torch

from base_model import GPT
from plumbing.checkpoint import NAIVE_MODELS, load_model
from plumbing.files import read_checkpoint
from plumbing.script import CheckpointError
from conftest import TINY_CONFIGS, byte_tokenizer_spec, tiny_model
from kv_cache import CACHED_MODELS

CONFIG = TINY_CONFIGS[0]


def same_weights(model, reference):
    return all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 reference.state_dict().values()))


def test_our_format_round_trip(tiny_ckpt):
    lines = []
    model, tok = load_model(CACHED_MODELS, tiny_ckpt, report=lines.append)
    assert same_weights(model, tiny_model(CONFIG))
    assert len(lines) == 1 and str(tiny_ckpt) in lines[0]
    assert tok.decode(tok.encode("héllo 👋")) == "héllo 👋"


def test_nanogpt_layout_with_compile_prefix_and_mask_buffers(tmp_path):
    ref = tiny_model(CONFIG, cls=GPT)
    state = {"_orig_mod." + k: v for k, v in ref.state_dict().items()}
    state["_orig_mod.transformer.h.0.attn.bias"] = torch.ones(1, 1, 64, 64).tril()
    path = tmp_path / "nano.pt"
    model_args = {k: getattr(CONFIG, k) for k in ("n_layer", "n_head", "n_embd", "context_len", "bias", "vocab_size", "dropout")}
    torch.save({"model": state, "model_args": model_args, "iter_num": 5,
                "config": {"batch_size": 12, "learning_rate": 6e-4}, "tokenizer": byte_tokenizer_spec()}, path)
    model, _ = load_model(NAIVE_MODELS, path, report=lambda _: None)
    assert same_weights(model, ref)


def test_bare_state_dict_infers_config(tmp_path):
    config = type(CONFIG)(context_len=40, vocab_size=270, n_layer=3, n_head=2, n_embd=128)
    ref = tiny_model(config, cls=GPT)
    state = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    path = tmp_path / "bare.pt"
    torch.save(state, path)
    with pytest.raises(CheckpointError, match="gpt2"):  # nothing says which tokenizer: gpt2
        load_model(NAIVE_MODELS, path, report=lambda _: None)
    from plumbing.checkpoint import clean_state_dict
    from plumbing.model_config import infer_config
    inferred = infer_config(clean_state_dict(state), path)
    assert (inferred.n_layer, inferred.n_embd, inferred.context_len, inferred.vocab_size,
            inferred.n_head) == (3, 128, 40, 270, 2)  # n_head from 64-wide heads


def test_fp16_checkpoint_loads_into_fp32(tmp_path):
    from plumbing.checkpoint import save_checkpoint
    ref = tiny_model(CONFIG)
    save_checkpoint(tmp_path / "half.pt", ref, byte_tokenizer_spec(), dtype=torch.float16)
    model, _ = load_model(CACHED_MODELS, tmp_path / "half.pt", report=lambda _: None)
    assert model.lm_head.weight.dtype == torch.float32
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.allclose(model.lm_head.weight, ref.lm_head.weight, atol=1e-3)


def write_state(tmp_path, mutate):
    state = dict(tiny_model(CONFIG).state_dict())
    mutate(state)
    path = tmp_path / "bad.pt"
    torch.save({"model": state, "config": vars(CONFIG).copy(), "tokenizer": byte_tokenizer_spec()}, path)
    return path


@pytest.mark.parametrize("mutate, message", [
    (lambda s: s.pop("transformer.h.1.mlp.c_fc.weight"), "missing key transformer.h.1.mlp.c_fc.weight"),
    (lambda s: s.update({"transformer.h.9.extra": torch.zeros(1)}), "unexpected key transformer.h.9.extra"),
    (lambda s: s.update({"transformer.wpe.weight": torch.zeros(10, 32)}), "transformer.wpe.weight has shape"),
])
def test_mismatched_state_dict_names_the_key(tmp_path, mutate, message):
    path = write_state(tmp_path, mutate)
    with pytest.raises(CheckpointError, match=message) as e:
        load_model(NAIVE_MODELS, path, report=lambda _: None)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_missing_directory_truncated_and_foreign_files(tmp_path, tiny_ckpt):
    cases = {tmp_path / "nope.pt": "no such file", tmp_path: "is a directory"}
    truncated = tmp_path / "cut.pt"
    truncated.write_bytes(tiny_ckpt.read_bytes()[:1000])
    cases[truncated] = "not a readable PyTorch checkpoint"
    text = tmp_path / "notes.txt"
    text.write_text("just some text")
    cases[text] = "not a readable PyTorch checkpoint"
    for path, message in cases.items():
        with pytest.raises(CheckpointError, match=message):
            read_checkpoint(path)


class Exploit:
    """Unpickling this calls open(marker, 'w'): code running at load time."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_that_runs_code_is_refused_before_it_runs(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"model": Exploit(str(marker))}, path)
    with pytest.raises(CheckpointError, match="refused") as e:
        load_model(NAIVE_MODELS, path, report=lambda _: None)
    assert "\n" not in str(e.value)
    assert not marker.exists()


def test_tokenizer_larger_than_model_vocab_is_refused(tmp_path):
    spec = byte_tokenizer_spec()
    spec["special_tokens"] = {"<|endoftext|>": 256, **{f"<|x{i}|>": 257 + i for i in range(10)}}
    path = tmp_path / "tok.pt"
    torch.save({"model": tiny_model(CONFIG).state_dict(), "config": vars(CONFIG).copy(), "tokenizer": spec}, path)
    with pytest.raises(CheckpointError, match="tokenizer has 267 tokens but the model only 260"):
        load_model(NAIVE_MODELS, path, report=lambda _: None)


def test_unknown_named_encoding_gives_one_line(tmp_path):
    path = tmp_path / "named.pt"
    torch.save({"model": tiny_model(CONFIG).state_dict(), "config": vars(CONFIG).copy(),
                "tokenizer": {"encoding": "no_such_encoding_xyz"}}, path)
    with pytest.raises(CheckpointError, match="unknown tiktoken encoding 'no_such_encoding_xyz'") as e:
        load_model(NAIVE_MODELS, path, report=lambda _: None)
    assert "\n" not in str(e.value)


def test_unavailable_named_encoding_gives_one_line(tmp_path, monkeypatch):
    """tiktoken fetches its encodings on first use; offline that fails (here: simulated,
    so that the test never touches the network)."""
    def offline(name):
        raise ConnectionError("Failed to resolve 'openaipublic.blob.core.windows.net'\nmore")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    path = tmp_path / "named.pt"
    torch.save({"model": tiny_model(CONFIG).state_dict(), "config": vars(CONFIG).copy(),
                "tokenizer": {"encoding": "r50k_base"}}, path)
    with pytest.raises(CheckpointError, match="r50k_base.*offline.*TIKTOKEN_CACHE_DIR") as e:
        load_model(NAIVE_MODELS, path, report=lambda _: None)
    assert "\n" not in str(e.value)
