"""mhar-ablate: ablation studies of depth-routing residuals (MHAR, AttnRes) in small Qwen3-style decoders."""

__version__ = "0.1.0"
