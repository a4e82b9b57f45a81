"""Stop anywhere and continue exactly: the one SIGTERM owner (``stop``), the one owner of the resumable state
(``state``) and atomic checkpoint files (``io``).

Where a continued run's position comes from: Lightning restores its loop counters from the checkpoint's ``loops``
(``state`` edits them as it saves: an epoch cut inside stays unfinished); the training samplers read the position
from them (``dpddp._compat.data_position``: epoch and batches done; ``dpddp.data.global_batch.step_position``
under ``steps_per_execution``) and skip the batches already trained (``GlobalBatchSampler``, ``data.sharded``)."""
