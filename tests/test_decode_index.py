"""The engine's decode step: its index tensors, kept from step to step (serving/
decode_index.py), equal the ones built from the block tables at every step; a prefill's
tokens laid out as rows of their own read what a causal mask lets them; and the tokens it
draws inside the compiled graph equal the same draw made eagerly, and follow the model's
distribution."""

import pytest
import torch

from base_model import GPTConfig
from conftest import byte_tokenizer, random_prompts, tiny_model
from generation.loop import generate_tokens
from sample import probabilities
from serving.decode_index import DecodeIndex, fed_rows, slot_of
from serving.engine import Engine, SamplingParams
from serving.paged_cache import NULL_BLOCK
from serving.scheduler import Sequence

CONFIG = GPTConfig(context_len=64, vocab_size=260, n_layer=2, n_head=4, n_embd=32)
TOKENIZER = byte_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_model(CONFIG, seed=3)


def test_the_kept_index_equals_one_built_from_the_block_tables(model):
    """Different lengths, blocks filled and new ones taken mid-run (4 positions a block),
    requests ending at different steps (the batch shrinks: built again), a shared prefix:
    at every decode step, every tensor equal to a fresh build's. (The last two end
    together: a batch of one would compile a graph of its own, seconds more.)"""
    engine = Engine(model, TOKENIZER, tokens_per_block=4)
    kept_update = engine.runner.index.update
    checked = []

    def update(batch):
        kept = [t.clone() for t in kept_update(batch)]
        fresh = DecodeIndex(engine.pool.tokens_per_block, engine.device).update(batch)
        for a, b in zip(kept, fresh):
            assert a.shape == b.shape and torch.equal(a, b)
        checked.append(len(batch))
        return kept
    engine.runner.index.update = update
    prompts = random_prompts([5, 13, 2, 21], seed=1)
    prompts.append(prompts[1][:8] + [7, 7])  # its first 8 tokens (two blocks) found cached
    for prompt, n in zip(prompts, [9, 20, 14, 6, 20]):
        engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0, stop_at_eot=False))
    engine.run_until_done()
    assert sorted(set(checked)) == [2, 3, 4, 5]  # the batch shrank as requests ended
    changes = sum(a != b for a, b in zip(checked, checked[1:]))
    assert engine.runner.index.rebuilds == 1 + changes  # built once per batch, then extended
    assert engine.runner.index.extensions == len(checked) - engine.runner.index.rebuilds > 10


def run(engine, prompts, params):
    requests = [engine.add_request(p, params) for p in prompts]
    engine.run_until_done()
    return [r.tokens[r.prompt_len:] for r in requests]


def sequence(tokens, blocks, num_cached, start=0):
    s = Sequence(tokens)
    s.blocks, s.num_cached, s.start = blocks, num_cached, start
    return s


def test_a_prefill_fed_as_rows_reads_each_row_up_to_its_own_position():
    # 4 tokens a block. a: 11 tokens, 8 cached (a prefix hit), 3 fed; b: 5 tokens, none
    # cached; c: 6 tokens all cached (found whole: its last is fed again, not written);
    # d: moved past the context (start 3), 2 of its 6 context tokens cached
    tpb = 4
    a = sequence(list(range(100, 111)), [7, 3, 9], 8)
    b = sequence(list(range(200, 205)), [5, 2], 0)
    c = sequence(list(range(300, 306)), [7, 4], 6)
    d = sequence(list(range(400, 409)), [8, 6], 2, start=3)
    (tokens, positions, read_slots, write_slots, visible), last = fed_rows([a, b, c, d], tpb, "cpu")
    expected_rows = [(a, p) for p in (8, 9, 10)] + [(b, p) for p in range(5)] + [(c, 5)] + [(d, p) for p in range(2, 6)]
    S = 11  # the longest context
    assert read_slots.shape == visible.shape == (len(expected_rows), S)
    for r, (s, p) in enumerate(expected_rows):
        assert tokens[r, 0] == s.tokens[s.start + p] and positions[r, 0] == p
        # right-aligned: the row's last column holds its own position, p + 1 columns visible
        assert visible[r].tolist() == [False] * (S - p - 1) + [True] * (p + 1)
        assert read_slots[r, S - p - 1:].tolist() == [slot_of(s, q, tpb) for q in range(p + 1)]
        assert (read_slots[r, :S - p - 1] == NULL_BLOCK).all()
        assert write_slots[r] == (NULL_BLOCK if p < s.num_cached else slot_of(s, p, tpb))
    assert last.tolist() == [2, 7, 8, 12]  # each sequence's last row: its next token's logits
    assert positions.stride() == (1, 1)  # as the decode index's: the graph guards on strides


