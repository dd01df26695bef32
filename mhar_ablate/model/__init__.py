"""The decoder (``transformer.py``), its FLOPs count (``flops.py``) and its weights in and out (``weights.py``);
the residual-stream variants it routes through are in ``mhar_ablate/variants/``."""

from .transformer import Decoder, KVCache, count_parameters, routing_overhead

__all__ = ["Decoder", "KVCache", "count_parameters", "routing_overhead"]
