"""Stop anywhere and continue exactly: SIGTERM (``stop``), the resumable state (``state``), checkpoint files (``io``).
A continued run's position: Lightning's loop counters (``state`` edits them), read by ``_compat.data_position``."""