@pytest.mark.parametrize("temperature", [0.8, 1.5])
def test_the_compiled_step_draws_what_the_eager_draw_does(model, temperature):
    """The same global seed, so the same Exp(1) noise each step (the engine draws it
    before the step, from torch's default generator): the compiled step ("kernel") and
    the eager pass ("gather") pick the same tokens. Logits differ by ~1e-6 between the two
    (differently fused arithmetic); a draw flips only if p_i / E_i ties to that precision."""
    prompts = random_prompts([6, 11, 3], seed=2)
    params = SamplingParams(max_tokens=24, temperature=temperature, stop_at_eot=False)
    texts = {}
    for attention in ("kernel", "gather"):
        torch.manual_seed(11)
        texts[attention] = run(Engine(model, TOKENIZER, attention=attention), prompts, params)
    assert texts["kernel"] == texts["gather"]
    torch.manual_seed(12)
    other = run(Engine(model, TOKENIZER, attention="gather"), prompts, params)
    assert other != texts["gather"]  # the draw does depend on the noise


def test_a_batch_mixes_greedy_drawn_and_alone_rows(model):
    """Greedy rows beside sampled ones are still greedy (the alone generation's tokens),
    and a seeded top-k row beside them gives the text its seed gives alone."""
    prompts = random_prompts([7, 9, 12], seed=3)
    engine = Engine(model, TOKENIZER)
    greedy = engine.add_request(prompts[0], SamplingParams(max_tokens=20, temperature=0, stop_at_eot=False))
    engine.add_request(prompts[1], SamplingParams(max_tokens=20, temperature=1.0, stop_at_eot=False))
    seeded = engine.add_request(prompts[2], SamplingParams(max_tokens=20, temperature=0.9, top_k=30,
                                                           seed=4, stop_at_eot=False))
    engine.run_until_done()

    def alone(prompt, **kw):
        return generate_tokens(model, [prompt], 20, vocab_limit=TOKENIZER.n_vocab, **kw)[0].tolist()
    assert greedy.tokens[greedy.prompt_len:] == alone(prompts[0], temperature=0)
    assert seeded.tokens[seeded.prompt_len:] == alone(prompts[2], temperature=0.9, top_k=30,
                                                      generator=torch.Generator().manual_seed(4))


def test_the_batch_draw_follows_the_model_s_distribution(model):
    """2,000 one-token samples of one prompt at temperature 0.8 through the engine's draw
    (its own noise: -log(-log U)): each token's frequency within 0.045 of its probability
    under the model (4 standard deviations at p = 0.5); uniform numbers taken as the
    Gumbel noise miss it (tried)."""
    prompt = random_prompts([5], seed=8)[0]
    engine = Engine(model, TOKENIZER, max_batch=64)
    params = SamplingParams(max_tokens=1, temperature=0.8, stop_at_eot=False)
    requests = []
    for _ in range(8):  # 250 samples a request: within the admission limit of 256
        requests += engine.submit([prompt], [params] * 250)
        engine.run_until_done()
    drawn = torch.tensor([r.tokens[-1] for r in requests])
    freq = torch.bincount(drawn, minlength=TOKENIZER.n_vocab).float() / len(requests)
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0][0, -1, :TOKENIZER.n_vocab]
    p = probabilities(logits[None], temperature=0.8)[0]
    assert (freq - p).abs().max() < 0.045
