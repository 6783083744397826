"""generation/cpu_layout.py: Linears packed once for oneDNN compute what nn.Linear does,
look like nn.Linear to everything else, and follow their weight when it changes.

Tolerances: oneDNN and MKL add up the same products in different orders; in float32 that
moves a sum of 32-768 terms of these sizes by ~1e-6 relative, so 1e-5 (rtol and atol) holds
with room and would still catch a wrong weight (errors of order 1)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from base_model import GPTConfig
from conftest import TINY_CONFIGS, tiny_model
from generation import dense_matmul
from generation.cpu_layout import PackedLinear, pack_linears, unpack_linears
from generation.dense_matmul import DenseLinear
from weight_quant import Int8Linear, quantize_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="this torch has no oneDNN: pack_linears leaves models as they are")


def linear(out_features, in_features, bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


@pytest.mark.parametrize("rows", [0, 1, 5, 64])
@pytest.mark.parametrize("bias", [True, False])
@torch.no_grad()  # as generation runs: with gradients wanted the layer is F.linear (the last test)
def test_packed_linear_computes_what_nn_linear_does(rows, bias):
    lin = linear(96, 48, bias)
    packed = PackedLinear(lin)
    for shape in [(rows, 48), (2, rows, 48)]:  # 2-D and batched 3-D inputs
        x = torch.randn(shape)
        y = packed(x)
        assert y.shape == (*shape[:-1], 96)
        torch.testing.assert_close(y, lin(x), rtol=1e-5, atol=1e-5)
    assert packed.packed is not None  # the oneDNN path ran, not the fallback


def test_a_model_packs_every_float32_linear_and_keeps_its_state_dict_and_tie():
    model = tiny_model(TINY_CONFIGS[0])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pack_linears(model, min_weights=0)
    with torch.no_grad():  # inference: a call with gradients wanted multiplies the dense weight
        model(torch.tensor([[1, 2, 3]]))  # packs them
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m is not model.lm_head]
    assert linears and all(type(m) is PackedLinear and m.weight.is_meta for m in linears)
    # tied: packed too, but its dense weight stays, since the embedding's lookup reads it
    assert type(model.lm_head) is PackedLinear and model.lm_head.packed is not None
    assert model.lm_head.weight is model.transformer.wte.weight and not model.lm_head.weight.is_meta
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)



def test_a_large_tied_head_is_not_held_twice(monkeypatch):
    """Past TIED_PACK_MAX_BYTES a tied head is not packed: it multiplies over the one dense
    table (Llama-3.2-1B's is 1.05 GB in float32: a packed copy beside it would be a fifth
    more), through our kernel where it is built (tests/test_dense_matmul.py)."""
    model = tiny_model(TINY_CONFIGS[0])
    monkeypatch.setattr("generation.cpu_layout.TIED_PACK_MAX_BYTES", model.lm_head.weight.nbytes - 1)
    pack_linears(model, min_weights=0)
    assert type(model.lm_head) is (nn.Linear if dense_matmul.kernels() is None else DenseLinear)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert type(model.transformer.h[0].mlp.c_fc) is PackedLinear  # the others are packed as before


@torch.no_grad()
def test_the_packed_copy_replaces_the_weight_and_gives_it_back_exactly():
    lin = linear(96, 48)
    lin.weight.data = lin.weight.data.t().contiguous().t()  # column-major, as the generation layout
    expected = lin.weight.detach().clone()
    packed = PackedLinear(copy.deepcopy(lin))
    packed(torch.randn(4, 48))
    assert packed.weight.is_meta and packed.weight.shape == (96, 48)  # no second copy
    assert torch.equal(packed.state_dict()["weight"], expected)
    clone = copy.deepcopy(packed)
    unpack_linears(clone)
    assert torch.equal(clone.weight, expected) and clone.weight.stride() == expected.stride()
    assert clone.packed is None
    unpack_linears(packed)
    assert torch.equal(packed.weight, expected) and packed.weight.stride() == expected.stride()


def test_only_weights_big_enough_to_gain_are_packed():
    # oneDNN's call costs more than MKL's before any arithmetic: small weights stay nn.Linear
    model = nn.Sequential(linear(512, 1024), linear(511, 1024), linear(4096, 256), linear(768, 768),
                          linear(1024, 256))  # (out, in): 2^19 weights, one row fewer, ...
    pack_linears(model)
    assert [type(m) is PackedLinear for m in model] == [True, False, True, True, False]


def test_greedy_tokens_and_logits_as_before_packing():
    model = tiny_model(TINY_CONFIGS[1])  # no biases
    packed = pack_linears(copy.deepcopy(model), min_weights=0)
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with torch.inference_mode():
        torch.testing.assert_close(packed(prompt)[0], model(prompt)[0], rtol=1e-5, atol=1e-5)
    # measured: 60 of 60 greedy tokens the same on both tiny configs
    assert torch.equal(packed.generate(prompt, 60, temperature=0), model.generate(prompt, 60, temperature=0))


@torch.no_grad()
def test_a_weight_loaded_or_converted_after_packing_is_packed_again():
    lin = linear(32, 16)
    packed = PackedLinear(copy.deepcopy(lin))
    x = torch.randn(4, 16)
    packed(x)  # packs the weight as it is now
    packed.load_state_dict({"weight": torch.zeros(32, 16), "bias": torch.ones(32)})
    torch.testing.assert_close(packed(x), torch.ones(4, 32))
    packed.load_state_dict(lin.state_dict())
    torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)
    packed.to(torch.float64).to(torch.float32)  # .to() converts the dense weight
    torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)
    assert packed.weight.is_meta  # packed again


def test_deepcopy_of_a_packed_model():
    model = pack_linears(tiny_model(TINY_CONFIGS[0]), min_weights=0)
    prompt = torch.tensor([[1, 2, 3]])
    expected = model.generate(prompt, 10, temperature=0)  # packs every Linear
    clone = copy.deepcopy(model)  # oneDNN's tensors cannot be copied: the clone repacks
    assert torch.equal(clone.generate(prompt, 10, temperature=0), expected)


@torch.no_grad()
def test_other_dtypes_quantized_layers_and_compiled_graphs_use_the_plain_weight():
    model = tiny_model(TINY_CONFIGS[0])
    quantize_model(model, "int8")
    pack_linears(model, min_weights=0)
    assert not any(type(m) is PackedLinear for m in model.modules())  # every Linear was quantized
    assert any(isinstance(m, Int8Linear) for m in model.modules())
    lin = linear(32, 16)
    half = pack_linears(nn.Sequential(copy.deepcopy(lin).to(torch.float16)), min_weights=0)
    assert type(half[0]) is nn.Linear  # fp16: oneDNN's layout is packed for float32 only
    bf16 = pack_linears(nn.Sequential(copy.deepcopy(lin).to(torch.bfloat16)), min_weights=0)
    assert type(bf16[0]) is not PackedLinear  # bf16 gets our kernel (tests/test_dense_matmul.py)
    packed = PackedLinear(lin)
    x = torch.randn(3, 16)
    compiled = torch.compile(packed, fullgraph=True)  # traces the F.linear branch
    torch.testing.assert_close(compiled(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert packed.packed is None  # the compiled graph never called the eager path


def test_gradients_flow_to_the_weight_as_through_nn_linear():
    # training a packed model: the packed copy is not the Parameter, so F.linear is used
    lin = linear(8, 4)
    packed = PackedLinear(copy.deepcopy(lin))
    x = torch.randn(5, 4)
    assert not packed.packed_copy_applies(x)
    lin(x).square().sum().backward()
    packed(x).square().sum().backward()
    torch.testing.assert_close(packed.weight.grad, lin.weight.grad)
    torch.testing.assert_close(packed.bias.grad, lin.bias.grad)


@torch.no_grad()
def test_a_model_whose_step_is_compiled_packs_no_more():
    # torch.export and inductor read the Parameters: unpack_linears gives every weight back
    # and keeps it dense, so a later eager call does not pack it again (each repacking would
    # be a new weight to the next build)
    model = tiny_model(TINY_CONFIGS[0])
    pack_linears(model, min_weights=0)
    idx = torch.tensor([[1, 2, 3]])
    expected = model(idx)[0]
    unpack_linears(model)
    assert not any(p.is_meta for p in model.parameters())
    # the dense weights multiply through MKL again: the same sums in another order (1e-5, above)
    torch.testing.assert_close(model(idx)[0], expected, rtol=1e-5, atol=1e-5)
    assert all(m.packed is None for m in model.modules() if isinstance(m, PackedLinear))



@torch.no_grad()
def test_a_packed_model_compiles_after_an_eager_call_and_gives_the_same_tokens(builds):
    # the eager prefill packs the weights (the Parameters then hold no values), and the
    # compiled step is exported from the Parameters: compile_for unpacks them first, for good
    config = GPTConfig(context_len=64, vocab_size=260, n_layer=1, n_head=2, n_embd=64)
    model = tiny_model(config).eval()
    idx = torch.tensor([[1, 2, 3]])
    eager = model.generate(idx, 6, temperature=0)
    pack_linears(model, min_weights=0)
    assert torch.equal(model.generate(idx, 6, temperature=0), eager)  # packed: the weights now meta
    assert any(m.weight.is_meta for m in model.modules() if isinstance(m, PackedLinear))
    assert torch.equal(model.generate(idx, 6, temperature=0, compile=True), eager)
    assert len(builds) == 1 and not any(p.is_meta for p in model.parameters())
    assert torch.equal(model.generate(idx, 6, temperature=0), eager)  # eager again: not repacked
    assert all(m.packed is None for m in model.modules() if isinstance(m, PackedLinear))
