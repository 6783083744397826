"""The loaders' checks on hostile configs, sizes, weights and tokenizers (plumbing/files.py,
memory.py, model_config.py, tokenizer.py, checkpoint.py's build_model, hf.py's BPE): each is
refused in one CheckpointError line naming what is wrong, before anything large is
built or allocated. Everything here runs in-process on tiny files made in the test; the
CLI path (exit status 2) is test_cli_errors.py's."""

import json
import subprocess
import sys
import zipfile
from unittest import mock

import pytest
import tiktoken
import torch

from base_model import GPT, GPTConfig
from conftest import ROOT, TINY_CONFIGS, byte_tokenizer_spec, tiny_model
from kv_cache import CACHED_MODELS
from plumbing import memory
from plumbing.checkpoint import NAIVE_MODELS, build_model, check_values, load_model
from plumbing.files import read_checkpoint
from plumbing.hf_bpe import encoding_from_bpe, parse_tokenizer_json
from plumbing.model_config import SHAPE_FIELDS, config_from_dict
from plumbing.script import CheckpointError
from plumbing.tokenizer import ROUND_TRIP_SAMPLE, encoding_from_spec

CONFIG = TINY_CONFIGS[0]
GOOD = vars(CONFIG).copy()


def one_line(call, *args, match=None):
    """The CheckpointError a call raises: one line, and matching `match` if given."""
    with pytest.raises(CheckpointError, match=match) as info:
        call(*args)
    message = str(info.value)
    assert message and "\n" not in message and len(message) < 400, message
    return message


def save(path, config=GOOD, tokenizer=None, state=None):
    state = tiny_model(CONFIG).state_dict() if state is None else state
    torch.save({"model": state, "config": config, "tokenizer": tokenizer or byte_tokenizer_spec()}, path)
    return path


# ---------------------------------------------------------------------------- configs

@pytest.mark.parametrize("change, words", [
    (dict(n_head=0), "n_head must be a positive integer"),
    (dict(n_head=-4), "n_head must be a positive integer"),
    (dict(n_embd=32.0), "n_embd must be a positive integer.*, got 32.0"),
    (dict(n_layer="2"), "n_layer must be a positive integer.*, got '2'"),
    (dict(n_layer=None), "n_layer must be a positive integer.*, got None"),
    (dict(n_head=True), "n_head must be a positive integer.*, got True"),
    (dict(context_len=0), "context_len must be a positive integer"),
    (dict(vocab_size=2 ** 70), "below 2\\*\\*63"),
    (dict(dropout=5.0), "dropout must be a number in \\[0, 1\\)"),
    (dict(dropout=float("nan")), "dropout must be a number"),
    (dict(dropout="x"), "dropout must be a number"),
    (dict(bias="yes"), "bias must be true or false"),
    (dict(n_embd=30), "n_embd \\(30\\) is not divisible by n_head \\(4\\)"),
])
def test_bad_config_field_is_named(change, words):
    one_line(config_from_dict, GOOD | change, "ckpt.pt", match=words)


@pytest.mark.parametrize("config, words", [
    ([1, 2, 3], "the model config is a list"),
    ("n_layer=2", "the model config is a str"),
    ({k: v for k, v in GOOD.items() if k != "n_head"}, "has no 'n_head'"),
])
def test_config_that_is_not_a_dict_of_fields(config, words):
    one_line(config_from_dict, config, "ckpt.pt", match=words)


def test_config_errors_through_the_loader(tmp_path):
    message = one_line(load_model, NAIVE_MODELS, save(tmp_path / "c.pt", GOOD | {"n_head": 0}), match="n_head")
    assert str(tmp_path / "c.pt") in message


