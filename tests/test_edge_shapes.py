"""Degenerate but valid shapes: a context of 1 to 3 positions, zero new tokens. Scoring
terminates and is right; generation goes on past the context; zero new tokens are the
prompt. (A context of 0 positions, which made --score loop forever, is refused at load:
test_validation.py.)"""

import math

import pytest
import torch

from base_model import GPT, GPTConfig
from generation.loop import GenerationStats, generate_tokens
from conftest import byte_tokenizer_spec, tiny_model
from plumbing.scoring import score
from kv_cache import KVCacheGPT
from plumbing.tokenizer import encoding_from_spec

TOKENIZER = encoding_from_spec(byte_tokenizer_spec(), "bytes")
TEXT = "To be, or not to be: that is the question."


def tiny(context_len, cls=KVCacheGPT):
    return tiny_model(GPTConfig(context_len=context_len, vocab_size=260, n_layer=1, n_head=2, n_embd=16), cls=cls)


@torch.no_grad()
def test_score_with_a_one_position_context():
    """Each window is one token, predicting the next from it alone. Reference: token by
    token (tolerance 1e-4 nats: the same fp32 losses, summed in another order)."""
    model = tiny(1)
    result = score(model, TOKENIZER, TEXT, torch.device("cpu"))
    ids = [TOKENIZER.eot_token] + TOKENIZER.encode_ordinary(TEXT)
    nats = sum(torch.nn.functional.cross_entropy(model(torch.tensor([[a]]))[0][0], torch.tensor([b])).item()
               for a, b in zip(ids, ids[1:]))
    assert result["tokens"] == len(ids) - 1
    assert math.isclose(result["nats_per_token"] * result["tokens"], nats, abs_tol=1e-4)


@pytest.mark.parametrize("context_len", [2, 3])
def test_score_with_tiny_contexts_is_finite(context_len):
    result = score(tiny(context_len), TOKENIZER, TEXT, torch.device("cpu"))
    assert result["tokens"] == len(TEXT) and math.isfinite(result["nats_per_token"])


@pytest.mark.parametrize("context_len", [1, 2, 3])
def test_generation_past_a_tiny_context(context_len):
    """12 greedy tokens past a context of 1-3 positions: the cached loop reprefills each
    time its context fills and keeps going. With one position, every step sees only the
    newest token, exactly as the naive loop does, so the two must agree."""
    model, prompt, stats = tiny(context_len), torch.tensor([[TOKENIZER.eot_token]]), GenerationStats()
    tokens = generate_tokens(model, prompt, 12, temperature=0, stats=stats)
    assert tokens.shape == (1, 12) and 0 <= tokens.min() and tokens.max() < 260
    assert stats.reprefills > 0
    if context_len == 1:
        naive = list(tiny(1, cls=GPT).stream(prompt, 12, temperature=0))
        assert tokens.tolist() == torch.cat(naive, dim=1).tolist()


def test_zero_new_tokens_returns_the_prompts():
    """generate(idx, 0) is idx, as the naive model's is, for a batch of two, without a
    forward pass; a negative count is refused in one line."""
    model, stats = tiny(8), GenerationStats()
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert torch.equal(model.generate(prompt, 0, temperature=0, stats=stats), prompt)
    assert torch.equal(tiny(8, cls=GPT).generate(prompt, 0, temperature=0), prompt)
    assert stats.forward_passes == 0
    for naive_or_cached in (model, tiny(8, cls=GPT)):
        with pytest.raises(ValueError, match="max_new_tokens must be >= 0, got -1"):
            naive_or_cached.generate(prompt, -1)
