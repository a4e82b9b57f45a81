"""Stop anywhere and continue exactly: SIGTERM (``stop``), the resumable state (``state``), checkpoints (``io``)."""
