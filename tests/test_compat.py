"""KVCacheGPT is the same model as GPT: same parameter names and shapes, no extra state."""

import torch

from base_model import GPT
from conftest import tiny_model
from kv_cache import KVCacheGPT


def test_state_dict_keys_and_shapes_identical(config):
    base, cached = GPT(config).state_dict(), KVCacheGPT(config).state_dict()
    assert list(base) == list(cached)
    assert all(base[k].shape == cached[k].shape for k in base)


def test_weights_load_both_ways_strict(config):
    base = tiny_model(config, seed=1, cls=GPT)
    cached = tiny_model(config, seed=2, cls=KVCacheGPT)
    cached.load_state_dict(base.state_dict(), strict=True)
    idx = torch.randint(config.vocab_size, (2, 10))
    # exact equality: with no cache, both run the same ops in the same order
    assert torch.equal(base(idx)[0], cached(idx)[0])
    back = tiny_model(config, seed=3, cls=GPT)
    back.load_state_dict(cached.state_dict(), strict=True)
    assert torch.equal(back(idx)[0], base(idx)[0])


def test_no_persistent_buffers(config):
    # nothing but parameters in the state dict: checkpoints stay identical to GPT's
    model = KVCacheGPT(config)
    params = {name for name, _ in model.named_parameters()} | {"lm_head.weight"}
    assert set(model.state_dict()) == params


def test_lm_head_tied_to_wte(config):
    model = GPT(config)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_forward_returns_all_positions_and_loss(config):
    model = tiny_model(config, cls=GPT)
    idx = torch.randint(config.vocab_size, (2, 7))
    logits, loss = model(idx)
    assert logits.shape == (2, 7, config.vocab_size) and loss is None
    _, loss = model(idx, targets=torch.randint(config.vocab_size, (2, 7)))
    # untrained model, random targets: loss near ln(vocab), the loss of a uniform guess
    assert abs(loss.item() - torch.log(torch.tensor(float(config.vocab_size))).item()) < 0.5