def test_a_training_only_config_means_infer_from_the_weights(tmp_path):
    """nanoGPT's 'config' (training settings) without model_args says nothing about the model."""
    path = save(tmp_path / "c.pt", {"learning_rate": 6e-4, "batch_size": 12})
    model, _ = load_model(NAIVE_MODELS, path, report=lambda _: None)
    assert (model.config.n_layer, model.config.n_embd, model.config.context_len) == (2, 32, 64)


def test_parameter_count_matches_the_model(config):
    """The memory estimate counts parameters from the config alone: it must be exact."""
    assert memory.parameter_count(config) == tiny_model(config, cls=GPT).num_params()


# ---------------------------------------------------------------------------- sizes

HUGE = [  # (change, what the line must say); each would allocate terabytes or take hours
    (dict(context_len=300_000), "300,000-position context"),
    (dict(n_layer=10 ** 9), "parameters"),
    (dict(vocab_size=10 ** 12), "parameters"),
    (dict(n_embd=2 ** 40, n_head=1), "parameters"),
]


@pytest.mark.parametrize("change, words", HUGE)
def test_sizes_that_would_exhaust_memory_are_refused_with_their_cost(change, words):
    message = one_line(config_from_dict, GOOD | change, "ckpt.pt", match="would need .* [KMGTPE]iB of memory")
    assert words in message and "is available" in message


def test_the_limit_follows_available_memory(monkeypatch):
    assert 0 < memory.available_memory()
    monkeypatch.setattr(memory, "available_memory", lambda: 10 ** 5)  # 100 KB left
    message = one_line(config_from_dict, GOOD, "ckpt.pt", match="would need")
    assert "97.7 KiB is available" in message and f"{memory.parameter_count(CONFIG):,} parameters" in message


def test_huge_configs_are_refused_without_allocating(tmp_path):
    """In a child process limited to 3 GB of address space (torch alone maps ~0.7 GB): had
    any of these been allocated, it would have died with an allocation error instead of
    printing the one line."""
    paths = []
    for i, (change, _) in enumerate(HUGE):
        paths.append(str(save(tmp_path / f"huge{i}.pt", GOOD | change)))
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
            f"sys.path.insert(0, {str(ROOT)!r})\n"
            "from plumbing.checkpoint import load_model\nfrom plumbing.script import CheckpointError\n"
            "from kv_cache import CACHED_MODELS\n"
            "for p in sys.argv[1:]:\n"
            "    try: load_model(CACHED_MODELS, p)\n"
            "    except CheckpointError as e: print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == len(HUGE) and all("would need" in line for line in lines), proc.stdout


def test_layers_are_counted_before_constructing_them(tmp_path, monkeypatch):
    """A config of 500 layers (fits in memory) with 2 layers of weights: refused from the
    key names, before 500 blocks are built."""
    def no_build(config):
        raise AssertionError("the model was constructed")
    state = tiny_model(CONFIG).state_dict()
    config = GPTConfig(**GOOD | {"n_layer": 500})
    one_line(build_model, {"gpt": no_build}, config, state, encoding_from_spec(byte_tokenizer_spec(), "t"),
             "ckpt.pt", match="missing key transformer.h.2.\\*")


def deflated(good, path, size):
    """A copy of the checkpoint `good` whose first tensor entry is `size` zero bytes,
    deflated (about 1000:1)."""
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(path, "w") as zout:
        for info in zin.infolist():
            if info.filename.endswith("/data/0"):
                zout.writestr(info.filename, b"\0" * size, compress_type=zipfile.ZIP_DEFLATED)
            else:
                zout.writestr(info, zin.read(info.filename))
    return path


def test_compressed_checkpoint_that_would_expand_too_far(tmp_path, monkeypatch):
    """Entries' uncompressed sizes come from the zip's directory and are refused before
    torch.load is called: a bomb (64 MB of zeros in a file under 1 MB), and an archive
    whose total would not fit in the memory left (simulated: enough for the file's bytes,
    not for the objects its pickle becomes)."""
    good = save(tmp_path / "good.pt")
    bomb = deflated(good, tmp_path / "bomb.pt", 64 << 20)
    assert bomb.stat().st_size < 1 << 20
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
    one_line(read_checkpoint, bomb, match="would expand from [0-9.]+ KiB to 64 MiB")
    monkeypatch.setattr(memory, "available_memory", lambda: good.stat().st_size + 1)
    one_line(read_checkpoint, good, match="unpacking this checkpoint .* would need")


