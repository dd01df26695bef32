"""The ordinary pre-norm residual stream: every sublayer reads the running sum and adds to it."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from .base import Residual


class BaselineResidual(Residual):
    @classmethod
    def backend_name(cls, cfg: Any, cuda: bool) -> str:
        return "none"  # nothing routes (what results have always said for the baseline)

    def __init__(self, cfg: Any = None, model: Any = None):
        super().__init__()

    def start(self, x0: Tensor) -> list[Tensor]:
        return [x0]

    def read(self, state: list[Tensor], site: int) -> Tensor:
        return state[0]

    def write(self, state: list[Tensor], site: int, out: Tensor) -> None:
        state[0] = state[0] + out

    def finish(self, state: list[Tensor]) -> Tensor:
        return state[0]
