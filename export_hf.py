"""
Our checkpoint -> a Hugging Face directory that transformers loads unchanged: GPT2LMHeadModel
for a GPT-2-style checkpoint, LlamaForCausalLM for a Llama-style one (Qwen2ForCausalLM with
biases on q, k, v; Qwen3ForCausalLM with q/k norms):

    python export_hf.py [CKPT] OUT_DIR      (CKPT: default chain, as in every script)

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(OUT_DIR)
    tokenizer = AutoTokenizer.from_pretrained(OUT_DIR)   # when it was exported

Writes config.json, the weights (model.safetensors, or pytorch_model.bin without the
safetensors package) and, for a GPT-2-style byte-level BPE tokenizer (the bundled ones
are), the tokenizer: vocab.json + merges.txt + tokenizer_config.json for GPT-2, tokenizer.json
+ tokenizer_config.json (written with the `tokenizers` library) for the Llama family, whose
--hf loader reads tokenizer.json. GPT-2's weights go in HF's Conv1D layout; the Llama
family's need nothing: llama.py uses its names. transformers is not needed here;
plumbing/hf.py holds the layout knowledge both ways.
"""

import json

from plumbing.script import UserError, begin, run

if __name__ == "__main__":  # run as a command; importing this file changes nothing
    begin()  # before torch: Ctrl-C during the slow imports ends quietly (plumbing/script.py)

import torch  # noqa: E402

from plumbing.checkpoint import NAIVE_MODELS, load_model  # noqa: E402
from plumbing.cli import ArgumentParser  # noqa: E402
from plumbing.hf import swap_conv1d  # noqa: E402
from plumbing.hf_bpe import GPT2_PATTERNS  # noqa: E402
from plumbing.hf_tokenizer import byte_to_char  # noqa: E402
from plumbing.outputs import check_output_path, new_directory  # noqa: E402


def llama_model_type(config):
    """The Hugging Face class a LlamaConfig is: (model_type, architecture)."""
    if config.qkv_bias and config.qk_norm:
        raise UserError("a model with both qkv biases and q/k norms is none of Hugging Face's "
                        "Llama, Qwen2, Qwen3: it cannot be exported")
    if config.qkv_bias:
        return "qwen2", "Qwen2ForCausalLM"
    return ("qwen3", "Qwen3ForCausalLM") if config.qk_norm else ("llama", "LlamaForCausalLM")


def hf_llama_config(config, eot):
    """config.json of a Llama-family model: its class's names for our LlamaConfig fields, rope
    settings in the form every reader takes (rope_theta and rope_scaling)."""
    model_type, architecture = llama_model_type(config)
    return {
        "model_type": model_type, "architectures": [architecture],
        "vocab_size": config.vocab_size, "max_position_embeddings": config.context_len,
        "hidden_size": config.n_embd, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head, "head_dim": config.head_dim,
        "hidden_act": "silu", "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling, "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "use_sliding_window": False, "sliding_window": None, "use_cache": True,
        "torch_dtype": "float32", "bos_token_id": eot, "eos_token_id": eot,
    }


def hf_config(config, eot):
    """config.json: GPT2Config's names for our GPTConfig fields (hf_llama_config for the Llama family)."""
    if config.family == "llama":
        return hf_llama_config(config, eot)
    return {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
        "vocab_size": config.vocab_size, "n_positions": config.context_len, "n_ctx": config.context_len,
        "n_embd": config.n_embd, "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
        "scale_attn_weights": True, "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": eot, "eos_token_id": eot,
    }


def gpt2_state_dict(model):
    """Our state dict as every GPT-2 file has it: fp32, contiguous, lm_head left out (it is
    tied to wte; safetensors refuses one tensor saved twice) and every bias present. GPT-2
    always has biases, so a model trained without them gets zeros, which compute the same."""
    # contiguous: our Linear weights are stored column-major, file writers want plain tensors
    sd = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()
          if k != "lm_head.weight"}
    if not model.config.bias:
        for name, module in model.named_modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.LayerNorm)) and name != "lm_head":
                sd[f"{name}.bias"] = torch.zeros(module.weight.size(0))
    return sd


def hf_state_dict(model):
    """Our state dict in the HF class's layout: GPT2LMHeadModel's Conv1D weights are (in, out);
    a Llama's are ours (llama_fp32_tensors)."""
    if model.config.family == "gpt":
        return swap_conv1d(gpt2_state_dict(model))
    return dict(llama_fp32_tensors(model))


def llama_fp32_tensors(model):
    """Yield (name, tensor) of a Llama-family model's state dict, each fp32, contiguous and
    on the CPU, a tied lm_head left out (its embedding is it). One at a time: a bf16 model
    of 8B parameters would be 32 GB converted all at once."""
    for key, tensor in model.state_dict().items():
        if not (key == "lm_head.weight" and model.config.tie_embeddings):
            yield key, tensor.detach().float().cpu().contiguous()


def write_weights(state_dict, out_dir, use_safetensors=None):
    """model.safetensors when the package is there, else pytorch_model.bin: the file's name."""
    if use_safetensors is None:
        try:
            import safetensors  # noqa: F401  (optional dependency)
            use_safetensors = True
        except ImportError:
            use_safetensors = False
    if use_safetensors:
        from safetensors.torch import save_file
        save_file(state_dict, out_dir / "model.safetensors", metadata={"format": "pt"})  # HF checks 'format'
        return "model.safetensors"
    torch.save(state_dict, out_dir / "pytorch_model.bin")
    return "pytorch_model.bin"


