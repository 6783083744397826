"""
A decode step whose shapes never change, compiled ahead of time into one C++ library.

A batch-1 decode step does little arithmetic: it reads every weight once and makes one
token. On a CPU the rest of its time is overhead, not work: Python and PyTorch's dispatch
run ~15 small operations per layer, each paying microseconds before any number is touched
(on the bundled model that is most of a step). Compiling traces the step into one graph,
fuses the small operations (LayerNorm, GELU, the residual adds, the mask, the sampling)
into generated C++ loops and calls the matmul kernels directly, so the Python is gone.

But a graph holds fixed shapes. The eager step's shapes change every step (the cache
holds one more column, the mask and positions slice moves), and a graph keyed on them
recompiles each time: compiling the cached model's forward as it is makes decoding slower,
not faster. Here every shape is fixed for the whole generation but one:
  - the cache is the preallocated KVCache, and attention reads every column of its
    buffer, with a mask that hides the columns not written yet (and any left padding);
    the buffer's column count is the one size that may change: the loop grows the cache
    CACHE_GROWTH (64) columns at a time as it fills (generation/loop.py's make_room), and
    the library takes any count up to the generation's (torch.export's dynamic dimension:
    one build);
  - the step's position is a tensor, not a Python int: the write index for the new key and
    value (index_put_ at that column) and the row of the position table it looks up (for
    a Llama-family model, the rotary angles it computes).
A step may also feed a fixed number T > 1 of tokens per row (speculative decoding verifies
its proposals in one such step: generation/speculative.py): T is part of the shape, so each
T is a graph of its own; that step hands back logits, for the proposer's verification.
Reading the whole buffer costs its bytes every step, which is why the loop sizes it to the
generation instead of the whole context (at GPT-2 small a 1024-column cache is 75 MB, more
than half of the int8 weights' bytes), and grows it as it fills instead of allocating it
whole (docs/benchmarks.md measures both).

Ahead of time, not just in time: torch.compile's result runs Python on every call (guards
that check the inputs still match the graph, a wrapper around it), a fixed cost per step
that a small model feels. torch.export and AOTInductor (build_program) make the same graph
into a library called with a list of tensors and nothing else; the sampling is inside it
(sample.sample_with_noise), so a step hands back token ids, and its inputs (position,
noise) are buffers refilled in place: a step allocates nothing but its output. A build
takes tens of seconds; its package is kept on disk (step_cache.py), so each model is built
once per machine and later starts load it.

Only decode is compiled; the prompt's prefill and the reprefill past the context change
shape by nature and stay eager (generation/loop.py). Rows that finish early keep running
(unseen): dropping them would change the batch size and so the graph.
"""

import contextlib
import functools
import itertools
import time
import warnings

import torch

from generation import step_cache
from generation.cpu_layout import unpack_linears
from kv_quant import dtype_name
from sample import sample_with_noise


