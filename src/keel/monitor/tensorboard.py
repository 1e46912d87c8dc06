"""The TensorBoard sink: every metric as a scalar under its Keel key, in RUN_DIR/tensorboard."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


class TensorBoardSink:
    """`tensorboard --logdir RUN_DIR/tensorboard` shows one chart per `area/name` key."""

    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
