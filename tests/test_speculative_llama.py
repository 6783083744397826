"""Speculative decoding (generation/speculative.py) on the Llama family (kv_cache.KVCacheLlama):
rotary keys cached after rotation, n_kv_head heads, and the sinks policy past the context.

Rollback only forgets columns: a kept key's position (its column less its row's padding)
is the same after a row moves right, so no key is turned again; the tests below hold that
to a cache that never saw the forgotten tokens (1e-4, fp32: the same math batched
differently) and to plain decoding's greedy tokens (exactly: random weights with spread-out
logits, no near-ties). A draft's family is its own: a GPT-2-style draft proposes for a
Llama-style model when the tokenizer is the same."""

import json

import pytest
import torch

from base_model import GPTConfig
from conftest import byte_tokenizer_spec, run_script, spread_out, tiny_model
from generation.loop import GenerationStats, generate_tokens, left_pad
from generation.rows import Rows
from generation.speculative import DraftModel, PromptLookup
from kv_cache import KVCacheLlama
from llama import LlamaConfig
from plumbing.checkpoint import BUNDLED_LLAMA, save_checkpoint
from test_speculative import assert_speculation_keeps_the_text

ATOL = 1e-4
GQA = LlamaConfig(context_len=48, vocab_size=260, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                  intermediate_size=48, rope_theta=500.0)
MQA = LlamaConfig(context_len=48, vocab_size=260, n_layer=2, n_head=4, n_kv_head=1, n_embd=32,
                  intermediate_size=48, qk_norm=True)
LLAMA_DRAFT = LlamaConfig(context_len=24, vocab_size=260, n_layer=1, n_head=2, n_kv_head=1,
                          n_embd=16, intermediate_size=32)
GPT_DRAFT = GPTConfig(context_len=24, vocab_size=260, n_layer=1, n_head=2, n_embd=16)


def tiny_llama(config=GQA, seed=0):
    return spread_out(tiny_model(config, seed, KVCacheLlama), 0.3)


def prompts():
    """Different lengths (left padding, so rollbacks move rows right), one repeating (prompt
    lookup finds much there)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(256, (n,), generator=g).tolist() for n in (1, 9, 30)] + [[7, 8, 9, 10] * 5]


def proposer(name, model):
    return {"lookup": lambda: PromptLookup(3),
            "llama-draft": lambda: DraftModel(tiny_llama(LLAMA_DRAFT, seed=5)),
            "gpt-draft": lambda: DraftModel(tiny_model(GPT_DRAFT, seed=6)),
            "self-draft": lambda: DraftModel(model)}[name]()


@pytest.mark.parametrize("config, name, kind", [(GQA, "lookup", None), (GQA, "lookup", "cat"),
                                                (GQA, "self-draft", None), (GQA, "gpt-draft", None),
                                                (MQA, "llama-draft", None), (MQA, "lookup", "bfloat16")],
                         ids=["gqa-lookup", "gqa-lookup-cat", "gqa-self", "gqa-gpt-draft",
                              "mqa-llama-draft", "mqa-lookup-bf16"])
@pytest.mark.parametrize("policy", ["reprefill", "sinks"])
def test_greedy_equals_plain_on_a_llama(config, name, kind, policy):
    """150 tokens past the 48-token context, each row reprefilling or evicting at its own
    steps: the same tokens with and without speculation. With sinks, once a row's context
    is full each step frees one column only, so a step there checks no proposals (a wider
    one would show its first token a window plain decoding never shows it)."""
    model = tiny_llama(config, seed=1)
    options = dict(temperature=0, cache_kind=kind, context_policy=policy)
    plain = generate_tokens(model, prompts(), 150, **options)
    stats = GenerationStats()
    fast = generate_tokens(model, prompts(), 150, speculate=4, proposer=proposer(name, model),
                           stats=stats, **options)
    assert torch.equal(fast, plain)
    assert stats.accepted <= stats.proposed and stats.proposed > 0
    if policy == "reprefill":
        assert stats.accepted > 0 and stats.reprefills > 0
    else:  # proposals stop once the longest row is full (random tokens: few accepted before)
        assert stats.evictions > 0 and stats.reprefills == 0
    if name == "self-draft":  # within the context the model agrees with itself every time
        within = GenerationStats()  # (past it, the draft restarts from windows of its own)
        generate_tokens(model, prompts(), 17, speculate=4, proposer=DraftModel(model), stats=within,
                        **options)
        assert within.accepted == within.proposed > 0


@pytest.mark.parametrize("kind", ["cat", None, "int8"])
def test_rollback_per_row_keeps_rotated_keys_where_they_are(kind):
    """Rows of a padded batch roll back by different amounts (rows move right, their
    padding grows): what follows gives each row the logits of a cache that never saw the
    forgotten tokens, so every kept key still has its position's rotation."""
    model = tiny_llama(seed=2)
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(256, (n,), generator=g).tolist() for n in (3, 9, 6)]
    extra = torch.randint(256, (3, 5), generator=g)
    keep = [5, 1, 3]                     # of the 5 extra tokens, per row
    after = torch.randint(256, (3, 2), generator=g)
    tokens, pad = left_pad(rows, model.config.context_len, "cpu")
    batch = Rows(model.new_cache(3, kind, pad), 3, model.config.context_len, "cpu")
    with torch.no_grad():
        model(tokens, batch.cache)
        model(extra, batch.cache)
        batch.rollback(torch.tensor([len(r) + k for r, k in zip(rows, keep)]))
        assert batch.cache.pad.tolist() == [6 + 0, 0 + 4, 3 + 2]  # rows 1 and 2 moved right
        logits = model(after, batch.cache)[0]
        for b in range(3):
            alone = model.new_cache(1, kind)
            model(torch.tensor([rows[b] + extra[b, :keep[b]].tolist()]), alone)
            expected = model(after[b:b + 1], alone)[0]
            assert (logits[b] - expected[0]).abs().max() < ATOL