class StaticCache:
    """The cache of the compiled step (over the KVCache's buffer; of kv_cache.Cache it has
    attend, all that forward_at calls): it
    writes the new columns at a position held in a tensor and attends over the whole buffer,
    so no shape depends on how much has been cached."""

    def __init__(self, kv, new_columns):
        self.kv = kv  # (n_layer, 2, B, n_kv_head, max_len, hd)
        B, nh, T = kv.size(2), kv.size(3), new_columns.size(0)
        # index tensors broadcasting to (2, B, n_kv_head, T): k and v, every row and stored
        # head, the T new columns (new_columns (T,) LongTensor: length, length + 1, ...)
        self.k_or_v = torch.arange(2, device=kv.device).view(2, 1, 1, 1)
        self.rows = torch.arange(B, device=kv.device).view(1, B, 1, 1)
        self.heads = torch.arange(nh, device=kv.device).view(1, 1, nh, 1)
        self.columns = new_columns.view(1, 1, 1, T)

    def attend(self, layer, q, k, v, mask):
        # q (B, nh, T, hd); k, v: (B, n_kv_head, T, hd), written at the new columns of this
        # layer. One index_put_ on the whole buffer, not a write into the view kv[layer]: the
        # compiler turns a write into a view of its input into a copy of the whole buffer
        # (every layer, every step: slower than eager), while a write into the input itself
        # stays in place.
        layer_index = torch.full((1, 1, 1, 1), layer, device=k.device)
        self.kv.index_put_((layer_index, self.k_or_v, self.rows, self.heads, self.columns),
                           torch.stack([k, v]))  # (2, B, n_kv_head, T, hd)
        k_all, v_all = self.kv[layer, 0], self.kv[layer, 1]  # (B, n_kv_head, max_len, hd): every column
        # Attention written out instead of SDPA: for a few queries, inductor fuses these
        # into its own loops, while SDPA's CPU kernel is a separate call costing more than its
        # arithmetic. Unwritten columns masked. With grouped-query attention the query heads
        # sharing a key/value head are its rows: q as (B, n_kv_head, group x T, hd), one
        # matmul per stored head, nothing copied.
        B, nh, T, hd = q.shape
        n_kv = k_all.size(1)
        q = q.reshape(B, n_kv, nh // n_kv * T, hd)                     # (B, n_kv_head, group x T, hd)
        scores = (q @ k_all.transpose(-2, -1)) * hd ** -0.5            # (B, n_kv_head, group x T, max_len)
        scores = scores.view(B, n_kv, nh // n_kv, T, -1)               # (B, n_kv_head, group, T, max_len)
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))  # mask (B, 1, T, max_len)
        weights = scores.float().softmax(-1).to(q.dtype).view(B, n_kv, nh // n_kv * T, -1)
        return (weights @ v_all).view(B, nh, T, hd)


def static_forward(model, tokens, kv, length, pad):
    """Logits (B, T, V) for tokens (B, T) at columns length.. of the cache buffer kv (length:
    (1,) LongTensor); pad (B,): left-padding columns per row (zeros when there is none).

    The cached forward (kv_cache.CachedModel.forward, through the same forward_at) with its
    three parts written with tensors of fixed shape:"""
    max_len = kv.size(4)
    new_columns = length + torch.arange(tokens.size(1), device=kv.device)  # (T,)
    # (1) positions: each row's columns minus its padding, as a tensor (a table row for
    #     GPT-2, rotary angles for Llama: the model's embed_at)
    positions = new_columns[None, :] - pad[:, None]                       # (B, T)
    # (2) the mask over the whole buffer: for the token at column c, the keys up to c (its
    #     own included), none in a row's padding, none not written yet
    columns = torch.arange(max_len, device=kv.device)
    visible = ((columns[None, None, :] <= new_columns[None, :, None])
               & (columns[None, None, :] >= pad[:, None, None]))          # (B, T, max_len)
    mask = visible[:, None]                                               # (B, 1, T, max_len)
    # (3) the cache update, inside attention, as in the eager model: StaticCache.attend
    return model.forward_at(tokens, positions, StaticCache(kv, new_columns), mask)


class StepProgram(torch.nn.Module):
    """One step as the compiled library holds it: static_forward, then, given sampling
    settings, the draw of each row's next token inside the graph too, so that only token
    ids come back (B,) and sampling's dozen small operations are compiled with the rest.
    The settings are fixed per program (each is a graph of its own); the draw's noise comes
    in as an input, filled from the caller's torch.Generator, so a seed still fixes the
    text. Without settings (sampling=None) the step hands back its logits (B, T, V): what
    speculative decoding's verification and its draft need; with greedy_too, the logits and
    each row's greedy token (B,): the serving engine's lone step, whose request may sample
    (from the logits) or not (its token is ready, with no operation run after the step)."""

    def __init__(self, model, sampling, vocab_limit, greedy_too=False):
        super().__init__()
        self.model, self.sampling, self.vocab_limit = model, sampling, vocab_limit
        self.greedy_too = greedy_too

    def forward(self, tokens, kv, length, pad, noise):
        logits = static_forward(self.model, tokens, kv, length, pad)     # (B, T, V)
        if self.sampling is not None:
            return sample_with_noise(logits[:, -1, :self.vocab_limit], noise, **self.sampling)[:, 0]
        if self.greedy_too:
            return logits, sample_with_noise(logits[:, -1, :self.vocab_limit], noise, temperature=0)[:, 0]
        return logits


def export_program(program, example_inputs, dynamic_shapes=None):
    """program traced by torch.export into one graph, every shape fixed by the example
    inputs (their values are not used: tracing runs on stand-ins of the same shapes),
    except the sizes dynamic_shapes names (torch.export's form: per input, {dim: Dim})."""
    with warnings.catch_warnings():  # a deprecation notice inside torch, nothing of ours
        warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)
        return torch.export.export(program, example_inputs, dynamic_shapes=dynamic_shapes, strict=False)


