"""Our dense matrix product (generation/dense_matmul.cpp) and the Linear that calls it: every
instruction set this CPU runs, for bf16 and fp32 weights, against the same product in
float64, at shapes that leave every tail (K not a multiple of any step, weight rows not a
multiple of the tile, rows of x not a multiple of its two); DenseLinear as nn.Linear
everywhere but its small products; pack_linears giving it to a bf16 model, and to an fp32
model's tied table too large to pack twice, without copying or untying anything;
torch.compile and the compiled step calling the operator; the bundled model's greedy tokens
unchanged.

Tolerances, against the float64 product of the same weights (and the same x, rounded to
bf16 first on the avx512bf16 path, which multiplies bf16 pairs):
  - every product of two bf16 numbers is exact in fp32 (8 + 8 significant bits), one of a
    bf16 or fp32 weight by an fp32 number off by at most 2^-24 of itself; a sum of K terms in fp32, in
    whatever order, is off by at most K * 2^-24 of the sum of their magnitudes. So an fp32
    output is within (K + 1) * 2^-24 * sum_k |x_k W[n, k]| (+ its bias, added in fp32);
  - a bf16 output is that sum rounded once to bf16's 8 significant bits: at most 2^-8 of
    itself more.
Both are worst cases; a wrong tail, row or tile is off by the size of a term or more."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from base_model import GPTConfig
from conftest import tiny_model
from generation import compiled_step, cpu_layout, dense_matmul
from generation.cpu_layout import PackedLinear, pack_linears
from generation.dense_matmul import MATVEC_ROWS, DenseLinear
from kv_cache import CACHED_MODELS, KVCache
from plumbing.checkpoint import BUNDLED, load_model

ops = dense_matmul.kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="our dense kernel could not be built here")
ISAS = ops.dense_kernel_isas() if ops is not None else []
FP32_ISAS = [isa for isa in ISAS if isa != "avx512bf16"]  # avx512bf16 multiplies bf16 pairs only
# (rows of x, out, in): 1-3 rows (the tile takes 2 at a time), 4k, 4k + 1 and odd weight
# rows, K below one step, between steps, a multiple of every step (8, 16, 32) and not
SHAPES = [(1, 8, 64), (3, 17, 100), (2, 9, 31), (5, 33, 5), (1, 12, 1), (4, 64, 2048)]


def case(rows, out_features, in_features, bias=True, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    return x, w, (torch.randn(out_features, generator=g).to(dtype) if bias else None)


def check_against_float64(y, x, w, bias):
    """y against x @ w.T + bias in float64, within the bounds of the module docstring."""
    x64, w64 = x.double(), w.double()
    b64 = bias.double() if bias is not None else torch.zeros(w.shape[0], dtype=torch.float64)
    exact = x64 @ w64.T + b64
    fp32_sum = (w.shape[1] + 1) * 2.0 ** -24 * (x64.abs() @ w64.abs().T + b64.abs())
    bound = fp32_sum + (2.0 ** -8 * exact.abs() if y.dtype == torch.bfloat16 else 0)
    assert ((y.double() - exact).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_every_instruction_set_gives_the_product_within_fp32_rounding(isa, shape, x_dtype):
    x, w, bias = case(*shape)
    x = x.to(x_dtype)
    y = ops.dense_matmul(x, w, bias, isa)
    assert y.shape == (shape[0], shape[1]) and y.dtype == x_dtype
    # the avx512bf16 path multiplies bf16 pairs: fp32 x rounded to bf16 first
    check_against_float64(y, x.bfloat16() if isa == "avx512bf16" else x, w, bias)
    without_bias = ops.dense_matmul(x, w, None, isa)
    check_against_float64(without_bias, x.bfloat16() if isa == "avx512bf16" else x, w, None)


@pytest.mark.parametrize("isa", FP32_ISAS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_every_instruction_set_multiplies_fp32_weights_within_fp32_rounding(isa, shape, x_dtype):
    x, w, bias = case(*shape, dtype=torch.float32)
    x = x.to(x_dtype)
    y = ops.dense_matmul(x, w, bias, isa)
    assert y.shape == (shape[0], shape[1]) and y.dtype == x_dtype
    check_against_float64(y, x, w, bias)
    check_against_float64(ops.dense_matmul(x, w, None, isa), x, w, None)


def test_bad_inputs_are_refused_in_a_line():
    x, w, bias = case(1, 8, 64)
    with pytest.raises(RuntimeError, match="x must be \\(rows, 64\\)"):
        ops.dense_matmul(x[:, :32].contiguous(), w, bias, "portable")
    with pytest.raises(RuntimeError, match="does not run"):
        ops.dense_matmul(x, w, bias, "no-such-isa")
    with pytest.raises(RuntimeError, match="contiguous \\(out, in\\) bfloat16 or float32"):
        ops.dense_matmul(x, w.half(), bias, "portable")
    with pytest.raises(RuntimeError, match="contiguous \\(out, in\\) bfloat16 or float32"):
        ops.dense_matmul(x, w.t().contiguous().t(), bias, "portable")  # column-major
    with pytest.raises(RuntimeError, match="bias must be \\(8,\\)"):
        ops.dense_matmul(x, w, bias[:4], "portable")


@pytest.mark.skipif("avx512bf16" not in ISAS, reason="this CPU has no AVX-512 BF16")
def test_the_bf16_pair_instruction_set_refuses_an_fp32_weight():
    x, w, bias = case(1, 8, 64, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="avx512bf16 multiplies bfloat16 weights only"):
        ops.dense_matmul(x, w, bias, "avx512bf16")


def make_linear(out_features, in_features, bias=True, seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias).to(dtype)


@pytest.mark.parametrize("rows", [1, 3, MATVEC_ROWS, MATVEC_ROWS + 1, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.no_grad()  # as generation runs: with gradients wanted the layer is F.linear
def test_dense_linear_is_the_kernel_up_to_its_rows_and_onednns_gemm_past_them(rows, dtype):
    lin = make_linear(24, 300, dtype=dtype)  # wide enough that MKL's sums and oneDNN's differ
    ours = DenseLinear(lin)
    x = torch.randn(2, rows, 300).to(dtype)  # (batch, T, C): 2 * rows rows in all
    y = ours(x)
    assert y.shape == (2, rows, 24) and y.dtype == dtype
    flat = x.reshape(-1, 300)
    if flat.shape[0] <= MATVEC_ROWS:
        expected = ops.dense_matmul(flat, lin.weight, lin.bias, dense_matmul.best_isa(dtype))
    elif dtype == torch.float32:  # F.linear's would be MKL's, slower over a row-major weight
        expected = torch.ops.mkldnn._linear_pointwise(x, lin.weight, lin.bias, "none", [], "").reshape(-1, 24)
    else:  # bf16: F.linear's is oneDNN's
        expected = F.linear(flat, lin.weight, lin.bias)
    assert torch.equal(y.reshape(-1, 24), expected)


def test_dense_linear_leaves_training_and_other_dtypes_to_f_linear():
    lin = make_linear(24, 40)
    ours = DenseLinear(lin)
    x = torch.randn(1, 40).bfloat16()
    y = ours(x)  # gradients wanted: F.linear, which has a backward
    y.sum().backward()
    assert lin.weight.grad is not None and torch.equal(y, F.linear(x, lin.weight, lin.bias))
    ours.half()  # the same Parameters, now fp16: F.linear again
    with torch.no_grad():
        assert torch.equal(ours(x.half()), F.linear(x.half(), lin.weight, lin.bias))


def test_pack_linears_gives_a_bf16_model_the_kernel_over_its_own_weights():
    model = tiny_model(GPTConfig(context_len=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32)).bfloat16()
    weights = {name: p.data_ptr() for name, p in model.named_parameters()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pack_linears(model)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is DenseLinear for m in linears)
    # no copy: the same memory, the tied head still the embedding, the state dict as it was
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == weights
    assert model.lm_head.weight is model.transformer.wte.weight
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_a_column_major_weight_is_made_row_major_in_place():
    lin = make_linear(24, 40)
    values = lin.weight.detach().clone()
    lin.weight.data = lin.weight.data.t().contiguous().t()  # as a bf16 copy of a column-major fp32 model
    parameter = lin.weight
    ours = dense_matmul.for_our_kernel(lin)
    assert ours.weight is parameter and parameter.is_contiguous() and torch.equal(parameter, values)


def test_a_compiled_graph_calls_the_operator():
    """torch.compile (the serving engine's decode step) traces DenseLinear's forward into our
    operator, in one graph, with the eager products."""
    torch.manual_seed(0)
    model = nn.Sequential(DenseLinear(nn.Linear(96, 64).bfloat16()), nn.ReLU(),
                          DenseLinear(nn.Linear(64, 32, bias=False).bfloat16()))
    x = torch.randn(1, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        compiled = torch.compile(model, fullgraph=True)  # fullgraph: a graph break would fail here
        torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("rows", [3, MATVEC_ROWS + 5])
def test_a_compiled_graph_takes_fp32_products_past_the_kernels_rows(rows):
    """torch.compile (the serving engine's paged decode step, eager or not) traces an fp32
    DenseLinear in one graph either side of MATVEC_ROWS: our operator for a few rows,
    F.linear for more (inductor's own GEMM; the eager call to oneDNN is not traced).
    Against the eager products within fp32 rounding: the sums' order differs."""
    torch.manual_seed(0)
    model = nn.Sequential(DenseLinear(nn.Linear(96, 64)), nn.ReLU(), DenseLinear(nn.Linear(64, 32, bias=False)))
    x = torch.randn(rows, 96)
    with torch.no_grad():
        compiled = torch.compile(model, fullgraph=True)  # fullgraph: a graph break would fail here
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


CONFIG = GPTConfig(context_len=16, vocab_size=64, n_layer=1, n_head=2, n_embd=64)


def test_the_compiled_step_calls_the_kernel(builds, monkeypatch):
    """The exported decode step of a bf16 model (--dtype bfloat16 --compile) holds our
    operator where its Linears multiply (the graph conftest's `builds` runs in Python)."""
    exported, export = [], compiled_step.export_program
    monkeypatch.setattr(compiled_step, "export_program", lambda *a, **kw: exported.append(export(*a, **kw))
                        or exported[-1])
    model = pack_linears(tiny_model(CONFIG, seed=23).bfloat16())
    cache = KVCache(CONFIG, 2, "cpu", torch.bfloat16)
    step, _ = compiled_step.compile_for(model, cache)
    matmuls = [n for n in exported[-1].graph.nodes if n.target is torch.ops.kvcache_gpt_dense.dense_matmul.default]
    assert len(matmuls) == 5  # c_attn, c_proj, the MLP's two, the lm_head


def test_the_compiled_steps_real_build_gives_the_eager_logits():
    """The same step built by AOTInductor: its Linears' products are the operator's, as in
    eager; inductor fuses the bf16 arithmetic around them (LayerNorm, GELU, residuals) in
    fp32 where eager rounds each operation's result to bf16, so the logits differ by bf16
    roundings (2^-8 each) through the block: 2^-5 of their scale leaves room for a handful;
    a wrong product would be off by its own size."""
    model = pack_linears(tiny_model(CONFIG, seed=23).bfloat16())
    tokens = torch.tensor([[5], [9]])
    with torch.no_grad():
        eager = model(tokens, KVCache(CONFIG, 2, "cpu", torch.bfloat16))[0][:, -1].float()  # (2, V)
    cache = KVCache(CONFIG, 2, "cpu", torch.bfloat16)
    step, _ = compiled_step.compile_for(model, cache)
    with torch.no_grad():
        logits = step.decode(tokens, cache)[:, -1].float()
    assert (logits - eager).abs().max() <= 2 ** -5 * eager.abs().max()


@pytest.fixture(scope="module")
def bundled():
    return load_model(CACHED_MODELS, BUNDLED, report=lambda _: None)


def test_the_bundled_models_greedy_tokens_are_torchs(bundled):
    # the same bf16 weights and activations; only the order of the fp32 sums differs (and
    # where torch rounds), ~2^-8 of an output at most, so greedy tokens can part only at a
    # near-tie. Measured: 200 of 200 from this prompt; 150 leaves room for one near-tie on
    # another CPU's sum order.
    model, tok = bundled
    prompt = torch.tensor([tok.encode_ordinary("ROMEO:\n")])
    torchs_model = copy.deepcopy(model).bfloat16()
    ours_model = pack_linears(copy.deepcopy(torchs_model))
    assert any(type(m) is DenseLinear for m in ours_model.modules())
    ours, torchs = (m.generate(prompt, 200, temperature=0, vocab_limit=tok.n_vocab)[0, prompt.size(1):]
                    for m in (ours_model, torchs_model))
    assert (ours == torchs).long().cumprod(0).sum() >= 150


@pytest.mark.parametrize("tied_too_large", [False, True])
def test_a_real_size_fp32_model_multiplies_over_its_dense_weights(bundled, monkeypatch, tied_too_large):
    """An fp32 model whose Linears are past DENSE_MIN_WEIGHTS (a real-size model's; the
    bundled model's with the limit lowered) gets DenseLinears over its own weights: our
    kernel for the decode steps, oneDNN's GEMM over the same weights for the prompt (longer
    than MATVEC_ROWS here); its tied head is packed beside the table unless the table is too
    large to hold twice (TIED_PACK_MAX_BYTES, lowered too), when it is a DenseLinear over the
    embedding's own table. The greedy tokens are the plain model's: the same fp32 products,
    summed in another order (K * 2^-24 of their magnitudes at most), so they can part only
    at a near-tie. Measured: 200 of 200 both ways; 150 leaves room for one on another CPU's
    sum order."""
    monkeypatch.setattr(cpu_layout, "DENSE_MIN_WEIGHTS", 1)
    if tied_too_large:
        monkeypatch.setattr(cpu_layout, "TIED_PACK_MAX_BYTES", 0)
    model, tok = bundled
    plain = copy.deepcopy(model)
    ours = pack_linears(copy.deepcopy(model))
    blocks = [m for name, m in ours.named_modules() if isinstance(m, nn.Linear) and name != "lm_head"]
    assert blocks and all(type(m) is DenseLinear for m in blocks)
    assert type(ours.lm_head) is (DenseLinear if tied_too_large else PackedLinear)
    assert ours.lm_head.weight is ours.transformer.wte.weight  # (a PackedLinear keeps it dense too)
    prompt = torch.tensor([tok.encode_ordinary("ROMEO:\nWhat light through yonder window breaks?\n")])
    assert prompt.size(1) > MATVEC_ROWS
    mine, theirs = (m.generate(prompt, 200, temperature=0, vocab_limit=tok.n_vocab)[0, prompt.size(1):]
                    for m in (ours, plain))
    assert (mine == theirs).long().cumprod(0).sum() >= 150
