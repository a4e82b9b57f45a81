"""Stop anywhere and continue exactly: the one SIGTERM owner (``stop``), the one owner of the resumable state
(``state``) and atomic checkpoint files (``io``)."""
