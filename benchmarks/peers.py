"""
The systems people actually use, measured on identical weights next to ours:
Hugging Face transformers (GPT2LMHeadModel.generate) and llama.cpp, the C++ engine behind
ollama and LM Studio (through its Python binding, llama-cpp-python). transformers has its
own table (transformers_table); llama.cpp's engines are contestants in the decode-speed table
(decode_speed.py), next to ours in each of its forms.

Each peer gets our exact weights (transformers through export_hf's state dict, llama.cpp
through a GGUF file written by export_gguf), the same prompt, the same length and greedy
decoding, and its tokens are compared with ours: a speed figure means little if the
two models are not computing the same thing.
"""

import contextlib
import itertools
import tempfile
import time
from pathlib import Path

import tiktoken
import torch
# the hook torch documents for seeing every operation ("Extending PyTorch": TorchDispatchMode)
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.timing import alternate, spread
from generation.loop import synchronize
from plumbing.outputs import signals_raise, write_failure
from plumbing.script import UserError

PROMPT_TOKENS = 16
LLAMA_OUTTYPES = ("f32", "f16", "q8_0", "q4_0")  # f32 is the like-for-like one; the others for reference
INSTALL_LLAMA_CPP = ("pip install -r requirements-llama.txt (llama-cpp-python builds llama.cpp "
                     "from source: about 12 minutes on 2 cores)")


def random_prompt(vocab_size, device="cpu"):
    """The same 16 random tokens for every contestant (1, 16)."""
    return torch.randint(vocab_size, (1, PROMPT_TOKENS), device=device,
                         generator=torch.Generator(device).manual_seed(0))


# ---------------------------------------------------------------------------- transformers

def transformers_twin(ours, device):
    """transformers' GPT2LMHeadModel holding our model's weights (export_hf's state dict);
    None when transformers is not installed. Its end-of-text id is 0, a token our models
    never produce: min_new_tokens then keeps it from ending a run early, and nothing else."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    from export_hf import hf_config, hf_state_dict
    theirs = GPT2LMHeadModel(GPT2Config(**hf_config(ours.config, eot=0)))
    theirs.load_state_dict(hf_state_dict(ours), strict=False)  # lm_head: tied to wte
    return theirs.to(device).eval()


def transformers_peer(shape, ours, device, n, reps):
    """Hugging Face transformers' GPT2LMHeadModel.generate() on identical weights, taking
    turns with ours (and with its static cache where this version runs it), and the torch
    operations each side runs a token; None when transformers is not installed."""
    theirs = transformers_twin(ours, device)
    if theirs is None:
        return None
    prompt = random_prompt(ours.config.vocab_size, device)

    def ours_generate(tokens=n):
        return ours.generate(prompt, tokens, temperature=0)

    def hf_generate(tokens=n, **kw):
        with torch.inference_mode():
            return theirs.generate(prompt, attention_mask=torch.ones_like(prompt),
                                   do_sample=False, max_new_tokens=tokens,
                                   min_new_tokens=tokens, pad_token_id=0, **kw)

    ours_tokens = ours_generate()
    result = {"shape": shape, "tokens": n,
              "greedy_tokens_match": torch.equal(ours_tokens, hf_generate())}
    contestants = {"ours": ours_generate, "hf": hf_generate}
    try:  # the static cache is newer, and not every version runs it on every device
        static = hf_generate(cache_implementation="static")
        result["static_tokens_match"] = torch.equal(ours_tokens, static)
        contestants["hf_static"] = lambda: hf_generate(cache_implementation="static")
    except Exception as e:
        result["hf_static_error"] = f"{type(e).__name__}: {str(e)[:100]}"
    # (a static cache that ran once above runs in the timed turns too)
    rates = alternate({name: rate_meter(fn, n, device) for name, fn in contestants.items()}, reps)
    result.update({f"{name}_tok_s": spread(values) for name, values in rates.items()})
    result["speedup_vs_hf"] = result["ours_tok_s"]["median"] / result["hf_tok_s"]["median"]
    result["operations_per_token"] = {"ours": operations_per_token(ours_generate),
                                      "hf": operations_per_token(hf_generate)}
    return result


def rate_meter(generate, n, device):
    """A function that runs generate() (n tokens) and returns its tokens per second: what
    benchmarks.timing.alternate calls in turns."""
    def once():
        synchronize(device)
        t0 = time.perf_counter()
        generate()
        synchronize(device)
        return n / (time.perf_counter() - t0)
    return once


class OperationCount(TorchDispatchMode):
    """Counts the torch operations run while it is active: every call that reaches torch's
    dispatcher (aten.linear, aten.layer_norm, a view...), whatever Python made it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def operations_per_token(generate, short=8, long=24):
    """The torch operations one more token costs, generate(tokens) being a whole greedy
    generation: counted over two lengths and differenced, so that the prompt's prefill and
    the set-up are left out. A count, not a time: it does not vary from run to run, and on a
    small model, where each operation costs more in dispatch than in arithmetic, it is what
    a decode step's length is made of."""
    counts = []
    for tokens in (short, long):
        with OperationCount() as counter:
            generate(tokens)
        counts.append(counter.count)
    return (counts[1] - counts[0]) / (long - short)


