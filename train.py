"""Train the linear classifier: ``python train.py [key=value ...]``, ``python train.py -m ...`` for sweeps."""

import hydra
from omegaconf import DictConfig

from dpddp.job import run


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """Hydra composes ``conf/config.yaml`` with the overrides; returns ``val/loss`` for sweepers."""
    return run(cfg)


if __name__ == "__main__":
    main()
