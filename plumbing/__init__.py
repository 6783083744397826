"""
The plumbing around the lesson: what the commands need and the lesson's modules
(base_model, kv_cache, sample) never import. (The engine's modules use the few files here
that import nothing of the command line: text_stream, user_text, kernel_build, ticker.)

    script.py       begin() before the slow imports, run(main) around main(), UserError
                    (CheckpointError for a file): a user's mistake is one line on stderr, status 2
    cli.py          the model flags every command shares, and loading what they name
    checkpoint.py   loading our checkpoints and nanoGPT's: the weights checked, the model built
    files.py        reading a file safely: a regular file, sizes that fit, data only (weights_only=True)
    memory.py       memory arithmetic: what is available, what a model or a batch takes, bytes as text
    model_config.py a model config from data (ours, nanoGPT's, inferred, HF's), every field checked
    tokenizer.py    tiktoken tokenizers (a checkpoint's, tiktoken's named ones), checked as built
    hf.py           reading a Hugging Face directory (and the helpers export_hf.py shares)
    hf_bpe.py       a GPT-2 directory's vocab.json + merges.txt (or tokenizer.json) as tiktoken
    hf_llama.py     a Llama, Mistral, Qwen2 or Qwen3 config.json, and its special tokens
    hf_tokenizer.py tokenizer.json as the part of a tiktoken Encoding our code uses
    outputs.py      files we write: checked before the work, written atomically, ours only
    user_text.py    user text to token ids, never a panic; a prompt begun as the model expects
    text_input.py   a command's text input: a file or stdin, a JSON Lines file of prompts
    scoring.py      generate.py --score: held-out bits per character, through the cache too
    stats_report.py what generate.py --stats and --json report
    text_stream.py  tokens to text, one at a time; stop strings and end-of-sequence ids
    processor_args.py generate.py's logits-processor and structured-output flags
    kernel_build.py building a C++ operator of ours on first use, one build at a time, safely
    progress.py     one line on a terminal saying how far loading a multi-GB model has got
    ticker.py       a seconds count on a terminal around one long call (a compiled step's build)
"""
