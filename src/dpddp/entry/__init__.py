"""The entry points: ``hydra`` (``train.py``, sweeps) and ``cli`` (the Lightning CLI), and the sweep summary."""
