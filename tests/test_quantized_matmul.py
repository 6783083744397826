"""Our quantized matrix products (generation/quantized_matmul.cpp): every instruction set
this CPU runs gives the portable loop's numbers, each is within the rounding of its int8
activations of x @ W.T, the int4 layout packs and unpacks exactly, bad inputs are refused
in a line, torch.compile calls the operator from a compiled graph, the dequantizing
operators (a prompt's weights) give the reference weights and the quantizing ones
(loading's) the reference codes and scales, to the bit.

Tolerances: between instruction sets only the order of fp32 sums differs (the integer
dot products are exact), ~1e-6 of the sum of |x_k W[n, k]|; against x @ W.T the bound of
tests/test_weight_quant.py's docstring (each activation moves by at most half its block's
step)."""

import pytest
import torch

from generation import quantized_matmul
from test_weight_quant import int8_activations_bound
from weight_quant import Int4Linear, Int8Linear, dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

ops = quantized_matmul.kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="our quantized kernels could not be built here")
ISAS = ops.kernel_isas() if ops is not None else []
SHAPES = [(1, 64, 96), (3, 80, 256), (2, 40, 1024), (2, 23, 1024)]  # (rows, out, in): 96 is an odd count
# of blocks; 23 output rows leave a tile of 3 (int4 on AVX-512 takes 4 rows at a time)


def int8_case(rows, out_features, in_features, seed=0):
    """x, the int8 weight and bf16 scale, and the weight they stand for."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, in_features, generator=g), torch.randn(out_features, in_features, generator=g)
    q, scale = quantize_int8(w)
    scale = scale.bfloat16()
    return x, q, scale, dequantize_int8(q, scale)


def int4_case(rows, out_features, in_features, group_size=32, seed=0):
    """x, the packed weight, bf16 scale and zero, the weight and its zero per column."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, in_features, generator=g), torch.randn(out_features, in_features, generator=g)
    q, scale, zero = quantize_int4(w, group_size)
    scale, zero = scale.bfloat16(), zero.bfloat16()
    dq = dequantize_int4(q, scale, zero, group_size)
    return x, quantized_matmul.pack_int4(q), scale, zero, dq, zero.float().repeat_interleave(group_size, 1)


def sum_order_tolerance(x, weight):
    return 1e-6 * (x.abs() @ weight.abs().T) + 1e-6


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_every_instruction_set_gives_the_portable_numbers_within_rounding(isa, shape):
    x, q, scale, dq = int8_case(*shape)
    y = ops.int8_matmul(x, q, scale, isa)
    assert y.shape == (shape[0], shape[1]) and y.dtype == torch.float32
    assert ((y - ops.int8_matmul(x, q, scale, "portable")).abs() <= sum_order_tolerance(x, dq)).all()
    assert ((y - x @ dq.T).abs() <= int8_activations_bound(x, dq)).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape, group_size", [(shape, group) for shape in SHAPES for group in (32, 64)
                                               if shape[2] % group == 0])  # widths the group divides
def test_int4_every_instruction_set_gives_the_portable_numbers_within_rounding(isa, shape, group_size):
    x, packed, scale, zero, dq, zero_per_column = int4_case(*shape, group_size)
    y = ops.int4_matmul(x, packed, scale, zero, group_size, isa)
    portable = ops.int4_matmul(x, packed, scale, zero, group_size, "portable")
    assert ((y - portable).abs() <= sum_order_tolerance(x, dq)).all()
    # the integers multiply the weight less its group's zero point (the zero's term is exact)
    assert ((y - x @ dq.T).abs() <= int8_activations_bound(x, dq - zero_per_column)).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_bf16_x_gives_its_fp32_copys_answer_in_bf16(isa, shape):
    # a bf16 model feeds its activations as they are: each is exactly an fp32 number, so the
    # codes, the sums and the answer are x.float()'s, to the bit, then rounded to bf16 once
    x8, q, scale, _ = int8_case(*shape)
    x, packed, s4, z4, _, _ = int4_case(*shape)
    for x_ in (x8, x):
        x_ = x_.bfloat16()
        for y, reference in ((ops.int8_matmul(x_, q, scale, isa), ops.int8_matmul(x_.float(), q, scale, isa)),
                             (ops.int4_matmul(x_, packed, s4, z4, 32, isa),
                              ops.int4_matmul(x_.float(), packed, s4, z4, 32, isa))):
            assert y.dtype == torch.bfloat16
            assert torch.equal(y, reference.bfloat16())


def test_the_activations_rounding_is_what_limits_it():
    # a sanity check on the bound: x whose blocks hold only multiples of their step (127
    # levels of max |x| / 127) is exact in int8, so the product is x @ W.T up to fp32 sums
    x, q, scale, dq = int8_case(2, 48, 256)
    x = torch.randint(-127, 128, x.shape).float() * 0.25
    x[:, ::32] = 127 * 0.25  # each block's max: its step is exactly 0.25
    y = ops.int8_matmul(x, q, scale, ISAS[-1])
    assert ((y - x @ dq.T).abs() <= sum_order_tolerance(x, dq)).all()


def test_int4_packing_round_trips():
    q = torch.randint(0, 16, (5, 128), dtype=torch.uint8)
    packed = quantized_matmul.pack_int4(q)
    assert packed.shape == (5, 64) and torch.equal(quantized_matmul.unpack_int4(packed), q)
    assert packed[0, 0] == q[0, 0] | (q[0, 16] << 4)  # byte j of a block: weights j and j + 16


