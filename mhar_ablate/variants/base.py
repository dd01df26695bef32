"""The interface every residual-stream variant implements (``Residual``), and what the variants share.

A variant is one module beside this one: its class implements ``Residual`` and carries, as class
attributes, what the rest of the package asks of a kind without building a model (see the registry in
``__init__.py``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn


class Residual(nn.Module):
    """Interface of a residual-stream variant; ``state`` is whatever object the variant needs."""

    # ------------------------------------------------------------------ what the registry knows of a kind
    Settings: ClassVar[type | None] = None  # its own settings: fields = the residual.<kind>.<name> keys
    # The shared residual.* keys it reads, of heads, grouping, query_init, backend; the others it ignores.
    shared: ClassVar[tuple[str, ...]] = ()
    default_heads: ClassVar[int | None] = None  # routing heads when residual.heads is unset; None: no heads
    fused_path: ClassVar[bool] = False  # a fused GPU path, chosen by residual.backend
    # Its fused path can compute the sublayers' pre-norms in its own kernels (``read_with_norm``), where the
    # model's ``fold_norms`` says (``bench model --fold-norms`` times both).
    folds_norms: ClassVar[bool] = False
    # Records depth weights (TensorBoard's routing/depth_weights, routing.png): such a variant honours
    # ``record`` (set by the training loop: True/False force recording on or off, None records on every
    # eval-mode forward) and returns them from ``last_weights``. The others return None there.
    depth_weights: ClassVar[bool] = False

    @classmethod
    def check(cls, cfg: Any, model: Any) -> None:
        """Refuse a bad configuration with one ``UsageError`` line (``cfg``: ResidualConfig, ``model``:
        ModelConfig), before anything is built."""

    @classmethod
    def label(cls, cfg: Any) -> str:
        """What an arm of this kind is, in a few characters (run folders, result files, tables)."""
        return cfg.kind

    @classmethod
    def backend_name(cls, cfg: Any, cuda: bool) -> str:
        """What computes the routing, for results (``routing_backend``): plain PyTorch unless fused."""
        return "pytorch"

    @classmethod
    def routing_flops(cls, cfg: Any, model: Any) -> float:
        """Training FLOPs per token of the variant's own computation (``cfg``: ResidualConfig, ``model``:
        ModelConfig), on top of the decoder's (``model/flops.py``). Counted as the decoder is: 2 FLOPs per
        multiply-add of every weighted sum and projection, times 3 for a training step (the backward pass
        takes twice the forward's, a gradient for each operand); norms, softmaxes, gates and additions of
        whole streams are left out, as the decoder's count leaves out its own. The baseline adds nothing."""
        return 0.0

    @classmethod
    def bench_variants(cls) -> dict[str, dict[str, str]]:
        """``bench model`` rows of a kind without a fused path: row name -> its residual.<kind>.* overrides.
        (Kinds with a fused path get the grouping x path rows instead, see bench/variants.py.)"""
        return {cls.kind: {}}

    kind: ClassVar[str] = ""  # set by the registry below

    # ------------------------------------------------------------------ one forward pass
    def start(self, x0: Tensor) -> Any:
        raise NotImplementedError

    def read(self, state: Any, site: int) -> Tensor | tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def read_with_norm(self, state: Any, site: int, norm: nn.Module
                       ) -> tuple[Tensor | tuple[Tensor, Tensor, Tensor], Tensor | None]:
        """``read``'s result, and ``norm`` (the sublayer's pre-norm) of it where the variant computes it
        itself; None: the sublayer applies its norm."""
        return self.read(state, site), None

    def write(self, state: Any, site: int, out: Tensor) -> None:
        raise NotImplementedError

    def finish(self, state: Any) -> Tensor:
        raise NotImplementedError

    def breaks_graph(self, device: torch.device) -> bool:
        """Whether a forward on ``device`` runs parts of the stream outside torch.compile's graphs (a
        fused path opaque to the compiler), so that a compiled model is several graphs."""
        return False

    # ------------------------------------------------------------------ training
    def no_decay_parameters(self) -> list[nn.Parameter]:
        """Parameters that take no weight decay: routing queries and key gains, static mixing weights,
        gates and scales. Decay would pull them toward zero, away from the identity-like start most
        variants depend on; the variants' projection matrices decay like any other matrix."""
        return []

    def last_weights(self) -> list[Tensor] | None:
        """Per routing site, the depth weights of the last recorded forward pass, (sources, heads); None
        for variants without depth weights (``depth_weights = False``)."""
        return None


def separate_rng():
    """A context for a variant's random initial values that leaves the (CPU) generator where it was: the
    decoder initialises its attention and MLP weights after building the residual, so at one seed every
    kind starts from the baseline's sublayer weights, and arms are compared from the same start."""
    return torch.random.fork_rng(devices=[])