# ---------------------------------------------------------------------------- weights

def with_tensor(key, change):
    state = dict(tiny_model(CONFIG).state_dict())
    state[key] = change(state[key].contiguous().clone())
    if key == "transformer.wte.weight":
        state["lm_head.weight"] = state[key]
    return state


def poke(value):
    def change(t):
        t.view(-1)[3] = value
        return t
    return change


@pytest.mark.parametrize("key, change, words", [
    ("transformer.h.0.attn.c_attn.weight", poke(float("nan")), "h.0.attn.c_attn.weight holds 1 NaN"),
    ("transformer.wte.weight", poke(float("inf")), "wte.weight holds 1 NaN or infinite"),
    ("transformer.ln_f.bias", poke(float("-inf")), "ln_f.bias holds 1"),
    ("transformer.ln_f.weight", lambda t: t.long(), "torch.int64"),
    ("transformer.ln_f.weight", lambda t: t.to(torch.complex64), "torch.complex64"),
    ("transformer.ln_f.weight", lambda t: t.to_sparse(), "dense floating-point"),
])
def test_bad_weight_values_are_named(tmp_path, key, change, words):
    path = save(tmp_path / "w.pt", state=with_tensor(key, change))
    one_line(load_model, CACHED_MODELS, path, match=words)


def test_finite_weights_whose_sum_overflows_are_fine():
    """The fast check sums each tensor; a sum that overflows must not be taken for a NaN."""
    check_values({"w": torch.full((4,), 3e38), "v": torch.full((8,), 6e4).half()}, "t")


def test_fp16_nan_is_caught():
    t = torch.zeros(10, dtype=torch.float16)
    t[7] = float("nan")
    one_line(check_values, {"w": t}, "t", match="w holds 1 NaN")


@pytest.mark.parametrize("state, words", [
    ({5: torch.zeros(1)}, "key 5 is not a string"),
    ({"transformer.ln_f.weight": "not a tensor"}, "is a str, not a tensor"),
    ({}, "empty"),
])
def test_state_dict_that_is_not_tensors(tmp_path, state, words):
    path = tmp_path / "s.pt"
    torch.save({"model": state, "config": GOOD, "tokenizer": byte_tokenizer_spec()}, path)
    one_line(load_model, NAIVE_MODELS, path, match=words)


def test_lm_head_that_differs_from_wte_is_refused(tmp_path):
    state = dict(tiny_model(CONFIG).state_dict())
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    one_line(load_model, NAIVE_MODELS, save(tmp_path / "t.pt", state=state), match="lm_head.weight differs")


def test_bare_state_dict_with_odd_shapes(tmp_path):
    path = tmp_path / "bare.pt"
    torch.save({"transformer.wte.weight": torch.zeros(10), "transformer.wpe.weight": torch.zeros(4, 8)}, path)
    one_line(load_model, NAIVE_MODELS, path, match="wte.weight has shape \\(10,\\)")


# ---------------------------------------------------------------------------- tokenizer specs

def spec(**change):
    return byte_tokenizer_spec() | change


BYTES = [bytes([i]) for i in range(256)]


