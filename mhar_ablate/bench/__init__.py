"""``mhar-ablate bench``: training-step throughput, memory and routing time of the variants (``model.py``,
one row a variant built and timed by ``step.py``), and decoding speed (``infer.py``)."""
