"""
Our checkpoint (or a Hugging Face GPT-2 directory) -> one GGUF file that llama.cpp runs,
and with it ollama, LM Studio and llama-cpp-python, under llama.cpp's own architecture for
the model: 'gpt2', or for a Llama-style checkpoint 'llama' ('qwen2' with biases on q, k, v;
'qwen3' with q/k norms):

    python export_gguf.py [CKPT] OUT.gguf [--outtype f32|f16|bf16|q8_0|q4_0]
    python export_gguf.py --hf DIR OUT.gguf
    llama-completion -m OUT.gguf -p "ROMEO:" -n 100     (llama.cpp; older builds: llama-cli)

GGUF is llama.cpp's single-file format: key-value metadata (the architecture's shape,
the tokenizer) followed by the tensors. It is written here with `gguf`, the format's own
Python library (pip install gguf), straight from the model object the loaders return, so
nothing goes through Hugging Face files or llama.cpp's conversion scripts. What llama.cpp's
'gpt2' architecture reads (its src/models/gpt2.cpp and llama-vocab.cpp):
  - gpt2.context_length, embedding_length, feed_forward_length, block_count,
    attention.head_count, attention.layer_norm_epsilon;
  - our weights under its tensor names, in our own nn.Linear (out, in) layout, which is
    ggml's too; every bias (GPT-2 always has them); no output.weight, so that llama.cpp
    ties the output projection to token_embd, as we do;
  - the tokenizer as GPT-2's byte-level BPE: tokens (one per id), token types, merges in
    priority order, the 'gpt-2' pre-tokenizer (GPT-2's regex) and end-of-text as BOS/EOS,
    so that llama.cpp turns text into exactly our ids.
"""

import dataclasses
from collections import Counter

from plumbing.script import UserError, begin, run

if __name__ == "__main__":  # run as a command; importing this file changes nothing
    begin()  # before torch: Ctrl-C during the slow imports ends quietly (plumbing/script.py)

import numpy as np  # noqa: E402
import tiktoken  # noqa: E402

from export_hf import gpt2_state_dict, gpt2_tokenizer_files, llama_fp32_tensors, llama_model_type  # noqa: E402
from llama import rope_frequencies  # noqa: E402
from plumbing.checkpoint import NAIVE_MODELS  # noqa: E402
from plumbing.cli import ArgumentParser, load_source  # noqa: E402
from plumbing.outputs import MARK, check_output_path, write_atomically  # noqa: E402

OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
QUANTIZED = {"bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0"}  # outtype -> gguf.GGMLQuantizationType (gguf.quants encodes it)
# PyTorch's nn.LayerNorm default, which base_model uses; llama.cpp has no default for it
LAYER_NORM_EPS = 1e-5
# our parameter name -> llama.cpp's tensor (gguf.MODEL_TENSOR), per block and global:
# base_model's for 'gpt2', llama.py's for 'llama', 'qwen2' and 'qwen3'
BLOCK_TENSORS = {"ln_1": "ATTN_NORM", "attn.c_attn": "ATTN_QKV", "attn.c_proj": "ATTN_OUT",
                 "ln_2": "FFN_NORM", "mlp.c_fc": "FFN_UP", "mlp.c_proj": "FFN_DOWN",
                 "input_layernorm": "ATTN_NORM", "self_attn.q_proj": "ATTN_Q",
                 "self_attn.k_proj": "ATTN_K", "self_attn.v_proj": "ATTN_V",
                 "self_attn.o_proj": "ATTN_OUT", "self_attn.q_norm": "ATTN_Q_NORM",
                 "self_attn.k_norm": "ATTN_K_NORM", "post_attention_layernorm": "FFN_NORM",
                 "mlp.gate_proj": "FFN_GATE", "mlp.up_proj": "FFN_UP", "mlp.down_proj": "FFN_DOWN"}
GLOBAL_TENSORS = {"transformer.wte": "TOKEN_EMBD", "transformer.wpe": "POS_EMBD",
                  "transformer.ln_f": "OUTPUT_NORM", "model.embed_tokens": "TOKEN_EMBD",
                  "model.norm": "OUTPUT_NORM", "lm_head": "OUTPUT", "rope_freqs": "ROPE_FREQS"}
LLAMA_ARCHES = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3"}  # export_hf.llama_model_type -> gguf.MODEL_ARCH


def import_gguf():
    """The gguf package, imported only when a file is written: nothing else needs it."""
    try:
        import gguf
    except ImportError:
        raise UserError("writing GGUF needs the gguf package: pip install gguf "
                        "(or pip install -r requirements-dev.txt)") from None
    return gguf


# ---------------------------------------------------------------------------- tensors

def gguf_name(key, gguf):
    """'transformer.h.3.mlp.c_fc.weight' -> 'blk.3.ffn_up.weight' (names from the gguf package)."""
    module, kind = key.rsplit(".", 1)  # kind: weight or bias
    if module.startswith(("transformer.h.", "model.layers.")):
        block, part = module.removeprefix("transformer.h.").removeprefix("model.layers.").split(".", 1)
        template = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[BLOCK_TENSORS[part]]]
        return f"{template.format(bid=int(block))}.{kind}"
    return f"{gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[GLOBAL_TENSORS[module]]]}.{kind}"