@pytest.mark.parametrize("tokenizer, words", [
    ([1, 2], "the tokenizer entry is a list"),
    ({"vocab": 5}, "neither 'mergeable_ranks' nor 'encoding'"),
    ({k: v for k, v in spec().items() if k != "pat_str"}, "pat_str must be a non-empty regex"),
    (spec(pat_str="(unclosed"), "pat_str is not a usable regex"),
    (spec(pat_str="a*|\\S+|\\s+"), "matches empty text"),
    (spec(pat_str="[a-z]+"), "skips characters"),
    (spec(pat_str=5), "pat_str must be"),
    (spec(mergeable_ranks=[chr(i) for i in range(256)]), "list of non-empty bytes"),
    (spec(mergeable_ranks=list(range(256))), "list of non-empty bytes"),
    (spec(mergeable_ranks={b: i for i, b in enumerate(BYTES)}), "list of non-empty bytes"),
    (spec(mergeable_ranks=BYTES + [b"a"]), "lists token b'a' twice"),
    (spec(mergeable_ranks=BYTES[:128], special_tokens={"<|endoftext|>": 128}), "no token for byte 128"),
    (spec(special_tokens={}), "no <\\|endoftext\\|> token; add one"),
    (spec(special_tokens=[256]), "special_tokens must be a dict"),
    (spec(special_tokens={"<|endoftext|>": "256"}), "'256' is not a name and an integer id"),
    (spec(special_tokens={"<|endoftext|>": True}), "True is not a name"),
    (spec(special_tokens={"<|endoftext|>": -1}), "is not a name and an integer id >= 0"),
    (spec(special_tokens={"<|endoftext|>": 5}), "already the rank of an ordinary token"),
    (spec(special_tokens={"<|endoftext|>": 256, "<|x|>": 256}), "share an id"),
    (spec(special_tokens={"<|endoftext|>": 259}), "no token with id 256"),
    (spec(name=5), "name must be a string"),
    ({"encoding": 5}, "unknown tiktoken encoding 5"),
])
def test_bad_tokenizer_spec_is_named(tokenizer, words, capfd):
    one_line(encoding_from_spec, tokenizer, "ckpt.pt", match=words)
    assert "panicked" not in capfd.readouterr().err  # refused before tiktoken's Rust core saw it


def test_tokenizer_errors_through_the_loader(tmp_path):
    path = save(tmp_path / "t.pt", tokenizer=spec(special_tokens={}))
    one_line(load_model, NAIVE_MODELS, path, match="no <\\|endoftext\\|>")


def test_slow_pattern_is_refused(monkeypatch):
    monkeypatch.setattr("plumbing.tokenizer.PATTERN_TIMEOUT_S", 1e-9)
    one_line(encoding_from_spec, spec(), "t", match="TimeoutError")


def test_good_spec_round_trips_everything():
    enc = encoding_from_spec(spec(), "t")
    text = ROUND_TRIP_SAMPLE + "\U0010ffff"
    assert enc.decode(enc.encode_ordinary(text)) == text and enc.eot_token == 256


# ---------------------------------------------------------------------------- HF tokenizer files

def char(b):
    from plumbing.hf_tokenizer import byte_to_char
    return byte_to_char()[b]


def hf_vocab(extra=()):
    """GPT-2-style vocab: the 256 byte characters, merges (h e) and (Ġ t), then EOT."""
    vocab = {char(b): b for b in range(256)}
    for token in ["he", "Ġt", *extra]:
        vocab[token] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return vocab


MERGES = [["h", "e"], ["Ġ", "t"]]


def test_consistent_bpe_files_load():
    enc = encoding_from_bpe(hf_vocab(), MERGES, set(), "tiny", "dir")
    assert enc.encode_ordinary("he") == [256]
    assert enc.decode(enc.encode_ordinary("he t he")) == "he t he" and enc.eot_token == 258
    assert enc.encode_ordinary(" t") == [257]


