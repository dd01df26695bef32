"""A Qwen3-style decoder whose residual stream is pluggable (see ``mhar_ablate/variants/``).

RMSNorm, rotary embeddings, grouped-query attention with per-head QK-norm through
``scaled_dot_product_attention``, a SwiGLU MLP and tied input/output embeddings (or a separate output
matrix, ``model.tie_embeddings=false``). Sublayers are pre-norm;
what they read and how their outputs are kept is the residual variant's business.

Cached decoding (``KVCache``, ``Decoder.generate``): the forward takes a cache, continues from the
positions it holds and appends the new keys and values. Only attention looks across positions; every
residual kind mixes, at one position, the sources of that position (the embedding and earlier sublayers'
outputs), so a step runs the ordinary residual loop over the new tokens alone and keeps no sources
across steps: one history per step, each source written once, whatever the kind. MUDDFormer's keys
and values come from their own per-position mixes of the block outputs; the cache holds the projected
keys and values, so it serves that kind like any other.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig, ResidualConfig
from ..variants.base import Residual
from ..variants import build_residual
from ..norm import RMSNorm


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # the half-split layout Qwen3 uses
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class TiedEmbedding(torch.autograd.Function):
    """The token embeddings ``weight[idx]`` and the output head's view of ``weight``, from one autograd node.

    A tied weight used twice gets two gradients, which autograd adds: the lookup's, a zeroed vocab x d buffer
    with its rows scattered in, and the head's. Compiled into one graph, the compiler fuses that sum (and
    the model keeps to it); eager, or where the routing breaks the graph (the fused path), it is two
    vocabulary-sized passes. Here both gradients reach one node, whose backward adds the looked-up rows into
    the head's gradient in place: 0.23 ms of kernels less in a replayed ``block:4`` step at ``paper100m``
    (docs/benchmarks.md, sixteenth round).
    """

    @staticmethod
    def forward(ctx, idx: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(idx)
        ctx.weight_shape = weight.shape
        return F.embedding(idx, weight), weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad_rows: Tensor | None, grad_weight: Tensor | None) -> tuple[None, Tensor | None]:
        (idx,) = ctx.saved_tensors
        if grad_rows is None:
            return None, grad_weight
        if grad_weight is None:  # the head was not used (hidden states only)
            grad_weight = grad_rows.new_zeros(ctx.weight_shape)
        elif not grad_weight.is_contiguous():
            grad_weight = grad_weight.clone(memory_format=torch.contiguous_format)
        # Added to in place: the second output is the output head's weight alone (``embed_tokens``), so its
        # gradient is the product the head's backward made for it, which nothing else holds.
        # index_put_ with accumulate sorts the indices on a GPU, so repeated tokens add up in a fixed order
        # (deterministic, as the dense embedding backward it replaces).
        grad_weight.index_put_((idx.reshape(-1),), grad_rows.reshape(-1, grad_rows.shape[-1]).to(grad_weight.dtype),
                               accumulate=True)
        return None, grad_weight


@torch.compiler.disable
def tied_embedding(idx: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    # Outside the compiler: traced into a graph, the node's second output would be an alias of a graph
    # input, which the compiled function hands back as a view of the weight, not through this node.
    return TiedEmbedding.apply(idx, weight)


class KVCache:
    """Every attention layer's keys and values (after QK-norm and rotary embedding, ``n_kv_heads`` heads)
    for the first ``length`` positions: two preallocated (layers, B, n_kv, max_len, head_dim) tensors."""

    def __init__(self, n_layers: int, batch: int, n_kv: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None = None):
        shape = (n_layers, batch, n_kv, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0
        self.position: Tensor | None = None  # static mode (below): the next position, on the device
        self.visible: Tensor | None = None  # static mode: the current step's mask (1, 1, 1, max_len)

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new positions' keys and values (B, n_kv, T, hd) of ``layer``; return the layer's
        keys and values of every position so far. ``length`` moves on once per forward (the decoder's)."""
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    # ------------------------------------------------------------ fixed shapes, for a CUDA graph
    # A captured decode step must not depend on Python state that changes from step to step. After
    # ``make_static`` the next position lives on the device (``position``), each step writes its keys and
    # values there with index_copy_ and attends to all max_len positions through a mask of the filled
    # ones, and the decoder moves ``position`` on in place. ``length`` then stays where it was: the caller
    # keeps the steps within max_len (a bound a device-side position cannot check without a sync).

    def make_static(self) -> None:
        self.position = torch.tensor([self.length], dtype=torch.long, device=self.k.device)

    def write_at_position(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k[layer].index_copy_(2, self.position, k)
        self.v[layer].index_copy_(2, self.position, v)
        return self.k[layer], self.v[layer]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.head_dim or cfg.d_model // cfg.n_heads
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.q_proj = nn.Linear(cfg.d_model, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)

    def forward(self, x: Tensor | tuple[Tensor, Tensor, Tensor], cos: Tensor, sin: Tensor,
                cache: KVCache | None = None, layer: int = 0, normed: Tensor | None = None) -> Tensor:
        """``normed``: ``self.norm(x)``, where the residual computed it (``Residual.read_with_norm``)."""
        if normed is not None:
            hq = hk = hv = normed
        elif isinstance(x, tuple):
            # A multiway residual (MUDDFormer) feeds queries, keys and values from separate streams: each
            # is normalised on its own (its own RMS), through the one gain, which the projection after it
            # would absorb anyway.
            hq, hk, hv = (self.norm(t) for t in x)
        else:
            hq = hk = hv = self.norm(x)
        B, T, _ = hq.shape
        q = self.q_norm(self.q_proj(hq).view(B, T, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(hk).view(B, T, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(hv).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        past, mask = 0, None
        if cache is not None and cache.position is not None:  # one token at a device-side position
            past, mask = 1, cache.visible
            k, v = cache.write_at_position(layer, k, v)
        elif cache is not None:
            past = cache.length
            k, v = cache.append(layer, k, v)
        rep = self.n_heads // self.n_kv
        if past and T == 1:
            # One new token sees every cached position (static: every filled one): each key-value head's
            # query heads as rows of one query block, which spares the repeat of the whole cache each step.
            y = F.scaled_dot_product_attention(q.reshape(B, self.n_kv, rep, self.head_dim), k, v, attn_mask=mask)
            y = y.view(B, self.n_heads, 1, self.head_dim)
        else:
            if rep > 1:
                # Explicit repeat rather than enable_gqa: it works on every SDPA backend, CPU included.
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            if past:  # new tokens after cached ones: token i sees positions up to past + i
                mask = torch.ones(T, past + T, dtype=torch.bool, device=q.device).tril(past)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            else:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.gate = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.d_model, bias=False)

    def forward(self, x: Tensor, normed: Tensor | None = None) -> Tensor:
        """``normed``: ``self.norm(x)``, where the residual computed it (``Residual.read_with_norm``)."""
        h = self.norm(x) if normed is None else normed
        return self.down(F.silu(self.gate(h)) * self.up(h))


class Decoder(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab)."""

    def __init__(self, cfg: ModelConfig, residual: ResidualConfig, vocab_size: int | None = None):
        super().__init__()
        self.cfg = cfg
        vocab = vocab_size or cfg.vocab_size
        if not vocab:
            raise ValueError("the vocabulary size is unknown: set model.vocab_size or pass the tokenizer's")
        self.vocab_size = vocab
        self.embed = nn.Embedding(vocab, cfg.d_model)
        self.sublayers = nn.ModuleList()
        for _ in range(cfg.n_layers):
            self.sublayers.append(Attention(cfg))
            self.sublayers.append(MLP(cfg))
        self.residual: Residual = build_residual(residual, cfg)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # None when tied: the output projection is embed.weight (one parameter, as in the presets).
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, vocab, bias=False)
        head_dim = cfg.head_dim or cfg.d_model // cfg.n_heads
        cos, sin = rope_tables(cfg.seq_len, head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # GPT-2/nanoGPT style: N(0, 0.02), output projections scaled down with depth.
        for name, p in self.named_parameters():
            if p.dim() == 2 and not name.startswith("residual."):
                std = 0.02 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("o_proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: Tensor, cache: KVCache | None = None, last_only: bool = False) -> Tensor:
        """Logits of the tokens ``idx`` (B, T): of every position, or with ``last_only`` of the last one
        (B, 1, vocab). With a ``cache`` the tokens follow the positions it holds (a prompt into an empty
        cache, then one token a step), and their keys and values are added to it."""
        x, weight = self.embed_tokens(idx)
        h = self.hidden(x, cache)
        return self.head(h[:, -1:] if last_only else h, weight)

    def embed_tokens(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        """The token embeddings of ``idx`` and the weight the output head is to use, and only the head:
        tied and taking gradients, both come from one autograd node (``TiedEmbedding``), which adds the
        lookup's rows into that weight's gradient in place rather than summing two vocabulary-sized ones.
        Not where the model compiles into one graph (the baseline, the comparison family): the compiler
        fuses that sum itself, and the node, opaque to it, would break the graph."""
        weight = self.embed.weight
        one_graph = torch.compiler.is_compiling() and not self.residual.breaks_graph(weight.device)
        if self.lm_head is None and torch.is_grad_enabled() and weight.requires_grad and not one_graph:
            return tied_embedding(idx, weight)
        return self.embed(idx), weight if self.lm_head is None else self.lm_head.weight

    def head(self, h: Tensor, weight: Tensor | None = None) -> Tensor:
        """Logits from the last hidden states: final norm, then the output projection (``weight``, from
        ``embed_tokens``; the tied embedding or the separate matrix by default)."""
        if weight is None:
            weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(self.norm(h), weight)

    def hidden(self, x: Tensor, cache: KVCache | None = None) -> Tensor:
        """The hidden states after the last sublayer, before the final norm, from the token embeddings
        ``x`` (B, T, d) (``forward`` less ``embed_tokens`` and ``head``)."""
        static = cache is not None and cache.position is not None
        past = 0 if cache is None else cache.length
        end = past + x.shape[1]
        if end > self.rope_cos.shape[0]:
            raise ValueError(f"sequence of {end} tokens is longer than model.seq_len={self.rope_cos.shape[0]}")
        if cache is not None and end > cache.max_len:
            raise ValueError(f"sequence of {end} tokens is longer than the cache's {cache.max_len} positions")
        if static:
            if x.shape[1] != 1:
                raise ValueError("a static cache (make_static) takes one token a step")
            cos, sin = self.rope_cos.index_select(0, cache.position), self.rope_sin.index_select(0, cache.position)
            cache.visible = (torch.arange(cache.max_len, device=x.device) <= cache.position).view(1, 1, 1, -1)
        else:
            cos, sin = self.rope_cos[past:end], self.rope_sin[past:end]
        state = self.residual.start(x)
        for site, layer in enumerate(self.sublayers):
            # A residual kind may compute the sublayer's pre-norm in its own kernels (normed; else None).
            x, normed = self.residual.read_with_norm(state, site, layer.norm)
            if isinstance(layer, Attention):
                out = layer(x, cos, sin, cache, site // 2, normed=normed)
            else:
                out = layer(x, normed=normed)
            self.residual.write(state, site, out)
        h = self.residual.finish(state)
        if static:
            cache.position += 1
        elif cache is not None:
            cache.length = end
        return h

    def new_cache(self, batch: int, max_len: int | None = None, dtype: torch.dtype | None = None) -> KVCache:
        """An empty cache for ``batch`` sequences of up to ``max_len`` tokens (default: model.seq_len),
        in the dtype of the model's weights unless ``dtype`` is given."""
        cfg, w = self.cfg, self.embed.weight
        head_dim = cfg.head_dim or cfg.d_model // cfg.n_heads
        return KVCache(cfg.n_layers, batch, cfg.n_kv_heads, max_len or self.rope_cos.shape[0], head_dim,
                       dtype or w.dtype, w.device)

    @torch.no_grad()
    def generate(self, idx: Tensor, new_tokens: int, use_cache: bool = True) -> Tensor:
        """Greedy continuation: ``idx`` (B, T) followed by ``new_tokens`` argmax tokens, (B, T + new_tokens).
        With ``use_cache`` the prompt is run once into a KV cache and each new token alone after it;
        without, the whole sequence is run again for every token (the same tokens, for checking)."""
        record = getattr(self.residual, "record", None)
        if hasattr(self.residual, "record"):
            self.residual.record = False  # depth weights are a training diagnostic: not per decoded token
        try:
            if not use_cache:
                for _ in range(new_tokens):
                    nxt = self(idx, last_only=True)[:, -1].argmax(-1, keepdim=True)
                    idx = torch.cat([idx, nxt], dim=1)
                return idx
            cache = self.new_cache(idx.shape[0], idx.shape[1] + new_tokens)
            out = [idx]
            logits = self(idx, cache, last_only=True)
            for i in range(new_tokens):
                out.append(logits[:, -1].argmax(-1, keepdim=True))
                if i < new_tokens - 1:
                    logits = self(out[-1], cache)
            return torch.cat(out, dim=1)
        finally:
            if hasattr(self.residual, "record"):
                self.residual.record = record

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups: matrices decay; norms' gains and the residual variant's routing and static
        parameters (``no_decay_parameters``) do not."""
        routing = {id(p) for p in self.residual.no_decay_parameters()}
        decay, no_decay, route = [], [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            if id(p) in routing:
                route.append(p)
            elif p.dim() >= 2:
                decay.append(p)
            else:
                no_decay.append(p)
        groups = [
            {"name": "decay", "params": decay, "weight_decay": weight_decay},
            {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
        ]
        if route:
            groups.append({"name": "routing (no decay)", "params": route, "weight_decay": 0.0})
        return groups


def count_parameters(cfg: ModelConfig, residual: ResidualConfig, vocab_size: int | None = None) -> int:
    """Parameter count computed on the meta device: free even for the paper's 1B shape."""
    with torch.device("meta"):
        model = Decoder(cfg, residual, vocab_size)
    return sum(p.numel() for p in model.parameters())


def routing_overhead(cfg: ModelConfig, residual: ResidualConfig, vocab_size: int | None = None) -> tuple[int, int, float]:
    """(parameters, baseline parameters, overhead in percent) for the same shape."""
    base = ResidualConfig(kind="baseline")
    n = count_parameters(cfg, residual, vocab_size)
    nb = count_parameters(cfg, base, vocab_size)
    return n, nb, 100.0 * (n - nb) / nb
