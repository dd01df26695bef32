"""Theoretical training FLOPs per token: the count the ``flops`` budget, ``perf/mfu`` and the export use.

    FLOPs per token = 6 · N_matmul  +  12 · L · H · hd · T  +  the residual variant's own term

- ``6 · N_matmul``: every weight matrix a token passes through (the attention projections q, k, v, o,
  the MLP's gate, up and down, and the output projection d x V, tied to the embedding or not) costs 2
  FLOPs per weight forward and 4 backward (nanoGPT, PaLM, Chinchilla). The embedding lookup is no
  multiply and is not counted.
- ``12 · L · H · hd · T``: attention's scores and weighted sum over the T positions of the window, per
  layer 4 · H · hd · T forward and twice that backward, the PaLM appendix's convention (over all T
  keys: the causal mask's saving is not subtracted).
- the residual variant's term: ``routing_flops`` beside each class in ``variants/`` (MHAR: scoring
  and mixing S sources per site, 12 · d · S; HC, mHC, DenseFormer, MUDDFormer: their mixes and weight
  projections), counted the same way.

Norms, softmaxes, activations, rotary embeddings, the loss and residual additions are left out of every
term alike. The count depends on the shape, the variant and the vocabulary, never on the machine, so a
FLOPs budget is as deterministic as a step budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FlopsPerToken:
    """Training FLOPs per token, by term."""

    matmul: float  # 6 · N_matmul
    attention: float  # 12 · L · H · hd · T
    routing: float  # the residual variant's own term

    @property
    def total(self) -> float:
        return self.matmul + self.attention + self.routing


def matmul_parameters(model: Any, vocab_size: int) -> int:
    """Weights of the decoder's matrix multiplies per token (``model``: ModelConfig): per layer the
    attention projections and the SwiGLU MLP, and the output projection (d x vocabulary)."""
    d, hd = model.d_model, model.head_dim or model.d_model // model.n_heads
    attention = d * model.n_heads * hd + 2 * d * model.n_kv_heads * hd + model.n_heads * hd * d
    mlp = 3 * d * model.ffn
    return model.n_layers * (attention + mlp) + d * vocab_size


def attention_flops(model: Any) -> float:
    """Attention's scores and weighted sum, per token for training: 12 · L · H · hd · T."""
    hd = model.head_dim or model.d_model // model.n_heads
    return 12.0 * model.n_layers * model.n_heads * hd * model.seq_len


def flops_per_token(model: Any, residual: Any, vocab_size: int) -> FlopsPerToken:
    """The count of this module's docstring for ``model`` (ModelConfig) with the residual variant of
    ``residual`` (ResidualConfig) and a vocabulary of ``vocab_size``."""
    from ..config import kind_class

    return FlopsPerToken(matmul=6.0 * matmul_parameters(model, vocab_size), attention=attention_flops(model),
                         routing=float(kind_class(residual.kind).routing_flops(residual, model)))


def training_flops_per_token(cfg: Any, vocab_size: int) -> float:
    """Total training FLOPs per token of a run (``cfg``: RunConfig)."""
    return flops_per_token(cfg.model, cfg.residual, vocab_size).total
