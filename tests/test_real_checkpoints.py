"""Real checkpoints, lean: what benchmarks.real_size writes loads as a bf16 Hugging Face
directory; the finiteness check reads a bf16 table in chunks (no float32 copy of it) and
still finds a NaN in the last chunk; bf16 Linear weights stay in the file's row-major layout;
the loading progress line shows on a terminal only; the memory check sizes the run's own
format; export_gguf's bf16 holds bf16's values. Tiny shapes: a few seconds each."""

import io
import time

import pytest
import torch

from base_model import store_linears_column_major
from benchmarks.real_size import SHAPES, write_random_hf_dir
from kv_cache import CACHED_MODELS
from plumbing.checkpoint import check_values
from plumbing.hf import load_hf_model
from plumbing.memory import model_memory
from plumbing.progress import Progress
from plumbing.ticker import Ticker
from plumbing.script import CheckpointError


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("real-size") / "hf"
    write_random_hf_dir(SHAPES["tiny"], folder)
    return folder


def test_random_directory_loads_in_bfloat16_as_the_file_holds_it(tiny_dir):
    model, tokenizer = load_hf_model(CACHED_MODELS, tiny_dir, dtype="auto", report=lambda line: None,
                                     quantize="int4")
    assert model.lm_head.weight.dtype == torch.bfloat16  # auto + quantize: the file's bf16
    assert model.config.n_layer == SHAPES["tiny"].n_layer and tokenizer.n_vocab == 258
    model, _ = load_hf_model(CACHED_MODELS, tiny_dir, dtype=torch.bfloat16, report=lambda line: None)
    store_linears_column_major(model)
    assert model.model.layers[0].mlp.up_proj.weight.is_contiguous()  # bf16 stays row-major
    fp32, _ = load_hf_model(CACHED_MODELS, tiny_dir, dtype=torch.float32, report=lambda line: None)
    store_linears_column_major(fp32)
    assert fp32.model.layers[0].mlp.up_proj.weight.t().is_contiguous()  # fp32: column-major


def test_random_directory_loads_in_transformers_with_our_logits(tiny_dir):
    # the directory is a Hugging Face one for its peers too (CTranslate2's and OpenVINO's
    # converters load it through transformers, which refuses a shard index without its
    # metadata.total_size); the same weights give the same logits, within fp32's rounding
    # of two implementations' different operation orders
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    ours, _ = load_hf_model(CACHED_MODELS, tiny_dir, dtype=torch.float32, report=lambda line: None)
    ids = torch.tensor([[5, 17, 42, 99, 3, 200]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)[0], theirs(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("-inf"), float("inf")])
def test_one_value_not_finite_anywhere_is_found(dtype, bad):
    table = torch.randn(50, 70).to(dtype)
    check_values({"t": table, "empty": torch.empty(0, dtype=dtype)}, "file")
    for at in [(0, 0), (25, 33), (-1, -1)]:  # first, middle and last value
        damaged = table.clone()
        damaged[at] = bad
        with pytest.raises(CheckpointError, match="t holds 1 NaN or infinite value"):
            check_values({"t": damaged}, "file")


class FakeTerminal(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


@pytest.mark.parametrize("tty, shown, writes", [(True, True, True), (False, True, False), (True, False, False)])
def test_progress_line_only_on_a_terminal(monkeypatch, tty, shown, writes):
    monkeypatch.setattr("plumbing.progress.REFRESH_SECONDS", 0.0)
    stream = FakeTerminal(tty)
    with Progress("loading x", 3 * 2**30, shown, stream) as progress:
        progress.advance(2**30)
    text = stream.getvalue()
    assert ("loading x: 1 GiB of 3 GiB (33%)" in text) == writes
    assert text.endswith("\r\033[K") == writes  # cleared at the end
    assert writes or text == ""



def test_progress_says_where_ctrl_c_stopped_it():
    stream = FakeTerminal(False)  # on any stream: an interruption is news
    with pytest.raises(KeyboardInterrupt):
        with Progress("loading x", 3 * 2**30, True, stream) as progress:
            progress.advance(2**30)
            raise KeyboardInterrupt
    assert stream.getvalue() == "loading x: interrupted after 1 GiB of 3 GiB, 0 s\n"


@pytest.mark.parametrize("tty", [True, False])
def test_ticker_counts_seconds_only_on_a_terminal(tty):
    stream = FakeTerminal(tty)
    with Ticker("building", stream, every=0.01):
        time.sleep(0.2)
    text = stream.getvalue()
    assert ("\rbuilding: 0 s\033[K" in text and text.endswith("\r\033[K")) == tty
    assert tty or text == ""
    with pytest.raises(KeyboardInterrupt):
        with Ticker("building", stream, every=0.01):
            raise KeyboardInterrupt
    assert stream.getvalue().endswith("building: interrupted after 0 s\n")

def test_memory_check_sizes_the_runs_format():
    c = SHAPES["8b"]
    fp32, _ = model_memory(c, "float32", "float32")
    int4, what = model_memory(c, "int4", "bfloat16")
    assert fp32 > 32e9 and 6e9 < int4 < 8e9 and "in int4" in what


def test_gguf_bf16_holds_the_bf16_values():
    gguf = pytest.importorskip("gguf")
    from export_gguf import encode_tensor
    weight = torch.randn(4, 64)
    data, kind = encode_tensor("blk.0.ffn_up.weight", weight.numpy(), "bf16", gguf)
    assert kind == gguf.GGMLQuantizationType.BF16
    # bfloat16 is float32's top half: the file's bytes, widened back, are torch's rounding exactly
    back = torch.from_numpy(data.copy()).view(torch.bfloat16).reshape(4, 64)
    assert torch.equal(back, weight.to(torch.bfloat16))