def transformers_table(models, device, n, reps):
    """transformers_peer on each of {name: model}: {"peer": rows, "peer_note": None}, or
    no rows and a note saying how to install transformers."""
    rows = [transformers_peer(name, model, device, n, reps) for name, model in models.items()]
    if None in rows:
        return {"peer": None, "peer_note": "skipped: transformers is not installed "
                                           "(pip install -r requirements-dev.txt)"}
    return {"peer": rows, "peer_note": None}


# ---------------------------------------------------------------------------- llama.cpp

def llama_cpp_missing():
    """None when llama-cpp-python and gguf (which writes the files) import, else one line
    saying how to install what is missing."""
    try:
        import llama_cpp  # noqa: F401  (optional: only this peer and its tests need it)
    except ImportError:
        return f"skipped: llama-cpp-python is not installed; {INSTALL_LLAMA_CPP}"
    try:
        import gguf  # noqa: F401
    except ImportError:
        return "skipped: the gguf package is not installed; pip install -r requirements-dev.txt"
    return None


def placeholder_tokenizer():
    """A GGUF file must carry a tokenizer, but the peer feeds token ids, never text: the
    256 bytes and one merge stand in for any model's (random-weight shapes have none)."""
    from plumbing.hf_bpe import GPT2_PATTERNS
    ranks = {bytes([b]): b for b in range(256)} | {b"  ": 256}
    return tiktoken.Encoding(name="placeholder", pat_str=GPT2_PATTERNS[0], mergeable_ranks=ranks,
                             special_tokens={})


def load_llama(path, n_ctx, threads, draft_model=None):
    """llama.cpp on a GGUF file, CPU only, with its own log output silenced. draft_model:
    llama-cpp-python's proposer for speculative decoding (LlamaPromptLookupDecoding)."""
    from llama_cpp import Llama
    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                 n_threads_batch=threads, n_gpu_layers=0, verbose=False, draft_model=draft_model)


def llama_greedy(llm, prompt, n):
    """n greedy tokens from llama.cpp (its own greedy sampler: the argmax of the logits)."""
    llm.reset()  # a fresh context: nothing of the last run's prompt is reused
    return list(itertools.islice(llm.generate(prompt, temp=0.0, repeat_penalty=1.0), n))


def leading_matches(a, b):
    """How many tokens two generations share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def gguf_weight_bytes(path):
    """Bytes of weights one decode step reads from a GGUF file: every matrix once (the
    token embedding too: llama.cpp's output layer is tied to it), the position table left
    out (a step reads one row), as for ours in weight_formats.weight_bytes_per_token."""
    import gguf
    positions = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.POS_EMBD]
    reader = gguf.GGUFReader(path)
    nbytes = sum(int(t.n_bytes) for t in reader.tensors
                 if len(t.shape) == 2 and not t.name.startswith(positions))
    del reader  # it maps the file
    return nbytes


@contextlib.contextmanager
def llama_cpp_engines(label, model, outtypes=LLAMA_OUTTYPES):
    """{outtype: (llama.cpp on our weights exported to GGUF in that type, the bytes of weights
    a step reads, the seconds export and load took)}, in a temporary folder that goes, with
    the engines, when the block ends. model: the fp32 weights. CPU only, torch's thread count."""
    from export_gguf import write_gguf
    # SIGTERM meanwhile raises, so that the folder and its GGUF files still go (outputs.py)
    with signals_raise(), tempfile.TemporaryDirectory() as folder:
        engines = {}
        try:
            for outtype in outtypes:
                path = Path(folder) / f"{outtype}.gguf"
                t0 = time.perf_counter()
                try:
                    write_gguf(path, model, placeholder_tokenizer(), outtype, label)
                except OSError as e:  # a full disk, a file-size limit: one line, not a traceback
                    raise UserError(f"cannot write the GGUF for llama.cpp in {folder} "
                                    f"({write_failure(e, path)})") from None
                llm = load_llama(path, model.config.context_len, torch.get_num_threads())
                engines[outtype] = (llm, gguf_weight_bytes(path), time.perf_counter() - t0)
            yield engines
        finally:
            for llm, _, _ in engines.values():
                llm.close()  # before the folder (and the files it maps) goes
