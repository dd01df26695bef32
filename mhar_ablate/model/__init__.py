"""The decoder and its residual-stream variants."""

from .transformer import Decoder, count_parameters, routing_overhead

__all__ = ["Decoder", "count_parameters", "routing_overhead"]
