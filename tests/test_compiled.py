"""The static-shape decode step (generation/compiled_step.py): one graph for every step, the same
tokens as the eager loop.

Graph logic is checked with torch.compile's "eager" backend (dynamo traces and guards the
step exactly as for inductor, but runs the traced graph without generating C++), so that
recompiles are counted in seconds; one test compiles for real with inductor, on a 1-layer
model to keep the C++ build short. Token equality is exact: the static step reads the
masked whole buffer instead of the filled columns, which changes only float rounding
(~1e-6 on these logits), and these seeds have no near-ties."""

import pytest
import torch
from torch._dynamo.utils import counters

from base_model import GPTConfig
from conftest import tiny_model
from generation import compiled_step
from generation.loop import Generation, GenerationStats, generate_tokens
from kv_cache import KVCache

CONFIG = GPTConfig(context_len=32, vocab_size=260, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture
def eager_backend(monkeypatch):
    monkeypatch.setitem(compiled_step.COMPILE_OPTIONS, "backend", "eager")
    monkeypatch.delitem(compiled_step.COMPILE_OPTIONS, "options")  # inductor's alone
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def greedy(model, prompts, n, **kw):
    return generate_tokens(model, prompts, n, temperature=0, **kw)


def test_one_graph_for_every_step_and_the_same_tokens(eager_backend):
    model = tiny_model(CONFIG, seed=21)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12]]  # left padding in the graph too
    n = 3 * CONFIG.context_len  # through reprefills (eager) between compiled steps
    stats = GenerationStats()
    compiled = greedy(model, prompts, n, compile=True, stats=stats)
    assert torch.equal(compiled, greedy(model, prompts, n))
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["recompiles"].values()) == 0
    assert stats.compile_seconds > 0 and stats.reprefills > 0
    # a second generation of the same shapes reuses the graph
    greedy(model, prompts, 20, compile=True)
    assert counters["stats"]["unique_graphs"] == 1


def test_unwritten_columns_holding_nan_change_nothing(eager_backend, monkeypatch):
    """The static step reads the whole buffer, unwritten columns masked. The buffer is
    torch.empty, which may hold NaN bits, and a masked NaN still poisons attention (0 x NaN):
    this made the compiled tokens wrong now and then. Fill new buffers with NaN to be sure."""
    init = KVCache.__init__

    def nan_filled(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.kv.fill_(float("nan"))
    monkeypatch.setattr(KVCache, "__init__", nan_filled)
    model = tiny_model(CONFIG, seed=24)
    prompts = [[1, 2, 3], [4, 5]]
    assert torch.equal(greedy(model, prompts, 20, compile=True), greedy(model, prompts, 20))


def test_single_row_num_samples_and_finished_rows(eager_backend):
    model = tiny_model(CONFIG, seed=22)
    prompt = torch.tensor([[7, 8, 9, 10]])
    assert torch.equal(greedy(model, prompt, 40, compile=True), greedy(model, prompt, 40))
    generation = Generation(model, [[1], [2, 3]], 50, temperature=0, num_samples=2, compile=True)
    steps = 0
    for steps, (rows, tokens) in enumerate(generation, start=1):
        # finished rows stay in the compiled batch (one graph) but get no more tokens
        assert rows == ([0, 1, 2, 3] if steps <= 3 else [2, 3]) and tokens.shape == (len(rows),)
        for row in ((0, 1) if steps == 3 else (2, 3) if steps == 9 else ()):
            generation.finish(row)
    assert steps == 9


def test_needs_the_preallocated_cache(eager_backend):
    model = tiny_model(CONFIG)
    with pytest.raises(ValueError, match="preallocated"):
        greedy(model, [[1, 2]], 3, compile=True, cache_kind="cat")


def test_inductor_compiles_once_and_matches_eager():
    torch._dynamo.reset()
    counters.clear()
    config = GPTConfig(context_len=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16)
    model = tiny_model(config, seed=23)
    prompts = [[1, 2, 3], [4, 5]]
    assert torch.equal(greedy(model, prompts, 40, compile=True), greedy(model, prompts, 40))
    assert counters["stats"]["unique_graphs"] == 1 and sum(counters["recompiles"].values()) == 0
    torch._dynamo.reset()
