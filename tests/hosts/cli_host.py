"""A test host started through LightningCLI: `python cli_host.py fit --config ... --data.out DIR`.

Its data module records which host ran prepare_data, and whether a host that did not found the data prepared
before its own setup (hosts of one machine: prepare_data once, the others wait)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from digits_host import DigitsNet
from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningCLI
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset


class DigitsData(LightningDataModule):
    def __init__(self, out: Path, batch_size: int = 32) -> None:
        super().__init__()
        self.out, self.batch_size = Path(out), batch_size
        self.host = os.environ["NODEOX_HOST_ID"]

    def prepare_data(self) -> None:
        time.sleep(2.0)  # a slow download: the other host of this machine must wait for it
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"prepared_by_{self.host}").write_text("done")

    def setup(self, stage: str) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"setup_{self.host}.json").write_text(json.dumps(
            {"local_rank": self.trainer.local_rank, "prepared_before_setup": (self.out / "prepared_by_0").exists()}))
        x, y = load_digits(return_X_y=True)
        self.data = TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y))

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(int(self.host))
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True, generator=gen, drop_last=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    LightningCLI(DigitsNet, DigitsData)