@pytest.mark.parametrize("vocab, merges, specials, words", [
    (hf_vocab(["hello"]), MERGES, set(), "'hello' \\(id 258\\) is made by no merge"),
    (hf_vocab(), MERGES + [["x", "y"]], set(), "makes 'xy', which is not in the vocabulary"),
    (hf_vocab(), MERGES + [["h", "zz"]], set(), "uses or makes 'zz'"),
    (hf_vocab(), MERGES + [["h", "e"]], set(), "two merges make 'he'"),
    (hf_vocab(), MERGES[::-1], set(), "not numbered in merge order"),
    (hf_vocab(), MERGES + [["h", "e", "l"]], set(), "is not two tokens"),
    (hf_vocab(), MERGES + [[1, 2]], set(), "is not two tokens"),
    (hf_vocab() | {"dup": 3}, MERGES, set(), "share an id"),
    ({k: v for k, v in hf_vocab().items() if k != "!"}, MERGES, set(), "no token for byte 33"),
    ([1, 2], MERGES, set(), "must map token strings to ids"),
    (hf_vocab() | {"x": -1}, MERGES, set(), "must map token strings to ids >= 0"),
    ({k: v for k, v in hf_vocab().items() if k != "<|endoftext|>"}, MERGES, set(), "no <\\|endoftext\\|>"),
])
def test_bpe_files_that_do_not_fit_together(vocab, merges, specials, words):
    one_line(encoding_from_bpe, vocab, merges, specials, "tiny", "dir", match=words)


def test_declared_special_tokens_are_accepted():
    vocab = hf_vocab() | {"<pad>": 259}
    enc = encoding_from_bpe(vocab, MERGES, {"<pad>"}, "tiny", "dir")
    assert enc.n_vocab == 260


def test_hf_dir_with_bad_tokenizer_json(tmp_path):
    one_line(parse_tokenizer_json, [1, 2], "tokenizer.json", match="not GPT-2's byte-level BPE")
    tok = {"model": {"type": "BPE", "vocab": hf_vocab(), "merges": ["h e"]},
           "pre_tokenizer": {"type": "ByteLevel"}, "added_tokens": [{"id": "x"}]}
    one_line(parse_tokenizer_json, tok, "tokenizer.json", match="added_tokens must be")


# ---------------------------------------------------------------------------- property tests

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

# JSON-like values and what a pickle may also hold (bytes), nested a little
LEAVES = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=True)
          | st.text(max_size=8) | st.binary(max_size=4))
VALUES = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def only_checkpoint_errors(call, *args):
    """call(*args) returns, or raises a one-line CheckpointError: nothing else escapes."""
    try:
        return call(*args)
    except CheckpointError as e:
        assert str(e) and "\n" not in str(e)


def one_part_changed(good, parts):
    """`good` (a dict) as it is, or with one key dropped or its value replaced by any draw
    from parts[key]: every hostile single change, and the valid original among them."""
    def change(key, value, drop):
        if key is None:
            return dict(good)
        return {k: v for k, v in good.items() if k != key} if drop else good | {key: value}
    return st.sampled_from([None, *parts]).flatmap(
        lambda key: st.builds(change, st.just(key), parts[key] if key else st.none(), st.booleans()))


CONFIG_PARTS = {**{name: st.integers(-1, 64) | VALUES for name in SHAPE_FIELDS},
                "dropout": st.floats(-1, 2) | VALUES, "bias": st.booleans() | VALUES}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(VALUES | one_part_changed(GOOD, CONFIG_PARTS))
def test_any_config_value_is_a_config_or_one_line(value):
    config = only_checkpoint_errors(config_from_dict, value, "ckpt.pt")
    assert config is None or isinstance(config, GPTConfig)


def offline(name):
    raise ConnectionError("no network in tests")


