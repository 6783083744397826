"""The Llama family (llama.py, kv_cache.KVCacheLlama) against Hugging Face transformers'
LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM, each loaded
from a tiny random directory through `--hf`'s loader (tests/hf_llama_dirs.py: MHA, GQA, MQA,
qkv bias, q/k norm, tied and untied, rope_theta other than 10,000, Llama 3's and linear rope
scaling, a sliding window, both tokenizer kinds).

Tolerance: 1e-4 absolute on fp32 logits (of magnitude ~1-5), as in test_hf.py: the same
arithmetic in different kernels and orders rounds differently by a few ulps per op (~1e-6
after two layers, printed with -s); a real error (a head mapped to the wrong key/value head,
a rotation by the wrong angle or of the wrong channel pairs, a position off by one, a norm
in the wrong place) moves logits by O(0.1..1). Greedy tokens are compared exactly: these
random models (initializer_range 0.1) have no near-ties in 100 tokens.
"""

import codecs
import copy

import pytest
import torch

from conftest import run_script
from generation.loop import generate_tokens, left_pad
from hf_llama_dirs import VARIANTS, make_hf_llama_dir
from kv_cache import CACHED_MODELS, KVCacheLlama
from kv_quant import cache_bytes
from plumbing.hf import load_hf_model
from plumbing.user_text import prompt_tokens
from serving.engine import Engine, SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()

ATOL = 1e-4
GEN_TOKENS = 100
PROMPTS = ["ROMEO: But soft", "To be, or not to be, that is the question", "Café 🎭"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one thread per op beats two fighting over 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=list(VARIANTS), scope="module")
def pair(request, tmp_path_factory):
    """(HF model, HF tokenizer, our KVCacheLlama and tokenizer loaded with --hf's loader, dir, name)."""
    path = tmp_path_factory.mktemp(request.param)
    hf, hf_tok = make_hf_llama_dir(path, request.param)
    ours, tokenizer = load_hf_model(CACHED_MODELS, path, report=lambda line: None)
    return hf, hf_tok, ours, tokenizer, path, request.param


def report(what, name, diff):
    print(f"\n  max |logit diff| {what:24s} {name:26s} {diff:.2e}")


def random_ids(rows, T, seed=0):
    return torch.randint(250, (rows, T), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- logits

@torch.no_grad()
def test_full_forward(pair):
    hf, _, ours, _, _, name = pair
    assert isinstance(ours, KVCacheLlama)
    idx = random_ids(2, 48)
    diff = (ours(idx)[0] - hf(idx).logits).abs().max().item()
    report("full forward", name, diff)
    assert diff < ATOL


@pytest.mark.parametrize("kind", [None, "cat"], ids=["KVCache", "torch.cat"])
@torch.no_grad()
def test_token_by_token_and_chunked_through_the_cache(pair, kind):
    hf, _, ours, _, _, name = pair
    idx = random_ids(2, 48, seed=1)
    full = hf(idx).logits
    for chunk in (1, 7):
        cache = ours.new_cache(2, kind)
        pieces = [ours(idx[:, s:s + chunk], cache)[0] for s in range(0, idx.size(1), chunk)]
        diff = (torch.cat(pieces, dim=1) - full).abs().max().item()
        report(f"chunks of {chunk}, {kind or 'KVCache'}", name, diff)
        assert diff < ATOL
        assert cache.length == idx.size(1)


@torch.no_grad()
def test_left_padded_batch_gives_each_row_its_own_logits(pair):
    """Rows of 5, 20 and 33 tokens in one left-padded batch, prefilled then fed token by
    token: every real position's logits equal transformers' on that row alone (positions
    restart at 0 in every row)."""
    hf, _, ours, _, _, name = pair
    rows = [random_ids(1, n, seed=n)[0].tolist() for n in (5, 20, 33)]
    tokens, pad = left_pad(rows, ours.config.context_len, "cpu")
    cache = ours.new_cache(3, pad=pad)
    logits = [ours(tokens[:, :10], cache)[0]] + [ours(tokens[:, c:c + 1], cache)[0] for c in range(10, 33)]
    logits = torch.cat(logits, dim=1)
    worst = 0.0
    for b, row in enumerate(rows):
        theirs = hf(torch.tensor([row])).logits[0]
        worst = max(worst, (logits[b, 33 - len(row):] - theirs).abs().max().item())
    report("left-padded batch", name, worst)
    assert worst < ATOL


# ---------------------------------------------------------------------------- greedy text

def hf_greedy(hf, prompts, tokenizer, max_new_tokens=GEN_TOKENS):
    """max_new_tokens greedy tokens of each prompt from transformers, in one left-padded batch
    (its attention mask gives each row its own positions), end-of-text not special."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                      eos_token_id=None, pad_token_id=0)
    return out[:, width:]


def test_greedy_tokens_alone_and_batched(pair):
    hf, _, ours, tokenizer, _, name = pair
    prompts = [prompt_tokens(tokenizer, text) for text in PROMPTS]
    with torch.no_grad():
        for prompt in prompts[:2]:  # alone
            assert torch.equal(generate_tokens(ours, [prompt], GEN_TOKENS, temperature=0),
                               hf_greedy(hf, [prompt], tokenizer)), (name, prompt)
        batched = generate_tokens(ours, prompts, GEN_TOKENS, temperature=0)
    assert torch.equal(batched, hf_greedy(hf, prompts, tokenizer)), name


BF16_ATOL = 0.1  # bf16 logits: ours and transformers' each ~0.05 from fp32's (printed with -s)


def test_bf16_greedy_tokens_equal_transformers_bf16(pair):
    """In bfloat16 (the dtype real checkpoints ship in): fed transformers' 32 greedy bf16
    tokens, our logits agree with its within BF16_ATOL (a real error moves them by O(0.1..1);
    the fp32 tests above hold every path to 1e-4), and our own greedy tokens are its up to
    the first near-tie: a step whose top two logits are closer than twice the difference
    measured, where two correct bf16 models, rounding the same weights in different kernels
    and orders, may pick either (these tiny random models have many such steps)."""
    hf, _, _, tokenizer, path, name = pair
    ours16, _ = load_hf_model(CACHED_MODELS, path, dtype=torch.bfloat16, report=lambda line: None)
    assert ours16.lm_head.weight.dtype == torch.bfloat16
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    for prompt in [prompt_tokens(tokenizer, text) for text in PROMPTS[:2]]:
        with torch.no_grad():
            theirs = hf_greedy(hf16, [prompt], tokenizer, 32)[0]
            mine = generate_tokens(ours16, [prompt], 32, temperature=0)[0]
            text = torch.tensor([prompt + theirs.tolist()])
            their_logits = hf16(text).logits[0, len(prompt) - 1:-1].float()  # (32, vocab)
            diff = (ours16(text)[0][0, len(prompt) - 1:-1].float() - their_logits).abs().max().item()
        top2 = their_logits.topk(2, dim=-1).values
        ties = ((top2[:, 0] - top2[:, 1]) < 2 * diff).nonzero()
        agreed = ties[0].item() if len(ties) else 32
        report(f"bf16, {agreed} tokens before a tie", name, diff)
        assert diff < BF16_ATOL, name
        assert torch.equal(mine[:agreed], theirs[:agreed]), (name, prompt)


def test_prompts_encode_as_transformers_encodes_them(pair):
    """The prompt's ids (BOS added as the tokenizer's config says) and every token's text."""
    _, hf_tok, _, tokenizer, _, name = pair
    for text in PROMPTS + ["", "  two  spaces\n\nand\ttabs", "汉字 ẞ \x00"]:
        assert prompt_tokens(tokenizer, text) == hf_tok(text).input_ids, (name, text)
        # a SentencePiece tokenizer reads a space before the text (its dummy prefix)
        assert tokenizer.decode(tokenizer.encode_ordinary(text)) in (text, " " + text)