# How inductor builds the library. A decode step's matmuls have one row per sequence: a
# matrix-vector product, which MKL (torch's default kernel) runs far from the memory's speed
# at these sizes. max_autotune times, for every matmul of the step at build time, MKL's
# kernel against inductor's own C++ template (a vectorised micro-kernel generated for that
# exact shape and weight layout) and compiles in the faster: the template won at every
# shape of the bundled model, 3-6x per matmul, and the whole step ran 2-3x faster
# (docs/benchmarks.md). freezing lets inductor treat the weights as constants
# (the library holds its own copy anyway) and lay them out for its kernels once, at build
# time. The timing makes a build slower: 44 s for the bundled model, 95 s for GPT-2 small.
# The last two options keep the timing tables inductor prints while it tunes off the
# user's terminal.
BUILD_OPTIONS = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN", "freezing": True,
                 "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
# A step whose products are all our operators (a quantized model's, a bf16 model's: every
# Linear but a float32 one) gains nothing from freezing or tuning: the operators read the
# weights as they lie. Its library is built without them (package_constants_in_so off) and
# handed the model's own tensors when it is loaded (user-managed constants, never copied):
# the package is code alone, a few MB instead of a second copy of the weights (1.22 GB at the
# 1B shape in int4), and the model's memory is counted once. No max_autotune: inductor's
# matmul template lays a weight out as a constant of its own, which such a library would
# not have (a float product left in the step, a batch's rows past DenseLinear's, is aten's).
OWN_WEIGHTS_OPTIONS = {"freezing": False, "aot_inductor.package_constants_in_so": False}


def reads_own_weights(program):
    """Whether program's library can read the model's tensors where they lie: no float32
    Linear, whose product is inductor's own on a frozen, re-laid-out copy of the weight."""
    return not any(isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float32 for m in program.modules())


@contextlib.contextmanager
def attributes_as_buffers(module):
    """Plain tensor attributes of module and its submodules (llama.py's inv_freq: kept out
    of the buffers so that .to(bfloat16) does not round it) registered as buffers while the
    graph is traced: the library then names each by its path, as it names the weights,
    and load_library can hand it over like them."""
    found = [(m, name, t) for m in module.modules() for name, t in vars(m).items() if isinstance(t, torch.Tensor)]
    for m, name, t in found:
        delattr(m, name)
        m.register_buffer(name, t, persistent=False)
    try:
        yield
    finally:
        for m, name, t in found:
            del m._buffers[name]
            setattr(m, name, t)


class NotCached(LookupError):
    """A step asked for only if its build is in the cache (build_missing=False), and it is not."""


