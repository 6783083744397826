"""
The baseline: a nanoGPT-style GPT (GPT-2 architecture, learned position embeddings)
that generates the naive way. Every new token re-runs the whole context through all
blocks, so step t costs O(t) and a full generation costs O(T^2).

kv_cache.py is this same model (same parameters, same names) with a forward() that
reuses the keys and values of past tokens instead of recomputing them.
"""

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from sample import sample


@dataclass
class GPTConfig:
    # The defaults are the bundled demo model's shape (checkpoints/README.md).
    context_len: int = 256     # longest context; learned position embeddings end here
    vocab_size: int = 4096
    n_layer: int = 6          # the seeds' "six blocks"
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0
    bias: bool = True         # biases in Linear and LayerNorm, as in GPT-2
    family: ClassVar[str] = "gpt"  # llama.LlamaConfig's is "llama": checkpoints record which

    def __post_init__(self):
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    @property
    def n_kv_head(self):
        """Heads the cache stores keys and values for: every head here; fewer in a model
        with grouped-query attention, where several query heads share one."""
        return self.n_head


def dropout_layer(p):
    """nn.Dropout(p), or nn.Identity for p = 0 (every checkpoint here, and real GPT-2 weights
    as they load): a Dropout of 0 changes nothing but still costs a decode step a call to
    torch, 2 a block. Neither has parameters: the state dict is the same."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        # q, k and v for all heads in one matmul (GPT-2's c_attn), then the output projection
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = dropout_layer(config.dropout)

    def qkv(self, x):
        """Project x (B, T, C) to per-head q, k, v stacked in one tensor (3, B, nh, T, hd).

        One view and one permute instead of a split, three views and three transposes: the
        same numbers, fewer ops per layer (which is what batch-1 decoding pays for)."""
        B, T, C = x.shape
        return self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)

    def project_out(self, y):
        """Merge heads (B, nh, T, hd) -> (B, T, C) and apply the output projection."""
        B, nh, T, hd = y.shape
        y = y.transpose(1, 2).reshape(B, T, nh * hd)
        return self.resid_dropout(self.c_proj(y))

    def forward(self, x):
        q, k, v = self.qkv(x)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.project_out(y)


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        # GPT-2 uses the tanh approximation of GELU; matching it keeps real GPT-2 weights exact
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = dropout_layer(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):

    def __init__(self, config, attention=CausalSelfAttention):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = attention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, **attn_args):
        # attn_args is empty here; kv_cache.py passes its cache and mask through to attention
        x = x + self.attn(self.ln_1(x), **attn_args)
        x = x + self.mlp(self.ln_2(x))
        return x


def init_weights(model, residual_projections):
    """GPT-2's initialisation, for GPT and llama.Llama: every Linear and Embedding weight
    drawn from N(0, 0.02), every bias zero; then the residual projections (the parameters
    whose names end in one of residual_projections) drawn again with std 0.02 / sqrt(2 x
    n_layer), so that the residual stream's variance does not grow with the number of blocks."""
    def init_module(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    model.apply(init_module)
    for name, p in model.named_parameters():
        if name.endswith(residual_projections):
            nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * model.config.n_layer))


def next_token_loss(logits, targets):
    """The training loss: cross-entropy of logits (B, T, V) against targets (B, T), the
    token that follows each position (-1: a position that counts for nothing), in float32."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1), ignore_index=-1)


class NaiveGeneration:
    """The naive loop, for any model whose forward(idx, last_only=True) gives the last
    position's logits and whose config has a context_len: GPT below, and llama.Llama."""

    @torch.inference_mode()
    def stream(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
               generator=None, vocab_limit=None, stats=None, min_p=None):
        """Yield the next token of every row, (B, 1), one step at a time.

        The naive loop: each step feeds the whole context (cropped to context_len) through
        every block, recomputing keys and values it computed last step. vocab_limit, the
        tokenizer's size, keeps padding rows of a larger embedding table from being sampled.
        stats (generation/loop.py's GenerationStats), when given, counts the forward passes
        and the positions they processed: O(T^2) here."""
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.config.context_len:]
            logits, _ = self(idx_cond, last_only=True)
            if stats is not None:
                stats.count_pass(idx_cond.size(1))
            next_token = sample(logits[:, -1, :vocab_limit], temperature, top_k, top_p, generator, min_p)
            idx = torch.cat((idx, next_token), dim=1)
            yield next_token

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
                 generator=None, vocab_limit=None, stats=None):
        """Return idx (B, T) with max_new_tokens sampled tokens appended: (B, T + max_new_tokens).
        (kv_cache's cached models' generate is the same call, through the cache.)"""
        new_tokens = list(self.stream(idx, max_new_tokens, temperature, top_k, top_p, generator,
                                      vocab_limit, stats))
        return torch.cat([idx, *new_tokens], dim=1)


