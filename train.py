"""Train: ``python train.py [key=value ...]``, ``python train.py -m ...`` for sweeps (see README)."""

import gc
import signal

from dpddp.cluster import refuse_non_integer_variables

if __name__ == "__main__":
    # A SIGTERM is held (pending) until dpddp.continuity.stop.command takes it: no silent end during the imports.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    gc.disable()  # no collection during the imports, whose objects live as long as the process (main turns it on)
    refuse_non_integer_variables()  # before torch: torchmetrics reads LOCAL_RANK as a number on import

from dpddp.entry.hydra import main  # noqa: E402

if __name__ == "__main__":
    main()
