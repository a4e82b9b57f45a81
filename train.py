"""Train: ``python train.py [key=value ...]``, ``python train.py -m ...`` for sweeps (see README)."""

import gc
import signal
import sys

from dpddp.entry.early import answer

if __name__ == "__main__":
    # A SIGTERM from the first line on is held (blocked, pending) until dpddp.continuity.stop.command takes it:
    # imports and Hydra's composition take seconds, and the default would end the process without the line.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    # No collection while torch, Lightning and Hydra are imported (about 0.5 s of start-up here, bench/): their
    # objects live as long as the process. main() moves them out of the collector's sight and turns it back on.
    gc.disable()
    # --help, a misspelled key (devises=2), a bad plain value (devices=0): answered before torch and Lightning.
    answer(sys.argv[1:])

from dpddp.entry.hydra import main  # noqa: E402

if __name__ == "__main__":
    main()
