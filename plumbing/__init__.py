"""
The plumbing around the lesson: what the commands need and the lesson's modules
(base_model, kv_cache, sample) never import.

    script.py       begin() before the slow imports, run(main) around main(), UserError:
                    a user's mistake is one line on stderr and exit status 2
    cli.py          the model flags every command shares, and loading what they name
    checkpoint.py   reading our checkpoints and nanoGPT's, data only (weights_only=True)
    hf.py           reading a Hugging Face directory (and the helpers export_hf.py shares)
    hf_llama.py     a Llama, Mistral, Qwen2 or Qwen3 config.json, and its special tokens
    hf_tokenizer.py tokenizer.json as the part of a tiktoken Encoding our code uses
    validation.py   what every file, config, tokenizer and size must satisfy first
    outputs.py      files we write: checked before the work, written atomically, ours only
    user_text.py    user text to token ids, never a panic; a prompt begun as the model expects
    text_stream.py  tokens to text, one at a time; stop strings and end-of-sequence ids
"""
