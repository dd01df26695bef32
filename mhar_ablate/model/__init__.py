"""The decoder and its residual-stream variants."""

from .transformer import Decoder, KVCache, count_parameters, routing_overhead

__all__ = ["Decoder", "KVCache", "count_parameters", "routing_overhead"]