def encode_tensor(name, array, outtype, gguf):
    """(data, ggml type) of one fp32 tensor in the chosen outtype. As llama.cpp's own
    converter does, 1-D tensors (norms, biases) and the position table stay f32 (its
    kernels expect them so), and q8_0 and q4_0 fall back to f16 for a tensor whose rows are
    not a whole number of 32-value blocks (they store one scale per block of a row)."""
    types = gguf.GGMLQuantizationType
    positions = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.POS_EMBD]
    if outtype == "f32" or array.ndim == 1 or name.startswith(positions):
        return array, types.F32
    if outtype in QUANTIZED:
        kind = types[QUANTIZED[outtype]]
        if array.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0] == 0:
            return gguf.quants.quantize(array, kind), kind
    return array.astype(np.float16), types.F16


def gguf_tensors(model, outtype, gguf):
    """Yield (gguf name, data, ggml type) for every tensor llama.cpp's graph for the model reads."""
    tensors = gpt2_state_dict(model).items() if model.config.family == "gpt" else llama_tensors(model)
    for key, tensor in tensors:
        name = gguf_name(key, gguf)
        yield (name, *encode_tensor(name, tensor.numpy(), outtype, gguf))


def llama_tensors(model):
    """Yield (name, fp32 tensor) of a Llama-style model as llama.cpp reads them, one at a
    time (export_hf.llama_fp32_tensors: a tied output layer is left out, and llama.cpp ties
    it to token_embd as we do; an 8B model in bf16 is converted a tensor at a time, its
    quantized file's tensors the only ones held). Two changes:
      - llama.cpp's 'llama' graph rotates channel pairs (2i, 2i+1), Meta's original layout,
        where ours (Hugging Face's) pairs i with i + head_dim/2: each head's q and k rows
        are interleaved to match (the same reordering llama.cpp's converter makes). Its
        'qwen2' and 'qwen3' graphs pair as we do: nothing to reorder;
      - Llama 3's rope scaling travels as a tensor, rope_freqs: for each pair, how many
        times slower it turns than plain RoPE would turn it."""
    config = model.config
    pairs_differ = llama_model_type(config)[0] == "llama"
    for key, tensor in llama_fp32_tensors(model):
        if pairs_differ and key.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            tensor = interleave_rotary_pairs(tensor, config.n_head if ".q_proj." in key else config.n_kv_head)
        yield key, tensor
    if (config.rope_scaling or {}).get("rope_type") == "llama3":
        plain = rope_frequencies(dataclasses.replace(config, rope_scaling=None))
        yield "rope_freqs.weight", plain / rope_frequencies(config)


def interleave_rotary_pairs(weight, n_heads):
    """Rows of q or k (n_heads * head_dim, ...) from the pairing (i, i + head_dim/2) to
    (2i, 2i + 1), head by head."""
    rows = weight.shape[0]
    halves = weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:])  # (heads, half, i, ...)
    return halves.transpose(1, 2).reshape(weight.shape)


# ---------------------------------------------------------------------------- tokenizer

def gguf_vocab(tokenizer, vocab_size, gguf):
    """(tokens, token types, merges) for llama.cpp's GPT-2 BPE, one token per embedding row.

    export_hf.gpt2_tokenizer_files recovers GPT-2's text form (each byte as a visible
    character, 'Ġ' for a space) and the merge list from tiktoken's ranks. Ids the tokenizer
    does not use (rows that pad the embedding table) become unused placeholder tokens:
    llama.cpp wants exactly one token per row."""
    vocab, merges = gpt2_tokenizer_files(tokenizer)
    if vocab is None:
        raise UserError(f"tokenizer {tokenizer.name} cannot be written for llama.cpp: {merges}")
    if not merges:  # llama.cpp refuses a BPE without merges, the gguf package an empty array
        raise UserError(f"tokenizer {tokenizer.name} cannot be written for llama.cpp: it has no "
                        "merges (bytes only), and llama.cpp's GPT-2 tokenizer needs at least one")
    by_id = {i: text for text, i in vocab.items()}
    specials = set(tokenizer._special_tokens.values())
    kinds = gguf.TokenType
    tokens, types = [], []
    for i in range(vocab_size):
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        types.append(kinds.CONTROL if i in specials else kinds.NORMAL if i in by_id else kinds.UNUSED)
    return tokens, types, merges


# ---------------------------------------------------------------------------- the file

def add_llama_shape(writer, c, gguf):
    """The metadata llama.cpp's llama, qwen2 and qwen3 graphs read for the model's shape."""
    writer.add_context_length(c.context_len)
    writer.add_embedding_length(c.n_embd)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_block_count(c.n_layer)
    writer.add_head_count(c.n_head)
    writer.add_head_count_kv(c.n_kv_head)
    writer.add_key_length(c.head_dim)  # Qwen3's heads need not be n_embd / n_head wide
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.norm_eps)
    if (c.rope_scaling or {}).get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(c.rope_scaling["factor"])