def test_compiled_verification_on_a_llama(builds):
    """The compiled step (its exported graph: the `builds` fixture) with K + 1 = 5 tokens per
    row: rotary angles for 5 positions per row, n_kv_head heads read in groups; the Llama
    draft's one-token step a program of its own. The eager loop's tokens."""
    model = tiny_llama(seed=1)
    plain = generate_tokens(model, prompts(), 100, temperature=0)
    stats = GenerationStats()
    fast = generate_tokens(model, prompts(), 100, temperature=0, compile=True, speculate=4,
                           proposer=proposer("llama-draft", model), stats=stats)
    assert torch.equal(fast, plain)
    assert len(builds) == 2 and stats.accepted > 0
    assert [b.sampling for b in builds] == [None, None]  # both hand back logits


# ---------------------------------------------------------------------------- the command

@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec-llama")
    save_checkpoint(d / "llama.pt", tiny_llama(seed=1), byte_tokenizer_spec())
    save_checkpoint(d / "gpt-draft.pt", tiny_model(GPT_DRAFT, seed=6), byte_tokenizer_spec())
    save_checkpoint(d / "llama-draft.pt", tiny_llama(LLAMA_DRAFT, seed=5), byte_tokenizer_spec())
    return d


@pytest.mark.parametrize("draft", ["gpt-draft.pt", "llama-draft.pt"])
def test_generate_py_llama_with_a_draft_of_either_family_and_sinks(ckpts, draft):
    """generate.py on a Llama checkpoint: a draft of either family (each built by its own
    checkpoint's class), past the context with --context-policy sinks: the same text as
    without speculation."""
    args = ["--ckpt", ckpts / "llama.pt", "--prompt", "abc", "--prompt", "hello world",
            "--temperature", "0", "--max-new-tokens", "120", "--ignore-eot", "--json",
            "--context-policy", "sinks"]
    plain = run_script("generate.py", *args)
    fast = run_script("generate.py", *args, "--speculate", "3", "--draft", ckpts / draft)
    assert plain.returncode == fast.returncode == 0, fast.stderr
    assert "loaded draft" in fast.stderr
    plain, fast = json.loads(plain.stdout), json.loads(fast.stdout)
    assert fast["texts"] == plain["texts"]
    assert fast["stats"]["evictions"] > 0 and fast["stats"]["speculative"]["proposed"] > 0


def test_the_bundled_llama_model_with_the_bundled_draft():
    """The bundled pair for the Llama-style model: checkpoints/shakespeare-llama as the
    target, checkpoints/shakespeare-draft (GPT-2-style, the same tokenizer: there is no
    Llama-style draft) proposing; greedy text equal to plain decoding's, in fewer passes."""
    draft = BUNDLED_LLAMA.parent.parent / "shakespeare-draft" / "ckpt.pt"
    args = ["--ckpt", BUNDLED_LLAMA, "--prompt", "ROMEO:", "--prompt", "First Witch:",
            "--temperature", "0", "--max-new-tokens", "48", "--ignore-eot", "--json"]
    plain = json.loads(run_script("generate.py", *args).stdout)
    assert_speculation_keeps_the_text(args, plain, ["--draft", draft])
