"""
Tokenizer: a byte-level BPE trained on the training plays, stored as tiktoken ranks.

The merges are learned with `rustbpe` (nanochat's BPE trainer, build-time only); the
result is a plain spec dict that plumbing/tokenizer.py's encoding_from_spec turns into a
tiktoken.Encoding, so running the suite needs only tiktoken.

Why 4096 tokens: the token embedding is vocab_size x n_embd parameters, shared with the
output layer. GPT-2's 50257 tokens would make it most of a small model (50257 x 256 = 12.9M
weights) and most of those tokens never occur in Shakespeare. 4095 merges learned on this
very corpus still cover whole common words, so a token is still about 2.9 characters of
unseen Shakespeare (README has the measured figure).
"""

import tiktoken

# GPT-2's pre-tokenisation: words, numbers, punctuation runs and whitespace are split
# first, merges never cross these boundaries. This is GPT-2's original pattern with the
# contractions grouped; tiktoken's gpt2 pat_str is an equivalent, faster-written form.
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
VOCAB_SIZE = 4096  # including the one special token
EOT = "<|endoftext|>"


def train_tokenizer(plays):
    """Learn 4095 byte-level tokens (256 bytes + 3839 merges) and return the spec dict."""
    import rustbpe
    bpe = rustbpe.Tokenizer()
    bpe.train_from_iterator(iter(plays), VOCAB_SIZE - 1, pattern=GPT2_PAT)
    ranks = sorted(bpe.get_mergeable_ranks(), key=lambda kv: kv[1])  # [(bytes, rank), ...]
    assert [r for _, r in ranks] == list(range(VOCAB_SIZE - 1))
    mergeable = [bytes(tok) for tok, _ in ranks]  # list index = rank
    assert set(mergeable[:256]) == {bytes([b]) for b in range(256)}  # every byte encodable
    return {"name": "shakespeare-bpe-4k", "pat_str": GPT2_PAT,
            "mergeable_ranks": mergeable, "special_tokens": {EOT: VOCAB_SIZE - 1}}


def encoding(spec):
    """The tiktoken.Encoding for a spec (the same construction checkpoint.py uses)."""
    return tiktoken.Encoding(name=spec["name"], pat_str=spec["pat_str"],
                             mergeable_ranks={t: r for r, t in enumerate(spec["mergeable_ranks"])},
                             special_tokens=spec["special_tokens"])


def check_roundtrip(enc):
    """Any Unicode string must survive encode -> decode: ASCII, accents, emoji, CJK."""
    for s in ["ROMEO:\nBut soft, what light through yonder window breaks?",
              "Café, naïve, Ælfred, Øresund", "emoji 🎭👑🗡️ and 🇬🇧", "汉字かな한국어",
              "tabs\tand  spaces\r\n", "\x00\x7f\u200b", EOT + " as plain text"]:
        assert enc.decode(enc.encode(s, disallowed_special=())) == s, s


if __name__ == "__main__":
    import sys, time
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from corpus import build_corpus
    train, heldout = build_corpus()
    heldout = "\n".join(heldout)
    t0 = time.time()
    spec = train_tokenizer(train)
    enc = encoding(spec)
    check_roundtrip(enc)
    n = len(enc.encode_ordinary(heldout))
    print(f"trained in {time.time() - t0:.1f}s; n_vocab {enc.n_vocab}; held-out "
          f"{len(heldout):,} chars -> {n:,} tokens ({len(heldout) / n:.2f} chars/token)")
    print([enc.decode([i]) for i in range(3800, 3840)])
