"""
Hugging Face Llama-family directories -> a llama.LlamaConfig and the model's tokenizer
(`--hf DIR` in every script): LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and
Qwen3ForCausalLM, config.json's model_type llama, mistral, qwen2 and qwen3.

llama.py uses these models' own parameter names, so the weights need no conversion
(plumbing/hf.py reads them, one file or shards). What differs between the four is a few
settings: Qwen2 puts biases on q, k and v, Qwen3 an RMSNorm on each head's q and k, and
Mistral (or a Qwen with use_sliding_window) attends over a sliding window: with the
context cut to the window, full attention is the window's, exactly, so that is what the
config gets. rope settings are read in both forms transformers writes: rope_theta and
rope_scaling (4.x), or rope_parameters (5.x).
"""

from plumbing.hf_tokenizer import read_tokenizer
from plumbing.files import read_json
from plumbing.model_config import config_from_dict
from plumbing.script import CheckpointError, short_repr

LLAMA_MODEL_TYPES = {"llama": {}, "mistral": {}, "qwen2": {"qkv_bias": True},
                     "qwen3": {"qk_norm": True}}
# config.json's names for LlamaConfig's fields
HF_NAMES = {"context_len": "max_position_embeddings", "vocab_size": "vocab_size",
            "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
            "n_kv_head": "num_key_value_heads", "n_embd": "hidden_size",
            "intermediate_size": "intermediate_size", "head_dim": "head_dim",
            "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings",
            "rope_theta": "rope_theta", "rope_scaling": "rope_scaling"}


def rope_settings(hf):
    """(rope_theta, rope scaling dict or None) from config.json, in either form."""
    parameters = hf.get("rope_parameters")
    if isinstance(parameters, dict):  # transformers 5: one dict, theta inside
        scaling = {k: v for k, v in parameters.items() if k != "rope_theta"}
        return parameters.get("rope_theta", 10000.0), scaling
    return hf.get("rope_theta", 10000.0), hf.get("rope_scaling")


def context_len(hf, file):
    """max_position_embeddings, cut to the sliding window when the model uses one (null:
    none). Every layer then sees the window at most, so which layers slide (Qwen2's
    max_window_layers) changes nothing; it is checked all the same."""
    context = hf.get("max_position_embeddings")
    uses_window = hf["model_type"] == "mistral" or hf.get("use_sliding_window") is True
    if not uses_window:
        return context
    window, layers = hf.get("sliding_window"), hf.get("max_window_layers")
    if window is not None and (type(window) is not int or window < 1):
        raise CheckpointError(f"{file}: sliding_window must be a positive integer or null (no "
                              f"window), got {short_repr(window)}")
    if layers is not None and (type(layers) is not int or layers < 0):
        raise CheckpointError(f"{file}: max_window_layers must be an integer >= 0 or null, "
                              f"got {short_repr(layers)}")
    if window is not None and type(context) is int and context > window:
        return window
    return context


def llama_config(hf, file):
    """LlamaConfig from config.json (a dict whose model_type is one of LLAMA_MODEL_TYPES),
    refusing settings that change the mathematics."""
    theta, scaling = rope_settings(hf)
    unsupported = [
        (hf.get("hidden_act", "silu") != "silu",
         f"hidden_act {short_repr(hf.get('hidden_act'))}, ours is SiLU (SwiGLU)"),
        (hf.get("attention_bias", False) is not False,
         "attention_bias is set (a bias on every attention projection; ours are on q, k, v only, as Qwen2's)"),
        (hf.get("mlp_bias", False) is not False, "mlp_bias is set; ours has none"),
        (isinstance(scaling, dict) and scaling.get("partial_rotary_factor", 1.0) != 1.0,
         "partial_rotary_factor is not 1; ours rotates every channel"),
    ]
    for wrong, why in unsupported:
        if wrong:
            raise CheckpointError(f"{file.parent}: unsupported {hf['model_type']} variant: {why}")
    if isinstance(scaling, dict):
        scaling.pop("partial_rotary_factor", None)
    fields = {ours: hf[theirs] for ours, theirs in HF_NAMES.items() if theirs in hf}
    fields.update(family="llama", context_len=context_len(hf, file), rope_theta=theta, rope_scaling=scaling,
                  tie_embeddings=hf.get("tie_word_embeddings", False),
                  norm_eps=hf.get("rms_norm_eps", 1e-6), **LLAMA_MODEL_TYPES[hf["model_type"]])
    fields.setdefault("n_kv_head", fields.get("n_head"))  # no num_key_value_heads: one per query head
    return config_from_dict(fields, file, names=HF_NAMES)


def special_ids(path, hf):
    """(bos id or None, [eos ids]) from config.json and generation_config.json: each
    eos_token_id may be one id or a list (Llama 3's instruct models end at any of three)."""
    generation_file = path / "generation_config.json"
    generation = read_json(generation_file) if generation_file.is_file() else {}
    eos, bos = [], None
    for source, settings in ((path / "config.json", hf), (generation_file, generation)):
        if not isinstance(settings, dict):
            raise CheckpointError(f"{source}: holds a {type(settings).__name__}, expected a JSON object")
        value = settings.get("eos_token_id")
        ids = value if isinstance(value, list) else [value]
        if not all(i is None or (type(i) is int and i >= 0) for i in ids):
            raise CheckpointError(f"{source}: eos_token_id must be an id or a list of ids, "
                                  f"got {short_repr(value)}")
        eos += [i for i in ids if i is not None]
        if bos is None and type(settings.get("bos_token_id")) is int and settings["bos_token_id"] >= 0:
            bos = settings["bos_token_id"]
    return bos, eos


def llama_tokenizer(path, hf):
    """The directory's tokenizer (tokenizer.json, tokenizer_config.json, and the special
    ids of config.json and generation_config.json) as an hf_tokenizer.HFTokenizer."""
    config_file = path / "tokenizer_config.json"
    config = read_json(config_file) if config_file.is_file() else {}
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file}: holds a {type(config).__name__}, expected a JSON object")
    return read_tokenizer(path, special_ids(path, hf), config)
