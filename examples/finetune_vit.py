"""Fine-tune a timm ViT under NodeoxStrategy: one host of a run, started by `nodeox launch` (or by hand).

Data: Oxford-IIIT Pet through torchvision when --data-dir holds it (37 breeds); otherwise scikit-learn's
digits, upscaled to RGB images (10 classes, 32x32 by default), which ships offline. Model: any timm name, random weights
unless --pretrained points at a weights file (nothing is downloaded).

    nodeox launch --hosts 2 --run-dir runs/demo -- python examples/finetune_vit.py
    tensorboard --logdir runs/demo
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import timm
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from lightning_nodeox import NodeoxStrategy, PhaseMonitor

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class ViTClassifier(LightningModule):
    def __init__(self, model: str, num_classes: int, image_size: int, lr: float, pretrained: str | None) -> None:
        super().__init__()
        self.save_hyperparameters()
        kwargs = {"pretrained_cfg_overlay": {"file": pretrained}} if pretrained else {}
        self.net = timm.create_model(model, pretrained=bool(pretrained), num_classes=num_classes, img_size=image_size,
                                     **kwargs)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", (logits.argmax(-1) == y).float().mean())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val/loss", nn.functional.cross_entropy(logits, y))
        self.log("val/acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.05)


def pet_datasets(data_dir: Path, image_size: int) -> tuple[Dataset, Dataset, int]:
    from torchvision import datasets, transforms

    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(image_size, scale=(0.6, 1.0)), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    eval_tf = transforms.Compose([
        transforms.Resize(int(image_size * 1.14)), transforms.CenterCrop(image_size), transforms.ToTensor(),
        transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    train = datasets.OxfordIIITPet(str(data_dir), split="trainval", target_types="category", transform=train_tf,
                                   download=False)
    val = datasets.OxfordIIITPet(str(data_dir), split="test", target_types="category", transform=eval_tf,
                                 download=False)
    return train, val, 37


def digits_datasets(image_size: int) -> tuple[Dataset, Dataset, int]:
    """scikit-learn's 8x8 digits as RGB images of ``image_size`` (offline stand-in for Pet)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    images = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    images = nn.functional.interpolate(images, size=image_size, mode="nearest").expand(-1, 3, -1, -1)
    images = (images - 0.5) / 0.25
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    data = TensorDataset(images[order].contiguous(), torch.tensor(y)[order])
    n_val = len(y) // 5
    return Subset(data, range(n_val, len(y))), Subset(data, range(n_val)), 10


def shard(dataset: Dataset, host: int, hosts: int) -> Dataset:
    """This host's share of the training data (every hosts-th sample)."""
    return Subset(dataset, range(host, len(dataset), hosts)) if hosts > 1 else dataset


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vit_tiny_patch16_224", help="timm model name (e.g. vit_base_patch16_224)")
    p.add_argument("--data-dir", type=Path, help="folder holding torchvision's oxford-iiit-pet (else: digits)")
    p.add_argument("--pretrained", type=Path, help="timm weights file to start from (else random weights)")
    p.add_argument("--image-size", type=int, help="default: 224 on Pet, 32 on the offline digits")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--local-steps", type=int, default=20, help="optimizer steps per host between exchanges")
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--lr", type=float, help="default: 1e-4 from pretrained weights, 1e-3 from scratch")
    p.add_argument("--workers", type=int, default=0, help="data loader worker processes")
    p.add_argument("--precision", default="32-true", help="Lightning precision, e.g. bf16-mixed on GPUs")
    args = p.parse_args()

    host = int(os.environ.get("NODEOX_HOST_ID", "0"))
    hosts = int(os.environ.get("NODEOX_NUM_HOSTS", "1"))
    run_dir = Path(os.environ.get("NODEOX_RUN_DIR", "runs/finetune"))
    torch.manual_seed(host)
    if args.image_size is None:
        args.image_size = 224 if args.data_dir is not None else 32
    if args.lr is None:
        args.lr = 1e-4 if args.pretrained is not None else 1e-3
    if args.data_dir is not None:
        train, val, classes = pet_datasets(args.data_dir, args.image_size)
    else:
        train, val, classes = digits_datasets(args.image_size)
    train = shard(train, host, hosts)
    loader_args = dict(batch_size=args.batch_size, num_workers=args.workers, persistent_workers=args.workers > 0)
    train_loader = DataLoader(train, shuffle=True, drop_last=True, **loader_args)
    val_loader = DataLoader(Subset(val, range(min(len(val), 256))), **loader_args)

    model = ViTClassifier(args.model, classes, args.image_size, args.lr, str(args.pretrained) if args.pretrained else None)
    host_dir = run_dir / "hosts" / f"host{host}"
    trainer = Trainer(
        strategy=NodeoxStrategy(local_steps=args.local_steps),
        max_steps=args.max_steps,
        precision=args.precision,
        default_root_dir=host_dir,
        logger=TensorBoardLogger(run_dir / "hosts", name=f"host{host}", version=""),
        callbacks=[PhaseMonitor(), ModelCheckpoint(dirpath=host_dir / "checkpoints", save_last=True)],
        log_every_n_steps=5,
        enable_progress_bar=False,
    )
    trainer.fit(model, train_loader)
    if host == 0:  # every host ends on the same model; one copy is enough
        trainer.save_checkpoint(host_dir / "final.ckpt")
    metrics = trainer.validate(model, val_loader, verbose=False)[0]
    print(f"host {host}: final model {trainer.strategy.model_hash}, validation accuracy {metrics['val/acc']:.3f} "
          f"(loss {metrics['val/loss']:.3f})", flush=True)


if __name__ == "__main__":
    main()
