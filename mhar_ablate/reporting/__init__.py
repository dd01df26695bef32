"""Reporting: a study's ablation table as data (``table.py``) with its statistics (``statistics.py``,
``to_target.py``; ``gaps.py``: whether a difference lasts along the run), rendered as text (``render.py``)
and plots (``plots.py``), the downstream-evaluation columns (``eval_columns.py``), and ``mhar-ablate
export`` itself (``export.py``)."""