class GPT(NaiveGeneration, nn.Module):
    # kv_cache.KVCacheGPT swaps in an attention that reads a cache; its parameters are these
    Attention = CausalSelfAttention

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.context_len, config.n_embd),
            drop=dropout_layer(config.dropout),
            h=nn.ModuleList([Block(config, self.Attention) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as in GPT-2
        init_weights(self, residual_projections=("c_proj.weight",))

    def num_params(self):
        # the tied lm_head shares wte's tensor, so parameters() counts it once
        return sum(p.numel() for p in self.parameters())

    def check_context(self, positions):
        if positions > self.config.context_len:
            raise ValueError(
                f"sequence of {positions} positions exceeds context_len {self.config.context_len}: "
                "learned position embeddings end there; crop the context")

    def embed(self, idx, start_pos=0):
        """Token plus position embeddings for idx (B, T) placed at start_pos, start_pos+1, ..."""
        T = idx.size(1)
        self.check_context(start_pos + T)
        # rows start_pos.. of the position table: the same as wpe(arange(...)), without
        # building an index tensor every step
        pos_emb = self.transformer.wpe.weight[start_pos:start_pos + T]  # (T, C)
        return self.transformer.drop(self.transformer.wte(idx) + pos_emb)

    def head(self, x):
        """Final LayerNorm and the tied output projection: (B, T, C) -> logits (B, T, V)."""
        return self.lm_head(self.transformer.ln_f(x))

    def forward(self, idx, targets=None, last_only=False):
        """Logits (B, T, V) for every position, so parity checks can compare them all, or
        with last_only=True for the last one (B, 1, V), which is all generation needs."""
        x = self.embed(idx)
        for block in self.transformer.h:
            x = block(x)
        logits = self.head(x[:, -1:] if last_only else x)
        return logits, (None if targets is None else next_token_loss(logits, targets))


# ---------------------------------------------------------------------------- before decoding

@torch.no_grad()
def store_linears_column_major(model):
    """A decode-speed step, applied to a model before it generates (plumbing/cli.py's
    load_from_args does it for every command, and benchmark.py to its models, the naive one
    included, so that a comparison of the two loops measures the cache and nothing else).

    Every Linear weight (out, in) is kept in column-major memory: same shape, values and
    state dict, but the transpose that F.linear multiplies by is then row-major. A batch-1
    decode step is a matrix-vector product per weight, and CPU BLAS streams that layout
    nearly twice as fast for large matrices (benchmark.py measures the floor in both
    layouts). load_state_dict and .to() keep the layout: they copy into these tensors.
    float32 weights only: torch's bfloat16 and float16 products on a CPU run 15-40x slower
    column-major than row-major (one 8192 x 2048 bf16 weight times 1 and 8 rows, this
    project's 2-core EPYC), and a weight left as it is stays the file's memory-mapped pages
    (plumbing/checkpoint.py) instead of becoming a copy. Plain nn.Linears only: a subclass
    multiplies its own way (generation/cpu_layout.py's PackedLinear re-lays its weight for
    oneDNN, 3x faster from row-major). Not a weight tied to the embedding either: the lookup
    reads it by rows, and copying it would hold it twice for a moment (Llama-3.2-1B's table
    is 1.05 GB in float32), while its product runs as fast either way on the Xeon
    (128256 x 2048 times one row: 35.4 ms row-major, 36.2 column-major, 2 threads). Returns
    the model."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for module in model.modules():
        if (type(module) is nn.Linear and module.weight.dtype == torch.float32
                and id(module.weight) not in embeddings):
            module.weight.data = module.weight.data.t().contiguous().t()
    return model