def test_bad_inputs_are_refused_in_a_line():
    x, q, scale, _ = int8_case(1, 8, 64)
    with pytest.raises(RuntimeError, match="the weight wants 64"):
        ops.int8_matmul(x[:, :32].contiguous(), q, scale, "portable")
    with pytest.raises(RuntimeError, match="does not run"):
        ops.int8_matmul(x, q, scale, "no-such-isa")
    with pytest.raises(RuntimeError, match="scale bfloat16"):
        ops.int8_matmul(x, q, scale.float(), "portable")
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.int8_matmul(x.half(), q, scale, "portable")
    x, packed, scale, zero, _, _ = int4_case(1, 8, 64)
    with pytest.raises(RuntimeError, match="power of 2"):
        ops.int4_matmul(x, packed, scale, zero, 48, "portable")


def test_a_compiled_graph_calls_the_operators():
    x, q, scale, _ = int8_case(1, 64, 96)
    _, packed, s4, z4, _, _ = int4_case(1, 64, 96)
    isa = quantized_matmul.best_isa()

    def both(x):
        return ops.int8_matmul(x, q, scale, isa).relu() + ops.int4_matmul(x, packed, s4, z4, 32, isa)
    compiled = torch.compile(both, fullgraph=True)  # fullgraph: a graph break would fail here
    torch.testing.assert_close(compiled(x), both(x), rtol=0, atol=0)


def test_a_compiled_graph_traces_the_quantized_linears():
    """torch.compile (the serving engine's decode step) traces Int8Linear's and Int4Linear's
    forward into our operators, in one graph (it cannot trace the library's loading: the
    Linears call the operators by name), with the eager products."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(Int8Linear(torch.nn.Linear(96, 64)), torch.nn.ReLU(),
                                Int4Linear(torch.nn.Linear(64, 32), 32))
    assert model[0].kernel == model[2].kernel == "ours"
    x = torch.randn(1, 96)
    with torch.no_grad():
        compiled = torch.compile(model, fullgraph=True)
        torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_dequantizing_operators_give_the_reference_weights(shape, dtype):
    # a prompt's chunk of weights, as the tensor operations of weight_quant.py would give
    # it: the same fp32 arithmetic, but the compiler may fuse a multiply and an add, which
    # moves the fp32 value by its last bit and so a bf16 one by at most one step (2^-7 of it
    # at most: bf16 keeps 8 significant bits)
    step = 2 ** -23 if dtype == torch.float32 else 2 ** -7
    _, q, scale, dq8 = int8_case(*shape)
    _, packed, s, z, dq4, _ = int4_case(*shape, group_size=32)
    for ours, reference in [(ops.int8_dequantize(q, scale, dtype), dq8),
                            (ops.int4_dequantize(packed, s, z, 32, dtype), dq4)]:
        assert ours.dtype == dtype and ours.shape == reference.shape
        assert ((ours.float() - reference.to(dtype).float()).abs() <= step * reference.abs() + 1e-30).all()


def test_the_dequantizing_operators_refuse_bad_inputs_in_a_line():
    _, q, scale, _ = int8_case(1, 8, 64)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 out"):
        ops.int8_dequantize(q, scale, torch.float16)
    with pytest.raises(RuntimeError, match="scale bfloat16"):
        ops.int8_dequantize(q, scale.float(), torch.float32)
    _, packed, s, z, _, _ = int4_case(1, 8, 64)
    with pytest.raises(RuntimeError, match="the group a multiple of"):
        ops.int4_dequantize(packed, s, z, 16, torch.bfloat16)


def awkward_weights(out_features, in_features, dtype, seed=0):
    """Random weights with the rows a quantizer can get wrong: all zero, all one value,
    signed zeros, one large value among small ones."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    w[0], w[1], w[2, ::2], w[3, 5] = 0.0, 0.3, -0.0, 7.5
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(40, 64), (23, 256), (7, 1024)])
def test_the_quantizing_operators_give_the_reference_codes_to_the_bit(shape, dtype):
    # loading's one pass (int8_quantize / int4_quantize) against weight_quant.py's tensor
    # operations: the same division and rounding to nearest even, so no tolerance at all
    w = awkward_weights(*shape, dtype)
    q, scale = ops.int8_quantize(w)
    q_ref, scale_ref = quantize_int8(w)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)
    for group_size in [g for g in (32, 64, 128, 256) if shape[1] % g == 0]:
        packed, scale, lo = ops.int4_quantize(w, group_size)
        levels, scale_ref, zero_ref = quantize_int4(w, group_size)
        assert torch.equal(packed, quantized_matmul.pack_int4(levels)), group_size
        assert torch.equal(scale, scale_ref) and torch.equal(lo + 8 * scale, zero_ref), group_size


def test_the_quantizing_operators_refuse_bad_inputs_in_a_line():
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ops.int8_quantize(torch.zeros(4, 64, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="in a multiple of 32"):
        ops.int8_quantize(torch.zeros(4, 48))
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.int4_quantize(torch.zeros(64, 4).t(), 32)
    with pytest.raises(RuntimeError, match="divides the width"):
        ops.int4_quantize(torch.zeros(4, 96), 64)
