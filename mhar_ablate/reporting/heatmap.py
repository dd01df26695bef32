"""The routing heatmap: for every site (rows) the depth weight given to every source (columns), one
panel per routing head, so a person can see what MHAR learned."""

from __future__ import annotations

import math

import numpy as np
from torch import Tensor


def weights_matrix(weights: list[Tensor]) -> np.ndarray:
    """Stack per-site (sources, heads) weights into (heads, sites, max_sources), NaN where unseen."""
    heads = weights[0].shape[1]
    width = max(w.shape[0] for w in weights)
    out = np.full((heads, len(weights), width), np.nan, dtype=np.float32)
    for i, w in enumerate(weights):
        out[:, i, : w.shape[0]] = w.float().numpy().T
    return out


def routing_image(weights: list[Tensor], cell: int = 12) -> np.ndarray:
    """The same heatmap as an RGB array (H, W, 3) without matplotlib's layout engine, which costs about a
    second per figure: cheap enough to log during training. Heads sit side by side, 2 px apart."""
    from matplotlib import colormaps

    m = weights_matrix(weights)
    heads, sites, width = m.shape
    rgb = colormaps["viridis"](np.nan_to_num(m, nan=0.0))[..., :3]  # (heads, sites, width, 3)
    rgb[np.isnan(m)] = 0.93  # sources a site cannot see yet: light grey
    rgb = rgb.repeat(cell, axis=1).repeat(cell, axis=2)
    gap = np.ones((sites * cell, 2, 3))
    panels = [p for h in range(heads) for p in ((rgb[h], gap) if h < heads - 1 else (rgb[h],))]
    return (np.concatenate(panels, axis=1) * 255).astype(np.uint8)


def routing_figure(weights: list[Tensor], title: str = ""):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = weights_matrix(weights)
    heads, sites, width = m.shape
    cols = min(heads, 4)
    rows = math.ceil(heads / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols + 1.2, 2.4 * rows + 0.6), squeeze=False)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#eeeeee")  # grey: sources a site cannot see yet
    image = None
    for h in range(rows * cols):
        ax = axes[h // cols][h % cols]
        if h >= heads:
            ax.axis("off")
            continue
        image = ax.imshow(m[h], cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
        ax.set_title(f"head {h}" if heads > 1 else "single head", fontsize=9)
        ax.set_xlabel("source (0 = embedding)", fontsize=8)
        ax.set_ylabel("site (last = final)", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(title or "depth weights per routing site", fontsize=10)
    fig.tight_layout()
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8)
    return fig
