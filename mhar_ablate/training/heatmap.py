"""The routing heatmap: for every site (rows) the depth weight given to every source (columns), one
panel per routing head, so a person can see what MHAR learned.

Weights are shown relative to a uniform mixture, as log2(weight × visible sources): 0 (white) is the
uniform start of zero-initialised queries, red is a source a site leans on, blue one it ignores. Raw
weights would all look alike, since a site that sees n sources starts at 1/n everywhere.
"""

from __future__ import annotations

import math

import numpy as np
from torch import Tensor

SCALE = 2.0  # colour range in log2 units: +-2 is 4x over or under uniform


def weights_matrix(weights: list[Tensor]) -> np.ndarray:
    """Stack per-site (sources, heads) weights into (heads, sites, max_sources), NaN where unseen."""
    heads = weights[0].shape[1]
    width = max(w.shape[0] for w in weights)
    out = np.full((heads, len(weights), width), np.nan, dtype=np.float32)
    for i, w in enumerate(weights):
        out[:, i, : w.shape[0]] = w.float().numpy().T
    return out


def relative_to_uniform(m: np.ndarray) -> np.ndarray:
    """log2(weight × number of visible sources), per site; NaN stays NaN."""
    visible = np.sum(~np.isnan(m), axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        return np.log2(np.clip(m * visible, 1e-12, None))


def routing_image(weights: list[Tensor], cell: int = 12) -> np.ndarray:
    """The heatmap as an RGB array (H, W, 3) without matplotlib's layout engine, which costs about a
    second per figure: cheap enough to log during training. Heads sit side by side, 2 px apart."""
    from matplotlib import colormaps

    rel = relative_to_uniform(weights_matrix(weights))
    heads, sites, width = rel.shape
    rgb = colormaps["RdBu_r"]((np.nan_to_num(rel, nan=0.0) / SCALE + 1) / 2)[..., :3]
    rgb[np.isnan(rel)] = 0.85  # sources a site cannot see yet: grey
    rgb = rgb.repeat(cell, axis=1).repeat(cell, axis=2)
    gap = np.ones((sites * cell, 2, 3))
    panels = [p for h in range(heads) for p in ((rgb[h], gap) if h < heads - 1 else (rgb[h],))]
    return (np.concatenate(panels, axis=1) * 255).astype(np.uint8)


def routing_figure(weights: list[Tensor], title: str = ""):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rel = relative_to_uniform(weights_matrix(weights))
    heads, sites, width = rel.shape
    cols = min(heads, 4)
    rows = math.ceil(heads / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.7 * cols + 1.0, 2.5 * rows + 0.7), squeeze=False,
                             layout="constrained")
    cmap = matplotlib.colormaps["RdBu_r"].with_extremes(bad="#d9d9d9")  # grey: sources a site cannot see yet
    image = None
    for h in range(rows * cols):
        ax = axes[h // cols][h % cols]
        if h >= heads:
            ax.axis("off")
            continue
        image = ax.imshow(rel[h], cmap=cmap, vmin=-SCALE, vmax=SCALE, aspect="auto", interpolation="nearest")
        ax.set_title(f"head {h}" if heads > 1 else "single head", fontsize=9)
        ax.set_xlabel("source (0 = embedding)", fontsize=8)
        ax.set_ylabel("site (last = final)", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(title or "depth weights per routing site", fontsize=10)
    if image is not None:
        bar = fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.85)
        bar.set_label("log2(weight / uniform)", fontsize=8)
    return fig


def routing_png(weights: list[Tensor], label: str) -> bytes:
    """A run's ``routing.png``: the final depth weights of the variant ``label`` as a PNG."""
    import io

    import matplotlib.pyplot as plt

    fig = routing_figure(weights, f"{label}: final depth weights")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()
