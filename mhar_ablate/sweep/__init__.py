"""Studies: a study's definition (``definition.py``), the Optuna driver that runs its arms x seeds grid
(``driver.py``) through workers (``workers.py``), where a study is stored (``storage.py``, ``catalog.py``),
and what a finished trial records (``trials.py``); which grid point a trial trains: ``points.py``."""
