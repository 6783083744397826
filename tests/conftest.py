"""Shared fixtures: tiny models (fast on 2 cores) and a byte-level tokenizer, so the tests
need neither the network nor the bundled checkpoint unless they are about it."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from base_model import GPTConfig  # noqa: E402
from checkpoint import save_checkpoint  # noqa: E402
from kv_cache import KVCacheGPT  # noqa: E402
from validation import encoding_from_spec  # noqa: E402

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Small shapes that still cover what matters: several heads, a non-power-of-two head count,
# no biases, a context short enough to overflow in tests.
TINY_CONFIGS = [
    GPTConfig(block_size=64, vocab_size=260, n_layer=2, n_head=4, n_embd=32),
    GPTConfig(block_size=48, vocab_size=300, n_layer=3, n_head=3, n_embd=48, bias=False),
]


def byte_tokenizer_spec():
    """Every byte is a token, plus <|endoftext|>: round-trips any text, needs no training."""
    return {"name": "bytes", "pat_str": GPT2_PATTERN,
            "mergeable_ranks": [bytes([i]) for i in range(256)],
            "special_tokens": {"<|endoftext|>": 256}}


def byte_tokenizer():
    """byte_tokenizer_spec as a tiktoken Encoding, through the loaders' own validation."""
    return encoding_from_spec(byte_tokenizer_spec(), "bytes")


def tiny_model(config, seed=0, cls=KVCacheGPT):
    torch.manual_seed(seed)
    return cls(config).eval()


@pytest.fixture(params=range(len(TINY_CONFIGS)), ids=["4heads", "3heads-nobias"])
def config(request):
    return TINY_CONFIGS[request.param]


@pytest.fixture
def tiny_ckpt(tmp_path):
    """A checkpoint file of a tiny random model carrying the byte tokenizer."""
    path = tmp_path / "tiny.pt"
    save_checkpoint(path, tiny_model(TINY_CONFIGS[0]), byte_tokenizer_spec())
    return path
