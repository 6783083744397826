"""Tiny random Hugging Face Llama-family directories, built in the test with transformers and
tokenizers (nothing downloaded): LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and
Qwen3ForCausalLM, each with one of the two tokenizer kinds these models ship (byte-level BPE
as Llama 3 and Qwen do, SentencePiece-style BPE with byte fallback as Llama 2 does).
Used by test_llama.py and test_llama_chat.py."""

import torch

TEXT = ["ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet "
        "is the sun.", "To be, or not to be, that is the question: whether 'tis nobler in the "
        "mind to suffer the slings and arrows of outrageous fortune."] * 20
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
SHAPE = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=96,
             initializer_range=0.1)  # 0.1: logits spread out, no argmax near-ties in 100 tokens

# name: (model_type, config.json settings, tokenizer kind). Between them: MHA, GQA and MQA;
# Qwen2's qkv bias; Qwen3's q/k norm with its own head_dim; tied and untied; rope_theta
# other than 10,000; Llama 3's rope scaling and linear scaling; Mistral's sliding window.
VARIANTS = {
    "llama3-gqa-ropescaling": ("llama", dict(num_attention_heads=4, num_key_value_heads=2,
                                             rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                                             max_position_embeddings=256, tie_word_embeddings=True),
                               "byte-level"),
    "llama2-mha-untied": ("llama", dict(num_attention_heads=4, num_key_value_heads=4,
                                        max_position_embeddings=256), "sentencepiece"),
    "mistral-mqa-window": ("mistral", dict(num_attention_heads=4, num_key_value_heads=1,
                                           sliding_window=256, max_position_embeddings=4096,
                                           rope_theta=1e6), "sentencepiece"),
    "qwen2-gqa-qkvbias-tied": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2,
                                             rope_theta=1e6, tie_word_embeddings=True,
                                             max_position_embeddings=256), "byte-level"),
    "qwen3-qknorm-headdim": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                           max_position_embeddings=256,
                                           rope_scaling={"rope_type": "linear", "factor": 2.0}),
                             "byte-level"),
}


def hf_classes():
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)
    return {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
            "qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def byte_level_tokenizer(extra_specials=()):
    """Llama 3 / Qwen2 style: GPT-2's byte alphabet, BPE merges learned here, BOS and EOS
    specials (and extra_specials after them: a chat template's markers), BOS put before
    every text by the post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", *extra_specials]))
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                   eos_token="<|end_of_text|>")


def sentencepiece_tokenizer():
    """Llama 2 / TinyLlama style: '▁' for a space, a few merges, and <0xHH> tokens for every
    byte that no other token covers (byte fallback); <s> before every text."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import LlamaTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for c in "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ,.:?'":
        vocab.setdefault(c, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("i", "s"), ("▁", "w"), ("n", "d"), ("▁a", "nd")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return LlamaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def make_hf_llama_dir(path, name, seed=0, tokenizer=None):
    """A random model of VARIANTS[name] and its tokenizer (by default the variant's kind)
    saved to `path`: (HF model, HF tokenizer)."""
    model_type, settings, tokenizer_kind = VARIANTS[name]
    config_class, model_class = hf_classes()[model_type]
    if tokenizer is None:
        tokenizer = byte_level_tokenizer() if tokenizer_kind == "byte-level" else sentencepiece_tokenizer()
    torch.manual_seed(seed)
    # one row per token, no padding rows: transformers' generate() may pick any row
    config = config_class(**SHAPE, **settings, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id, attn_implementation="sdpa")
    hf = model_class(config).eval()
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return hf, tokenizer