def add_metadata(writer, model, tokenizer, outtype, name, gguf):
    c = model.config
    writer.add_name(name)
    # cli.MARK in the first metadata: a later export recognises a file it may replace
    # (cli.check_output_path); a GGUF downloaded from elsewhere never carries it
    writer.add_description(f"exported by {MARK} export_gguf.py")
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                          "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[outtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if c.family == "llama":
        add_llama_shape(writer, c, gguf)
    else:
        writer.add_context_length(c.context_len)
        writer.add_embedding_length(c.n_embd)
        writer.add_feed_forward_length(4 * c.n_embd)
        writer.add_block_count(c.n_layer)
        writer.add_head_count(c.n_head)
        writer.add_layer_norm_eps(LAYER_NORM_EPS)
    tokens, types, merges = gguf_vocab(tokenizer, c.vocab_size, gguf)
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for GPT-2-style byte-level BPE
    writer.add_tokenizer_pre("gpt-2")   # ... and for GPT-2's pre-tokenisation regex
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_add_bos_token(False)  # GPT-2 starts a text with nothing; neither do we (our checkpoints)
    eot = tokenizer._special_tokens.get("<|endoftext|>")
    if eot is not None:  # without one, llama.cpp falls back to its own default ids
        writer.add_bos_token_id(eot)
        writer.add_eos_token_id(eot)


def write_gguf(path, model, tokenizer, outtype, name):
    """Write the whole file to `path`; returns how many tensors of each ggml type it holds."""
    gguf = import_gguf()
    arch = "GPT2" if model.config.family == "gpt" else LLAMA_ARCHES[llama_model_type(model.config)[0]]
    writer = gguf.GGUFWriter(path, arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[arch]])
    try:
        add_metadata(writer, model, tokenizer, outtype, name, gguf)
        counts = Counter()
        for tensor_name, data, ggml_type in gguf_tensors(model, outtype, gguf):
            writer.add_tensor(tensor_name, data, raw_dtype=ggml_type)
            counts[ggml_type.name] += 1
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return counts


def export(source, out, outtype="f32", hf=False, report=print):
    """Export a checkpoint (or, with hf=True, a Hugging Face GPT-2 directory) to OUT.gguf."""
    if not str(out).endswith(".gguf"):
        raise UserError(f"{out}: the output file must end in .gguf")
    # an existing file is replaced only when it is empty or an earlier export (it carries
    # MARK): a slip of the hand (`export_gguf.py ckpt.pt`) can never destroy a checkpoint
    out = check_output_path(out, "gguf")
    import_gguf()  # a missing package is reported before the model is loaded
    model, tokenizer = load_source(NAIVE_MODELS, None if hf else source, source if hf else None,
                                   report=report)
    if not isinstance(tokenizer, tiktoken.Encoding):  # a Llama-family --hf directory's tokenizer.json
        raise UserError(f"{source}: its tokenizer.json is not written to GGUF here (only the "
                        "GPT-2-style BPE our checkpoints carry); llama.cpp's convert_hf_to_gguf.py "
                        "converts a Hugging Face Llama, Mistral or Qwen directory")
    counts = Counter()  # filled by the writer: a temporary file beside OUT, renamed over it
    write_atomically(out, lambda tmp: counts.update(write_gguf(tmp, model, tokenizer, outtype, out.stem)))
    tensors = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
    report(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB; tensors: {tensors}; "
           f"tokenizer {tokenizer.name} as GPT-2 BPE, {model.config.vocab_size} tokens)")


def main():
    parser = ArgumentParser(description="Export a checkpoint (or --hf DIR) as one GGUF file for "
                            "llama.cpp, ollama, LM Studio and llama-cpp-python.")
    # argparse fills a leading optional positional only when both are given
    parser.add_argument("ckpt", nargs="?", metavar="CKPT", help="checkpoint file (default: "
                        "checkpoints/ckpt_sft.pt, then ckpt_base.pt, then the bundled model)")
    parser.add_argument("out", metavar="OUT.gguf", help="output file, ending in .gguf; an existing "
                        "one is replaced only if an earlier export wrote it")
    parser.add_argument("--hf", metavar="DIR", help="export a local Hugging Face GPT-2 directory instead")
    parser.add_argument("--outtype", choices=OUTTYPES, default="f32",
                        help="f32: exact; f16, bf16: half the size; q8_0: 8-bit blocks, about a quarter; "
                        "q4_0: 4-bit blocks, about an eighth (norms, biases and positions stay "
                        "f32) (default: f32)")
    args = parser.parse_args()
    if args.hf and args.ckpt:
        raise UserError("give either CKPT or --hf DIR, not both")
    export(args.hf or args.ckpt, args.out, args.outtype, hf=bool(args.hf))


if __name__ == "__main__":
    run(main)