GOOD_SPEC = byte_tokenizer_spec()
SPEC_PARTS = {
    "mergeable_ranks": (st.lists(st.binary(min_size=1, max_size=3), max_size=300) | VALUES
                        | st.lists(st.binary(min_size=2, max_size=3), max_size=8).map(
                            lambda extra: GOOD_SPEC["mergeable_ranks"] + extra)),
    "pat_str": st.sampled_from(["", "a*", "(", ".", r"\S+|\s+", r"\w+|\W", r"(?=a)|\S+|\s+"]) | VALUES,
    "special_tokens": st.dictionaries(st.text(max_size=14), st.integers(-2, 300) | VALUES, max_size=3) | VALUES,
    "name": VALUES,
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(VALUES | one_part_changed(GOOD_SPEC, SPEC_PARTS))
def test_any_tokenizer_spec_is_an_encoding_or_one_line(value):
    with mock.patch.object(tiktoken, "get_encoding", offline):  # a spec naming gpt2 must not download
        enc = only_checkpoint_errors(encoding_from_spec, value, "ckpt.pt")
    if enc is not None:  # whatever was accepted round-trips and decodes every id
        assert enc.decode(enc.encode_ordinary("héllo 🎭 x")) == "héllo 🎭 x"
        assert all(enc.decode_single_token_bytes(i) for i in range(enc.n_vocab))


GOOD_TOKENIZER_JSON = {"model": {"type": "BPE", "vocab": hf_vocab(), "merges": ["h e", "Ġ t"]},
                       "pre_tokenizer": {"type": "ByteLevel"},
                       "added_tokens": [{"id": 258, "content": "<|endoftext|>"}]}
TOKENIZER_JSON_PARTS = {
    "model": one_part_changed(GOOD_TOKENIZER_JSON["model"], {
        "type": VALUES, "vocab": VALUES | st.dictionaries(st.text(max_size=3), st.integers(-1, 300)),
        "merges": st.lists(VALUES | st.text(max_size=5), max_size=4)}),
    "pre_tokenizer": VALUES, "added_tokens": VALUES,
}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(VALUES | one_part_changed(GOOD_TOKENIZER_JSON, TOKENIZER_JSON_PARTS))
def test_any_tokenizer_json_is_an_encoding_or_one_line(value):
    def load(tok):
        vocab, merges, specials, _ = parse_tokenizer_json(tok, "tokenizer.json")
        return encoding_from_bpe(vocab, merges, specials, "t", "tokenizer.json")
    enc = only_checkpoint_errors(load, value)
    if enc is not None:
        assert enc.decode(enc.encode_ordinary("he the 🎭")) == "he the 🎭"


def test_hf_config_json_values(tmp_path):
    """config.json fields through the same checks (names as config.json spells them)."""
    from plumbing.hf import read_config
    base = {"model_type": "gpt2", "n_positions": 64, "vocab_size": 300, "n_layer": 2, "n_head": 4, "n_embd": 32}
    for change, words in [({"n_embd": 32.0}, "n_embd must be a positive integer"),
                          ({"n_positions": 0}, "n_positions must be"), ({"n_head": 0}, "n_head must be"),
                          ({"n_positions": 10 ** 6}, "would need"), ({"n_layer": None}, "n_layer must be")]:
        (tmp_path / "config.json").write_text(json.dumps(base | change))
        one_line(read_config, tmp_path, match=words)
    (tmp_path / "config.json").write_text("[1, 2]")
    one_line(read_config, tmp_path, match="holds a list")
    (tmp_path / "config.json").write_text("[" * 100000 + "]" * 100000)
    one_line(read_config, tmp_path, match="not readable JSON")
    (tmp_path / "config.json").write_text(json.dumps(base | {"pad": "x" * (2 << 20)}))
    one_line(read_config, tmp_path, match="too large for a config.json")


def test_input_paths(tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "file").write_text("x")
    one_line(read_checkpoint, tmp_path / "loop", match="Too many levels of symbolic links")
    one_line(read_checkpoint, tmp_path / "file" / "x.pt", match="cannot read it \\(Not a directory\\)")
    one_line(read_checkpoint, "", match="empty path")
    one_line(read_checkpoint, "/dev/null", match="not a regular file")
    one_line(read_checkpoint, tmp_path / ("x" * 300), match="File name too long")