def test_generate_cli_writes_transformers_tokens(pair):
    """`generate.py --hf DIR`, greedy: transformers' greedy tokens after the prompt, as text.
    (A random model writes bytes that are not UTF-8, and two decoders may replace a broken
    sequence by different numbers of U+FFFD, so the tokens are written out with our
    tokenizer's bytes; test_prompts_encode_as_transformers_encodes_them checks those.)"""
    hf, hf_tok, _, tokenizer, path, name = pair
    prompt = "ROMEO: But soft"
    proc = run_script("generate.py", "--hf", path, "--prompt", prompt, "--temperature", "0",
                      "--max-new-tokens", "30", "--ignore-eot", "--no-stream")
    assert proc.returncode == 0, proc.stderr
    ids = hf_tok(prompt).input_ids
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=30, eos_token_id=None, pad_token_id=0)
    written = b"".join(tokenizer.decode_single_token_bytes(t) for t in out[0, len(ids):].tolist())
    # an incomplete character at the very end is never printed (plumbing/text_stream.py)
    text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(written)
    assert proc.stdout == prompt + text + "\n", name
    assert f"loaded Hugging Face {VARIANTS[name][0]}" in proc.stderr


# ---------------------------------------------------------------------------- memory

def test_cache_holds_the_formulas_bytes_with_n_kv_head(pair):
    """S_cache = 2 x N_layers x N_kv_heads x L x d_head x P_bytes, for every cache kind."""
    _, _, ours, tokenizer, _, name = pair
    c = ours.config
    assert c.n_kv_head == VARIANTS[name][1]["num_key_value_heads"]
    assert ours.new_cache(3).nbytes() == cache_bytes(c, c.context_len, 3) == (
        2 * c.n_layer * c.n_kv_head * c.context_len * c.head_dim * 4 * 3)
    _, cache = ours(random_ids(2, 9), None)  # the seed's torch.cat list
    assert cache.nbytes() == cache_bytes(c, 9, 2)
    assert [tuple(k.shape) for k, _ in cache.layers] == [(2, c.n_kv_head, 9, c.head_dim)] * c.n_layer
    engine = Engine(ours, tokenizer, num_blocks=64, tokens_per_block=16, attention="gather")
    assert engine.pool.nbytes() == cache_bytes(c, 65 * 16, 1)  # 64 blocks + the null block


# ---------------------------------------------------------------------------- the engine

def test_engine_with_gqa_gives_the_loops_tokens(pair):
    """The paged pool stores n_kv_head heads; its kernel and its gather both read them, and
    a shared prefix is computed once."""
    _, _, ours, tokenizer, _, name = pair
    prompts = [prompt_tokens(tokenizer, "ROMEO: But soft, what light through yonder window breaks")] * 2
    prompts.append(prompt_tokens(tokenizer, "JULIET: O"))
    expected = generate_tokens(ours, prompts, 12, temperature=0)
    # the kernel compiles for each head layout (seconds): two of them, MQA and GQA with its own head_dim
    kernel = name in ("mistral-mqa-window", "qwen3-qknorm-headdim")
    for attention in ("gather", "kernel") if kernel else ("gather",):
        engine = Engine(ours, tokenizer, num_blocks=64, tokens_per_block=4, attention=attention)
        requests = [engine.add_request(p, SamplingParams(max_tokens=12, temperature=0, stop_at_eot=False))
                    for p in prompts]
        engine.run_until_done()
        got = [r.tokens[r.prompt_len:] for r in requests]
        assert got == expected.tolist(), (name, attention)
        assert engine.scheduler.cached_tokens >= 4  # the repeated prompt found its blocks
