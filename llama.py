"""
The second model family: Llama's architecture (Llama 2 and 3, Mistral, Qwen2, Qwen3,
SmolLM, TinyLlama), generating the naive way exactly as base_model.GPT does.

What differs from GPT-2 (base_model.py), one idea each:
  RMSNorm                  normalise by the root mean square alone: no mean taken off, no bias
  rotary positions (RoPE)  no position table: each query and key is *rotated*, channel pair
                           i by the angle position x inv_freq[i], so that q . k depends only
                           on how far apart the two tokens are
  grouped-query attention  n_kv_head key/value heads shared by n_head query heads (MHA:
                           as many, GQA: fewer, MQA: one), so a cache stores fewer heads
  SwiGLU                   a gated MLP: down(silu(gate(x)) * up(x))
and the variants the config turns on: Llama 3's rope scaling, biases on q, k and v (Qwen2),
an RMSNorm on each head's q and k (Qwen3), an output layer tied to the embedding or not.

Parameter names are Hugging Face's LlamaForCausalLM's (model.layers.0.self_attn.q_proj...),
as base_model uses GPT-2's own: loading a checkpoint and exporting one are plain renames.
kv_cache.KVCacheLlama is this model with the one change to forward() (kv_cache.CachedModel.forward).
"""

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from base_model import NaiveGeneration, init_weights, next_token_loss

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class LlamaConfig:
    # The defaults are the bundled Llama-style model's shape (checkpoints/README.md).
    context_len: int = 256         # longest context: the loop reprefills (or evicts) there
    vocab_size: int = 4096
    n_layer: int = 6
    n_head: int = 4                # query heads
    n_kv_head: int = 1             # key/value heads: n_head (MHA), fewer (GQA), 1 (MQA)
    n_embd: int = 256
    intermediate_size: int = 704   # SwiGLU's hidden width (three matrices, not GPT-2's two)
    head_dim: int = None           # None: n_embd // n_head (Qwen3 sets its own)
    rope_theta: float = 10000.0    # the base of the rotary frequencies
    rope_scaling: dict = None      # None, or Hugging Face's dict: {"rope_type": "linear",
                                   # "factor"} or Llama 3's {"rope_type": "llama3", "factor",
                                   # "low_freq_factor", "high_freq_factor",
                                   # "original_max_position_embeddings"}
    qkv_bias: bool = False         # Qwen2: biases on q, k and v (never on the output)
    qk_norm: bool = False          # Qwen3: RMSNorm on each head's q and k, before rotation
    tie_embeddings: bool = False   # the output layer is the embedding (SmolLM, Llama 3.2 1B)
    norm_eps: float = 1e-5         # RMSNorm's epsilon (Llama 2: 1e-5, Qwen: 1e-6)
    family: ClassVar[str] = "llama"

    def __post_init__(self):
        if self.head_dim is None:
            if self.n_embd % self.n_head:
                raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
            self.head_dim = self.n_embd // self.n_head
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even: RoPE turns channels in pairs")


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 (a bfloat16 mean of squares loses digits)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


# ---------------------------------------------------------------------------- rotary positions

def rope_frequencies(config):
    """inv_freq (head_dim / 2,) float32: how fast each channel pair turns per position,
    theta^(-2i / head_dim), from 1 radian per position down to ~1/theta. Llama 3's scaling
    slows the slowest pairs (long wavelengths) by `factor`, leaves the fastest alone and
    blends in between, so a model trained on 8k positions reads 128k."""
    d = config.head_dim
    # on the CPU whatever the default device: a model built on the meta device (to be filled
    # from a file) gets real frequencies too; forward() moves them to the positions' device
    channel_pairs = torch.arange(0, d, 2, dtype=torch.int64, device="cpu")
    inv_freq = 1.0 / (config.rope_theta ** (channel_pairs.float() / d))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, old_context = scaling["factor"], scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelength = 2 * math.pi / inv_freq
        slowed = torch.where(wavelength > old_context / low, inv_freq / factor, inv_freq)
        blend = (old_context / wavelength - low) / (high - low)  # 0 at the slow end, 1 at the fast
        blended = (1 - blend) * slowed / factor + blend * slowed
        between = (wavelength >= old_context / high) & (wavelength <= old_context / low)
        return torch.where(between, blended, slowed)
    return inv_freq


