"""Optional run loggers, chosen with ``logger=<name>`` (``configs/logger/``).

``logger=tensorboard`` writes the scalars of every metrics.csv row (losses, accuracies,
learning rate, seconds) as TensorBoard events, by default into ``<run dir>/tensorboard``.
Under torchrun only rank 0 writes (the logged metrics are already summed over the ranks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from bnexp.callbacks import Callback, TrainState
from bnexp.errors import ConfigError

NOT_SCALARS = ("step", "epoch")


class TensorBoardLogger(Callback):
    """One TensorBoard scalar per metrics.csv column, at the row's step (rank 0 only)."""

    def __init__(self, log_dir: str | None) -> None:
        self.log_dir = log_dir
        self.writer: Any = None

    def on_train_start(self, state: TrainState) -> None:
        """Check tensorboard is installed (on every rank, so all stop alike); rank 0 opens the writer."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ConfigError("logger=tensorboard needs the tensorboard package: pip install 'bnexp[tensorboard]'") from err
        if state.dist.is_main:
            self.writer = SummaryWriter(log_dir=str(Path(self.log_dir or state.run_dir / "tensorboard")))

    def on_eval(self, state: TrainState, row: dict[str, Any]) -> None:
        if self.writer is None:
            return
        for key, value in row.items():
            if key not in NOT_SCALARS and isinstance(value, (int, float)):
                self.writer.add_scalar(f"metrics/{key}", value, global_step=row["step"])
        self.writer.flush()

    def on_train_end(self, state: TrainState, status: str) -> None:
        if self.writer is not None:
            self.writer.close()


def logger_callback(cfg: DictConfig) -> Callback | None:
    """The TensorBoard callback when ``logger=tensorboard``."""
    if OmegaConf.select(cfg, "logger.name") != "tensorboard":
        return None
    return TensorBoardLogger(OmegaConf.select(cfg, "logger.dir"))
