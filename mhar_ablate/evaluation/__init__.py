"""Downstream evaluation of trained runs with lm-evaluation-harness (the optional ``eval`` extra).

``trained.py`` loads a run folder's final weights and tokenizer; ``harness.py`` is the adapter the
harness calls (log-likelihoods, rolling log-likelihoods, greedy generation); ``tasks.py`` runs the
harness's tasks offline and writes ``RUN/eval/<tasks>.json``. The command is ``cli/eval.py``; the
columns it adds to a study's export are ``reporting/eval_columns.py``. Only ``harness.py`` and
``tasks.py`` import ``lm_eval``.
"""