def rotate(x, cos, sin):
    """x (B, h, T, hd) with each channel pair (i, i + hd/2) turned by its angle (cos and sin
    (B or 1, 1, T, hd/2)): Hugging Face's layout of the pairs, which its weights assume."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# ---------------------------------------------------------------------------- the blocks

class LlamaAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        C, q_width, kv_width = config.n_embd, config.n_head * config.head_dim, config.n_kv_head * config.head_dim
        self.q_proj = nn.Linear(C, q_width, bias=config.qkv_bias)
        self.k_proj = nn.Linear(C, kv_width, bias=config.qkv_bias)
        self.v_proj = nn.Linear(C, kv_width, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_width, C, bias=False)
        # Qwen3 normalises each head's query and key (before rotation); the others do not
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else nn.Identity()

    def qkv(self, x, rope):
        """x (B, T, C) -> q (B, nh, T, hd) and k (B, n_kv_head, T, hd), rotated to their
        positions (rope: cos and sin of the angles), and v (B, n_kv_head, T, hd)."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_head, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        cos, sin = rope
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def project_out(self, y):
        """Merge heads (B, nh, T, hd) -> (B, T, nh * hd) and apply the output projection."""
        B, nh, T, hd = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, nh * hd))

    def forward(self, x, rope):
        q, k, v = self.qkv(x, rope)
        # enable_gqa: query head h reads key/value head h // (n_head / n_kv_head), without
        # copying the shared heads out to n_head (what Hugging Face's repeat_kv does)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.n_kv_head != self.n_head)
        return self.project_out(y)


class SwiGLU(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):

    def __init__(self, config, attention=LlamaAttention):
        super().__init__()
        self.input_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.self_attn = attention(config)
        self.post_attention_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x, rope, **attn_args):
        # attn_args is empty here; kv_cache.py passes its cache and mask through to attention
        x = x + self.self_attn(self.input_layernorm(x), rope, **attn_args)
        return x + self.mlp(self.post_attention_layernorm(x))


# ---------------------------------------------------------------------------- the model

class Llama(NaiveGeneration, nn.Module):
    # kv_cache.KVCacheLlama swaps in an attention that reads a cache; its parameters are these
    Attention = LlamaAttention

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(config.vocab_size, config.n_embd),
            layers=nn.ModuleList([LlamaBlock(config, self.Attention) for _ in range(config.n_layer)]),
            norm=RMSNorm(config.n_embd, config.norm_eps),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.model.embed_tokens.weight = self.lm_head.weight
        init_weights(self, residual_projections=("o_proj.weight", "down_proj.weight"))
        # A plain tensor, not a buffer: model.to(torch.bfloat16) would round the frequencies
        # too, and position 1000's angle would then be off by radians.
        self.inv_freq = rope_frequencies(config)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())  # a tied lm_head counts once

    def check_context(self, positions):
        if positions > self.config.context_len:
            raise ValueError(
                f"sequence of {positions} positions exceeds context_len {self.config.context_len}: "
                "the model never saw rotary angles past it; crop the context")

    def rotary(self, positions):
        """(cos, sin) of every position's angles, (B or 1, 1, T, hd/2) in the model's dtype,
        for positions (T,) or (B, T). Computed in float32 from the positions themselves,
        as Hugging Face does, so no table limits how far they go."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        angles = positions[..., None].float() * self.inv_freq          # (..., T, hd/2)
        dtype = self.lm_head.weight.dtype
        return angles.cos().to(dtype).unsqueeze(-3), angles.sin().to(dtype).unsqueeze(-3)

    def head(self, x):
        """Final RMSNorm and the output projection: (B, T, C) -> logits (B, T, V)."""
        return self.lm_head(self.model.norm(x))

    def forward(self, idx, targets=None, last_only=False):
        """Logits (B, T, V) for every position, or with last_only=True for the last (B, 1, V)."""
        T = idx.size(1)
        self.check_context(T)
        rope = self.rotary(torch.arange(T, device=idx.device))
        x = self.model.embed_tokens(idx)
        for block in self.model.layers:
            x = block(x, rope)
        logits = self.head(x[:, -1:] if last_only else x)
        return logits, (None if targets is None else next_token_loss(logits, targets))
