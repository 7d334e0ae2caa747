"""The model a node trains: a Llama causal LM, written here with plain torch.

It computes what transformers' `LlamaForCausalLM` computes, op for op, with the same parameter
names, order and initialisation, so `diloco-p2p export` writes a state dict transformers loads
with the node's logits, and a seed gives the θ₀ the transformers model would. It is written
here, not imported, because importing transformers' modeling stack cost every node start about
2 s of CPU. A `model.pretrained_path` model (any architecture) still loads through transformers
(`diloco_p2p.model.build.build_model`). The shape is torchtitan's and nanoGPT's: one module per
block, the forward in a few lines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaShape:
    """The fields of transformers' `LlamaConfig` this model reads (its defaults where it has one)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    pad_token_id: int | None = 0
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class Output(NamedTuple):
    """What the trainer reads of a forward pass (transformers' `CausalLMOutputWithPast.logits`)."""

    logits: torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """cos and sin of the rotary position embedding (RoFormer; the default, unscaled rope)."""

    def __init__(self, shape: LlamaShape):
        super().__init__()
        dim = shape.head_dim
        inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.head_dim, self.heads, self.kv_heads = shape.head_dim, shape.num_attention_heads, shape.num_key_value_heads
        self.q_proj = nn.Linear(shape.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(shape.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(shape.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        gqa = {"enable_gqa": True} if self.kv_heads != self.heads else {}
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, scale=self.head_dim**-0.5, is_causal=t > 1, **gqa)
        return self.o_proj(out.transpose(1, 2).contiguous().reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.self_attn = Attention(shape)
        self.mlp = MLP(shape)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Trunk(nn.Module):
    """transformers' `LlamaModel`: embeddings, blocks, final norm (the `model.` of every name)."""

    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size, shape.pad_token_id)
        self.layers = nn.ModuleList(Block(shape) for _ in range(shape.num_hidden_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.rotary_emb = Rotary(shape)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=x.device).unsqueeze(0)
        cos, sin = self.rotary_emb(x, positions)
        for block in self.layers:
            x = block(x, cos, sin)
        return self.norm(x)


class Llama(nn.Module):
    """A causal LM: ``Llama(shape)(input_ids=ids).logits``, next-token logits at every position."""

    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.shape = shape
        # transformers' order of construction and initialisation, so that a seed gives its θ₀: the
        # trunk is built (torch's default inits draw from the generator) and initialised, then the head.
        self.model = init_weights(Trunk(shape), shape.initializer_range)
        self.lm_head = init_weights(nn.Linear(shape.hidden_size, shape.vocab_size, bias=False), shape.initializer_range)
        if shape.tie_word_embeddings:  # one matrix: the head is the embedding (a parameter once, under its name)
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_output_embeddings(self) -> nn.Linear:
        """The head (transformers' name: `inner.muon_split` keeps it, as the embeddings, out of Muon)."""
        return self.lm_head

    def forward(self, input_ids: torch.Tensor) -> Output:
        return Output(self.lm_head(self.model(input_ids)))


@torch.no_grad()
def init_weights(module: nn.Module, std: float) -> nn.Module:
    """transformers' initialisation, in module order: every matrix N(0, std²), the padding token's
    embedding zero, norms one."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            m.weight.normal_(0.0, std)
            if isinstance(m, nn.Embedding) and m.padding_idx is not None:
                m.weight[m.padding_idx].zero_()
        elif isinstance(m, RMSNorm):
            m.weight.fill_(1.0)
    return module