def build_program(program, example_inputs, dynamic_shapes=None, build_missing=True):
    """program ahead of time: exported into one graph, which AOTInductor turns into a C++
    shared library (inductor's generated kernels and the C++ that calls them in turn); a
    function that runs it on a list of input tensors and returns the list of outputs.
    Unlike torch.compile's result, no Python runs per call: no guards checking the
    inputs, no wrapper.

    A float32 model's library keeps its own copy of the weights, laid out for its
    kernels: the model's memory once more while it lives. Any other reads the model's
    tensors where they lie (reads_own_weights). Its package is kept in the user's cache
    (step_cache.py), keyed by the weights (their values where the library holds a copy,
    else their names and shapes), the shapes, the settings and the machine: the next start
    with the same model loads it instead of building it.
    build_missing=False: raises NotCached where it would have to be built."""
    if not build_missing and not step_cache.holds_entries():
        raise NotCached
    own_weights = reads_own_weights(program)
    options = OWN_WEIGHTS_OPTIONS if own_weights else BUILD_OPTIONS

    def build(path):  # the package, written at path
        with attributes_as_buffers(program):
            exported = export_program(program, example_inputs, dynamic_shapes)
        with warnings.catch_warnings():
            # deprecation notices from inside torch (its export, its autotuning), nothing of ours
            warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
            # a copy: torch adds its own entries to the dict it is given, which would change
            # the options, and with them the cache's key, for the next build
            torch._inductor.aoti_compile_and_package(exported, package_path=str(path),
                                                     inductor_configs=dict(options))

    key = step_cache.step_key(program, example_inputs, dynamic_shapes, options, weights_inside=not own_weights)
    load = functools.partial(load_library, weights_of=program if own_weights else None)
    library = step_cache.load_or_build(key, build, load, build_missing)
    if library is None:
        raise NotCached
    return library


def load_library(path, weights_of=None):
    """The package at path loaded: a function of a list of input tensors. Through torch's
    C++ loader itself, which torch._inductor.aoti_load_package wraps: importing
    torch._inductor for the wrapper takes 2-3 s, most of a start that finds the package
    built, and the loader 0.06 s (the bundled model). weights_of: the module whose tensors
    a library built without its weights reads, each found by the path the library names
    it by (user-managed: not copied; check_full_update: every one the library needs)."""
    loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    if weights_of is None:
        return loader.boxed_run
    weights = {name: functools.reduce(getattr, name.split("."), weights_of) for name in loader.get_constant_fqns()}
    loader.load_constants(weights, False, True, True)

    def run(inputs):
        return loader.boxed_run(inputs)
    run.weights = weights  # the library may hold addresses only: no tensor is freed while it lives
    return run


class CompiledStep:
    """The step of one generation's shapes, compiled ahead of time: call decode() once per
    step. Built by compile_for, kept on the model and reused by a later generation of the
    same shapes and settings."""

    def __init__(self, model, kv, tokens_per_step, sampling, vocab_limit, greedy_too=False,
                 max_columns=None, build_missing=True):
        batch_size, device = kv.size(2), kv.device
        vocab = vocab_limit or model.config.vocab_size
        # inputs of the graph, allocated once and refilled in place every step
        self.length = torch.zeros(1, dtype=torch.long, device=device)
        self.no_pad = torch.zeros(batch_size, dtype=torch.long, device=device)  # rows unpadded
        self.noise = torch.ones(batch_size, vocab if sampling else 1, device=device)
        self.generator = None
        self.draws = sampling is not None and sampling["temperature"] > 0
        program = StepProgram(model, sampling, vocab_limit, greedy_too)
        kv = torch.empty_like(kv)  # the real buffer's shape, for tracing (never written)
        tokens = torch.zeros(batch_size, tokens_per_step, dtype=torch.long, device=device)
        # max_columns: the cache's column count (kv's dim 4) a variable of the library, up to
        # max_columns; from 2, as torch.export treats sizes 0 and 1 as constants of their own
        dynamic_columns = (None, {4: torch.export.Dim("columns", min=2, max=max_columns)}, None, None, None)
        self.run = build_program(program, (tokens, kv, self.length, self.no_pad, self.noise),
                                 dynamic_columns if max_columns else None, build_missing)

    def decode(self, tokens, cache):
        """Feed tokens (B, T) at the cache's next columns: each row's next token (B,), or
        the logits (B, T, V) for a program without sampling (and each row's greedy token
        (B,) after them, for one built greedy_too). The step writes its columns into the
        cache's buffer in place, and the cache counts them."""
        tokens = tokens.contiguous()  # the library was built for these strides
        pad = cache.pad.contiguous() if cache.pad is not None else self.no_pad
        self.length.fill_(cache.length)
        if self.draws:  # Exp(1) noise for sample_with_noise's draw
            self.noise.exponential_(generator=self.generator)
        outputs = self.run([tokens, cache.kv, self.length, pad, self.noise])
        cache.length += tokens.size(1)  # the columns the step wrote
        return outputs if len(outputs) > 1 else outputs[0]


