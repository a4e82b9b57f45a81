"""The packaged Hydra configs (``pkg://dpddp.conf``)."""
