"""Train: ``python train.py [key=value ...]``, ``python train.py -m ...`` for sweeps (see README)."""

import gc
import signal
import sys

from dpddp.entry.early import answer

if __name__ == "__main__":
    # A SIGTERM is held (pending) until dpddp.continuity.stop.command takes it: no silent end during the imports.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    gc.disable()  # no collection during the imports, whose objects live as long as the process (main turns it on)
    answer(sys.argv[1:])  # --help, a misspelled key, a bad plain value: before torch and Lightning

from dpddp.entry.hydra import main  # noqa: E402

if __name__ == "__main__":
    main()