def compile_for(model, cache, tokens_per_step=1, sampling=None, vocab_limit=None, greedy_too=False,
                max_columns=None, build_missing=True):
    """The CompiledStep for this cache's shapes, tokens_per_step tokens per row and these
    sampling settings (sample.py's temperature, top_k, top_p, min_p and generator; None: the step
    returns logits, and with greedy_too each row's greedy token among the first vocab_limit
    after them), and the seconds building it took, which the loop reports apart from the
    decode speed. The model keeps the last one it built, reused while shapes, settings
    and weights stay the same (only the last: a float32 one holds a copy of the weights).
    cache: a kv_cache.KVCache in the model's dtype. With max_columns the step takes a cache
    of any number of columns up to that, not only this one's: attention reads every column
    of the buffer, so a cache that grows with the sequence (the loop's, the serving
    engine's lone step's) reads fewer bytes per step while it is short.
    build_missing=False: raises NotCached unless the step's build is in the cache
    (step_cache.py), so that a caller may take the fast path only where it costs no build."""
    if getattr(cache, "kv_dtype", None) != dtype_name(model.lm_head.weight.dtype):
        # the step writes raw keys and values of the model's dtype into the buffer
        raise ValueError("the compiled decode step needs the preallocated cache in the "
                         "model's dtype (no other cache_kind)")
    # the step attends over every column, the unwritten ones masked; but a masked NaN still
    # poisons attention (0 x NaN = NaN), and the buffer is torch.empty: any bits at all.
    # Zero what has not been written, once per generation.
    cache.kv[..., cache.length:, :].zero_()
    generator = sampling and sampling["generator"]
    settings = sampling and {k: sampling.get(k) for k in ("temperature", "top_k", "top_p", "min_p")}
    unpack_linears(model)  # the graph reads the dense weights; inductor lays them out itself
    # the library holds the weights as they were: a weight written in place since (its
    # version counter moved) or replaced (another tensor) means a new build
    weights = tuple((t.data_ptr(), t._version) for t in itertools.chain(model.parameters(), model.buffers()))
    # with max_columns the column count is a variable of the library, which takes any up to it
    shape = tuple(cache.kv.shape)
    if max_columns is not None:
        shape = (*shape[:4], f"up to {max_columns}", shape[5])
    key = (shape, cache.kv.dtype, str(cache.kv.device), tokens_per_step,
           settings and tuple(settings.values()), vocab_limit, greedy_too, weights)
    t0 = time.perf_counter()
    built = getattr(model, "_compiled_step", None)
    if built is None or built[0] != key:
        model._compiled_step = None  # free the old one's weights before building
        model._compiled_step = key, CompiledStep(model, cache.kv, tokens_per_step, settings,
                                                 vocab_limit, greedy_too, max_columns, build_missing)
    step = model._compiled_step[1]
    step.generator = generator
    return step, time.perf_counter() - t0
