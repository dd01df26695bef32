"""Attention Residuals (H = 1) and Multi-Head Attention Residuals (H routing heads).

Every sublayer, and a final site before the output norm, reads a softmax-over-depth mixture of the
sources computed so far (SPEC.md). Sources depend on ``residual.grouping``:

- ``full``: the embedding and every sublayer output (2L + 1 sources at the final site);
- ``block:K`` (``layer`` = ``block:1``): the embedding, the sum of each finished block of K layers, and
  for a site inside an unfinished block the running partial sum of that block. K need not divide the
  layer count: the last block is then shorter.

Each site owns a query and a key gain of width d. Queries start at zero (a uniform mixture) unless
``residual.query_init`` is ``normal:STD``.

Two paths compute the same function: the reference one below (stack the visible sources at every site,
then ``mhar_route``) and the fused one in ``fused.py`` (a source buffer and Triton kernels; no per-site
copies). ``residual.backend``: ``reference``, ``triton`` (the fused path; through Triton's interpreter on
CPU tensors) or ``auto`` (fused on CUDA tensors when the head count suits its kernels, else reference).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import UsageError
from ..kernels.reference import routing_weights
from ..ops import mhar_route
from .base import Residual
from .fused import DEFAULT_SITES_PER_PASS, FusedState, fold_norms, fused_supported, routing_range


@dataclass
class RoutedState:
    done: list[Tensor] = field(default_factory=list)  # finished sources, oldest first
    partial: Tensor | None = None  # the unfinished block's running sum
    in_block: int = 0  # sublayers already summed into ``partial``


def sources_at(site: int, block_sublayers: int) -> int:
    """Sources site ``site`` mixes: the embedding (the null source for delta), every finished block, and
    the unfinished block's partial sum if it has one (``block_sublayers``: 1 for full grouping, 2K for
    blocks of K layers)."""
    finished, partial = divmod(site, block_sublayers)
    return 1 + finished + (1 if partial else 0)


class MHARResidual(Residual):
    shared = ("heads", "grouping", "query_init", "backend")
    fused_path = True
    folds_norms = True
    depth_weights = True
    default_heads = 8

    @classmethod
    def check(cls, cfg: Any, model: Any) -> None:
        cfg.check_routing(model)

    @classmethod
    def label(cls, cfg: Any) -> str:
        """mhar-h8, mhar-h8-block:4, mhar-h4-qnormal:0.1, ..."""
        return cls.routed_label(cfg, f"{cls.kind}-h{cfg.resolved_heads()}")

    @staticmethod
    def routed_label(cfg: Any, label: str) -> str:
        if cfg.grouping != "full":
            label += f"-{cfg.grouping}"
        if cfg.query_init != "zeros":
            label += f"-q{cfg.query_init}"
        return label

    @classmethod
    def routing_flops(cls, cfg: Any, model: Any) -> float:
        """Attention over depth: at each of the 2L + 1 sites, for each of its S sources, a score
        q · (g ⊙ RMSNorm(v_i)) (d multiply-adds, the gain folded into the query) and its share of the
        mixture a_i v_i (d more), 4·d·S forward, 12·d·S per token for training; summed over the sites.
        The H heads split d, so the count does not depend on H (as attention's does not on its heads)."""
        per_source = 1 if cfg.block_layers() is None else 2 * cfg.block_layers()
        sources = sum(sources_at(site, per_source) for site in range(2 * model.n_layers + 1))
        return 12.0 * model.d_model * sources

    @classmethod
    def backend_name(cls, cfg: Any, cuda: bool) -> str:
        if cfg.backend == "auto":
            return "triton" if cuda else "reference"
        return cfg.backend

    def __init__(self, cfg: Any, model: Any):
        super().__init__()
        d = model.d_model
        self.num_heads = cfg.resolved_heads()
        self.n_sites = 2 * model.n_layers + 1
        k = cfg.block_layers()
        # Sublayers per source: 1 for full grouping, 2K for blocks of K layers.
        self.block_sublayers = 1 if k is None else 2 * k
        self.eps = model.norm_eps
        self.backend = cfg.backend
        self.fusable = fused_supported(d, self.num_heads)
        if self.backend == "triton" and not self.fusable:
            raise ValueError(f"residual.backend=triton: the fused path needs residual.heads={self.num_heads} to be a "
                             f"power of two that divides d={d}; use residual.backend=reference")
        # Consecutive sites that share one pass over the history in the fused path (fused.py), and whether
        # that path computes the sublayers' pre-norms (read_with_norm): per model, so that one process can
        # time both forms side by side.
        self.sites_per_pass = DEFAULT_SITES_PER_PASS
        self.fold_norms = fold_norms(k is not None) and self.folds_norms
        std = cfg.query_std()
        self.query = nn.Parameter(torch.randn(self.n_sites, d) * std if std > 0 else torch.zeros(self.n_sites, d))
        self.key_weight = nn.Parameter(torch.ones(self.n_sites, d))
        # None: record the depth weights on every eval-mode forward; True/False force it on or off
        # (the training loop records on one validation batch only: the weights cost a second pass).
        self.record: bool | None = None
        self._weights: list[Tensor | None] = [None] * self.n_sites

    def routing_parameters(self) -> list[nn.Parameter]:
        """The routing queries and key gains (the fused path hands their gradients over in one piece)."""
        return [self.query, self.key_weight]

    def no_decay_parameters(self) -> list[nn.Parameter]:
        return self.routing_parameters()

    def num_sources(self, site: int) -> int:
        """How many sources the given site mixes (site 2L is the final one)."""
        return sources_at(site, self.block_sublayers)

    def uses_fused(self, x0: Tensor) -> bool:
        return self.breaks_graph(x0.device)

    def breaks_graph(self, device: torch.device) -> bool:
        """The fused path (below) runs between compiled graphs; it is taken on this device or not."""
        if self.backend == "auto":
            return device.type == "cuda" and self.fusable
        return self.backend == "triton"

    def start(self, x0: Tensor) -> RoutedState | FusedState:
        if self.uses_fused(x0):
            return _fused_start(self, x0)
        return RoutedState(done=[x0])

    def recording(self) -> bool:
        return bool(self.record or (self.record is None and not self.training))

    def store_weights(self, site: int, stacked: Tensor) -> None:
        """Record the site's depth weights, averaged over batch and positions: (S, H)."""
        # A sequence at a time: over the whole batch the weights' fp32 temporaries are two stack-sized
        # tensors a site, a size larger at every site, so none is reused and the allocator keeps them all
        # cached (about 44 GB at paper100m: docs/benchmarks.md, "What a training process holds").
        with torch.no_grad():
            B, T = stacked.shape[1], stacked.shape[2]
            total = sum(routing_weights(stacked[:, b:b + 1], self.query[site], self.key_weight[site], self.num_heads,
                                        self.eps).sum(dim=(1, 2)) for b in range(B))
            self._weights[site] = (total / (B * T)).cpu()

    def _route(self, sources: list[Tensor], site: int) -> Tensor:
        stacked = torch.stack(sources)
        if self.recording():
            self.store_weights(site, stacked)
        # This stacked path is the reference; the Triton kernels serve the fused path (start()).
        return mhar_route(stacked, self.query[site], self.key_weight[site], self.num_heads, self.eps, "reference")

    def read(self, state: RoutedState | FusedState, site: int) -> Tensor:
        if isinstance(state, FusedState):
            return _fused_read(state, site)
        sources = state.done if state.partial is None else [*state.done, state.partial]
        return self._route(sources, site)

    def read_with_norm(self, state: RoutedState | FusedState, site: int, norm: nn.Module
                       ) -> tuple[Tensor, Tensor | None]:
        """On the fused path the sublayer's RMSNorm is computed in the site's own kernels: its forward
        where the site's input is written, its backward where the input's gradient is read (``fused.py``)."""
        if isinstance(state, FusedState) and self.fold_norms:
            return _fused_read_with_norm(state, site, norm)
        return self.read(state, site), None

    def write(self, state: RoutedState | FusedState, site: int, out: Tensor) -> None:
        if isinstance(state, FusedState):
            return _fused_write(state, site, out)
        state.partial = out if state.partial is None else state.partial + out
        state.in_block += 1
        if state.in_block == self.block_sublayers:
            state.done.append(state.partial)
            state.partial, state.in_block = None, 0

    def finish(self, state: RoutedState | FusedState) -> Tensor:
        return self.read(state, self.n_sites - 1)

    def last_weights(self) -> list[Tensor] | None:
        if any(w is None for w in self._weights):
            return None
        return list(self._weights)  # type: ignore[arg-type]


# The fused path is opaque to torch.compile (a buffer mutated behind autograd's back, state shared between
# sites): compiling a model that uses it compiles the sublayers between these calls, which run eagerly.
# The profiler ranges let ``mhar-ablate bench`` attribute kernel time to routing (fused.py marks backward).
@torch.compiler.disable
def _fused_start(residual: MHARResidual, x0: Tensor) -> FusedState:
    with routing_range():
        return FusedState(residual, x0)


@torch.compiler.disable
def _fused_read(state: FusedState, site: int) -> Tensor:
    with routing_range():
        return state.read(site)


@torch.compiler.disable
def _fused_read_with_norm(state: FusedState, site: int, norm: nn.Module) -> tuple[Tensor, Tensor | None]:
    from ..norm import RMSNorm

    with routing_range():
        if type(norm) is RMSNorm:  # the norm the kernels compute
            return state.read_with_norm(site, norm)
        return state.read(site), None


@torch.compiler.disable
def _fused_write(state: FusedState, site: int, out: Tensor) -> None:
    with routing_range():
        state.write(site, out)


class AttnResResidual(MHARResidual):
    """Single-head Attention Residuals: MHAR with H = 1 (the config refuses any other H)."""

    shared = ("grouping", "query_init", "backend")  # and heads, which must be 1
    default_heads = 1

    @classmethod
    def check(cls, cfg: Any, model: Any) -> None:
        h = cfg.resolved_heads()
        if h != 1:
            raise UsageError(f"residual.kind=attnres is single-head; use residual.kind=mhar for residual.heads={h}")
        cfg.check_routing(model)

    @classmethod
    def label(cls, cfg: Any) -> str:
        return cls.routed_label(cfg, "attnres")