def split_token(token, ranks):
    """The pair whose merge made `token`: replay BPE on its bytes with only the merges ranked
    below it (tiktoken's rule, lowest joined rank first) until two parts remain. None when
    the ranks are not a BPE merge order."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        rank, i = min((ranks.get(a + b, limit), i) for i, (a, b) in enumerate(zip(parts, parts[1:])))
        if rank >= limit:
            return None
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts if len(parts) == 2 and all(ranks[p] < limit for p in parts) else None


def gpt2_tokenizer_files(tokenizer):
    """(vocab.json dict, merges.txt lines) for a tiktoken BPE, or (None, reason) when HF's
    GPT-2 tokenizer could not reproduce it. tiktoken keeps token bytes -> rank only; the
    merge list HF needs is recovered token by token with split_token."""
    # _pat_str, _mergeable_ranks, _special_tokens: how tiktoken's README ("Extending
    # tiktoken") reads an Encoding's parts
    if tokenizer._pat_str not in GPT2_PATTERNS:
        return None, "its pre-tokenisation regex is not GPT-2's, which HF's GPT-2 tokenizer hard-codes"
    ranks, specials = tokenizer._mergeable_ranks, tokenizer._special_tokens
    if any(bytes([b]) not in ranks for b in range(256)):
        return None, "it cannot encode every byte"
    char = byte_to_char()
    text = {tok: "".join(char[b] for b in tok) for tok in ranks}
    merges = []
    for tok in sorted((t for t in ranks if len(t) > 1), key=ranks.get):
        pair = split_token(tok, ranks)
        if pair is None:
            return None, f"token {tok!r} is not a merge of two earlier tokens"
        merges.append(f"{text[pair[0]]} {text[pair[1]]}")
    vocab = {text[tok]: rank for tok, rank in ranks.items()}
    return {**vocab, **specials}, merges


def write_tokenizer(tokenizer, out_dir, context_len, family="gpt"):
    """vocab.json + merges.txt + tokenizer_config.json (tokenizer.json for the Llama family);
    returns one line saying what happened."""
    vocab, merges = gpt2_tokenizer_files(tokenizer)
    if vocab is None:
        return (f"tokenizer NOT exported ({merges}); encode with tiktoken, as checkpoint.load_model "
                "returns it, and feed the ids to the HF model")
    if family == "llama":
        return write_tokenizer_json(tokenizer, vocab, merges, out_dir, context_len)
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merges_text = "#version: 0.2\n" + "".join(m + "\n" for m in merges)
    (out_dir / "merges.txt").write_text(merges_text, encoding="utf-8")
    eot = "<|endoftext|>" if "<|endoftext|>" in tokenizer._special_tokens else None
    config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": context_len,
              "add_prefix_space": False, "bos_token": eot, "eos_token": eot, "unk_token": eot}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return (f"tokenizer {tokenizer.name} ({tokenizer.n_vocab} tokens, {len(merges)} merges) "
            "as vocab.json + merges.txt")


def write_tokenizer_json(tokenizer, vocab, merges, out_dir, context_len):
    """The same byte-level BPE as tokenizer.json, GPT-2's pre-tokenisation and decoder, the
    special tokens added as such; tokenizer_config.json names <|endoftext|> for BOS and EOS
    and adds neither (the model was trained with it between plays, not before prompts)."""
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        return "tokenizer NOT exported (it needs the tokenizers package: pip install -r requirements.txt)"
    specials = tokenizer._special_tokens
    ordinary = {text: i for text, i in vocab.items() if text not in specials}
    bpe = Tokenizer(models.BPE(vocab=ordinary, merges=[tuple(m.split(" ")) for m in merges]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    for text, _ in sorted(specials.items(), key=lambda item: item[1]):  # ids in order: they follow the ranks
        bpe.add_special_tokens([AddedToken(text, special=True, normalized=False)])
    bpe.save(str(out_dir / "tokenizer.json"))
    eot = "<|endoftext|>" if "<|endoftext|>" in specials else None
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context_len,
              "bos_token": eot, "eos_token": eot, "add_bos_token": False, "add_eos_token": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return (f"tokenizer {tokenizer.name} ({tokenizer.n_vocab} tokens, {len(merges)} merges) "
            "as tokenizer.json")


def export(ckpt, out_dir, report=print, use_safetensors=None):
    """Write the HF directory out_dir (new or empty, checked before the model is loaded). It
    appears only complete: the files are written into a temporary folder beside it, which
    is renamed at the end (cli.new_directory), so a failure leaves nothing behind."""
    out_dir = check_output_path(out_dir, "dir")
    model, tokenizer = load_model(NAIVE_MODELS, ckpt, report=report)
    eot = tokenizer._special_tokens.get("<|endoftext|>")
    with new_directory(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(hf_config(model.config, eot), indent=2))
        weights = write_weights(hf_state_dict(model), tmp, use_safetensors)
        tokenizer_note = write_tokenizer(tokenizer, tmp, model.config.context_len, model.config.family)
    report(f"wrote {out_dir}: config.json, {weights}; {tokenizer_note}")


def main():
    parser = ArgumentParser(description="Export a checkpoint as a Hugging Face directory that "
                            "transformers loads: GPT2LMHeadModel, or LlamaForCausalLM (Qwen2, Qwen3) "
                            "for a Llama-style checkpoint.")
    # argparse fills a leading optional positional only when both are given
    parser.add_argument("ckpt", nargs="?", metavar="CKPT", help="checkpoint file (default: "
                        "checkpoints/ckpt_sft.pt, then ckpt_base.pt, then the bundled model)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="output directory: new or empty")
    args = parser.parse_args()
    export(args.ckpt, args.out_dir)


if __name__ == "__main__":
    run(main)
