"""The cache changes how logits are computed, never what they are.

Tolerance: 1e-4 absolute on fp32 logits. Feeding tokens one at a time runs the same
arithmetic as one full forward, but in differently shaped matmuls, so rounding differs
(observed ~1e-6 here, growing slowly with depth). A wrong position offset or mask row
moves logits by O(0.1..1), so 1e-4 leaves 100x headroom and still catches every such bug."""

import pytest
import torch

from base_model import GPT, GPTConfig
from conftest import tiny_model
from generation.loop import Generation, GenerationStats, generate_tokens
from kv_cache import ConcatCache, KVCache
from kv_quant import cache_bytes

ATOL = 1e-4


def feed(model, idx, chunks, kind):
    """Feed idx through the cache in pieces of the given sizes; returns all logits, cache.
    kind "list" is the seed's form: None in, per-layer (k, v) out (a ConcatCache, which reads
    as that list)."""
    cache = None if kind == "list" else model.new_cache(idx.size(0), kind)
    pieces, start = [], 0
    for size in chunks:
        logits, cache = model(idx[:, start:start + size], cache)
        pieces.append(logits)
        start += size
    assert start == idx.size(1)
    return torch.cat(pieces, dim=1), cache


@pytest.mark.parametrize("kind", ["list", "cat", None], ids=["list", "cat", "prealloc"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("chunks", [[1] * 20, [5, 5, 5, 5], [7, 1, 12], [20]],
                         ids=["token-by-token", "chunks-of-5", "uneven", "one-pass"])
def test_incremental_matches_full_forward(config, kind, batch, chunks):
    model = tiny_model(config)
    idx = torch.randint(config.vocab_size, (batch, 20))
    full, _ = model(idx)
    incremental, cache = feed(model, idx, chunks, kind)
    assert incremental.shape == full.shape
    assert (full - incremental).abs().max().item() < ATOL


def test_whole_context_through_cache(config):
    # the last position of the window: the sliced mask's final row and the last wpe entry
    model = tiny_model(config)
    idx = torch.randint(config.vocab_size, (2, config.context_len))
    full, _ = model(idx)
    half = config.context_len // 2
    incremental, _ = feed(model, idx, [half, 3] + [1] * (config.context_len - half - 3), None)
    assert (full - incremental).abs().max().item() < ATOL


@pytest.mark.parametrize("kind", ["list", "cat", None], ids=["list", "cat", "prealloc"])
def test_present_kv_layout(config, kind):
    model = tiny_model(config)
    _, cache = feed(model, torch.randint(config.vocab_size, (2, 9)), [4, 5], kind)
    # the seed's contract: per-layer (k, v) out, whatever went in
    assert isinstance(cache, ConcatCache if kind in ("list", "cat") else KVCache)
    assert len(cache) == config.n_layer
    for k, v in (cache[i] for i in range(config.n_layer)):
        assert k.shape == v.shape == (2, config.n_head, 9, config.head_dim)


def test_cache_bytes_equal_formula(config):
    model = tiny_model(config)
    _, cache = feed(model, torch.randint(config.vocab_size, (3, 11)), [6, 5], "list")
    assert cache.nbytes() == cache_bytes(config, 11, batch_size=3, kv_dtype="float32")
    prealloc = KVCache(config, batch_size=2, dtype=torch.bfloat16)
    assert prealloc.nbytes() == cache_bytes(config, config.context_len, 2, kv_dtype="bfloat16")


def test_overlong_input_raises(config):
    model = tiny_model(config)
    with pytest.raises(ValueError, match="context_len"):
        model(torch.zeros(1, config.context_len + 1, dtype=torch.long))
    _, cache = feed(model, torch.zeros(1, config.context_len, dtype=torch.long), [config.context_len], None)
    with pytest.raises(ValueError, match="context_len"):
        model(torch.zeros(1, 1, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="context_len"):
        GPT.forward(model, torch.zeros(1, config.context_len + 1, dtype=torch.long))


LONG = GPTConfig(context_len=160, vocab_size=260, n_layer=2, n_head=2, n_embd=32)


@pytest.mark.parametrize("kind", ["cat", None], ids=["cat", "prealloc"])
def test_greedy_cached_equals_naive_for_120_tokens(kind):
    # exact token equality: 1e-6 logit noise could only flip an argmax at a near-tie,
    # which these fixed seeds do not contain (and would show as a one-token divergence)
    cached = tiny_model(LONG, seed=5)
    naive = GPT(LONG).eval()
    naive.load_state_dict(cached.state_dict())
    prompt = torch.randint(LONG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    expected = naive.generate(prompt, 120, temperature=0)
    got = torch.cat([prompt, generate_tokens(cached, prompt, 120, temperature=0, cache_kind=kind)], 1)
    assert got.shape == (2, 128)
    assert torch.equal(got, expected)
    assert torch.equal(cached.generate(prompt, 120, temperature=0), expected)


def test_same_seed_same_samples_cached_or_not():
    cached = tiny_model(LONG, seed=6)
    naive = GPT(LONG).eval()
    naive.load_state_dict(cached.state_dict())
    prompt = torch.randint(LONG.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    runs = [m.generate(prompt, 60, temperature=1.0, top_k=50,
                       generator=torch.Generator().manual_seed(42)) for m in (cached, naive, cached)]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


def test_stream_counts_one_pass_per_token():
    model = tiny_model(LONG, seed=7)
    stats = GenerationStats()
    tokens = list(Generation(model, torch.zeros(1, 10, dtype=torch.long), 30, temperature=0, stats=stats))
    assert len(tokens) == 30
    # one prefill of the 10-token prompt, then one position per step (the last token needs none)
    assert stats.forward_passes == 30 and stats.positions_processed == 10 + 29
    naive_stats = GenerationStats()
    list(GPT.stream(model, torch.zeros(1, 10, dtype=torch.long), 30, temperature=0, stats=naive_stats))
    assert naive_stats.positions_processed == sum(range(10, 40))  # O(T^2): the whole context


@pytest.mark.parametrize("kind", ["cat", None], ids=["cat", "prealloc"])
def test_num_samples_share_one_prefill(kind):
    model = tiny_model(LONG, seed=8)
    prompt = torch.randint(LONG.vocab_size, (1, 12))
    stats = GenerationStats()
    rows = generate_tokens(model, prompt, 20, temperature=0, stats=stats, num_samples=3,
                                       cache_kind=kind)
    assert rows.shape == (3, 20) and stats.prefill_passes == 1
    single = model.generate(prompt, 20, temperature=0)[:, 12:]
    assert all(torch.equal(row, single[0]) for row in rows)  # greedy: every sample the same


def reference_sliding(model, prompt, n, keep):
    """The overflow policy, computed naively: when the context exceeds context_len, keep
    its newest `keep` tokens and run them from position 0."""
    ctx, out = prompt, []
    for _ in range(n):
        token = GPT.forward(model, ctx)[0][:, -1].argmax(-1, keepdim=True)
        out.append(token)
        ctx = torch.cat([ctx, token], 1)
        if ctx.size(1) > model.config.context_len:
            ctx = ctx[:, -keep:]
    return torch.cat(out, 1)


@pytest.mark.parametrize("kind", ["cat", None], ids=["cat", "prealloc"])
def test_generation_past_context_len(kind):
    config = GPTConfig(context_len=32, vocab_size=260, n_layer=2, n_head=2, n_embd=32)
    model = tiny_model(config, seed=9)
    prompt = torch.randint(config.vocab_size, (2, 40))  # longer than the context, too
    stats = GenerationStats()
    n = 10 * config.context_len
    got = generate_tokens(model, prompt, n, temperature=0, stats=stats,
                                      cache_kind=kind)
    assert got.shape == (2, n) and stats.reprefills >= n // (config.context_len // 2) - 1
    assert torch.equal(got, reference_sliding(model, prompt[:, -32:], n, keep=16))


@pytest.mark.parametrize("context_len", [1, 2, 3])
@pytest.mark.parametrize("kind", ["cat", None], ids=["cat", "prealloc"])
def test_degenerate_contexts_follow_the_same_policy(context_len, kind):
    # keep = max(1, context_len // 2): a 1-token context reprefills nothing, every step
    config = GPTConfig(context_len=context_len, vocab_size=260, n_layer=2, n_head=2, n_embd=32)
    model = tiny_model(config, seed=10)
    prompt = torch.randint(config.vocab_size, (2, context_len))
    got = generate_tokens(model, prompt, 20, temperature=0, cache_kind=kind)
    assert torch.equal(got, reference_sliding(model, prompt, 20, keep=max(1, context_len // 2)))
