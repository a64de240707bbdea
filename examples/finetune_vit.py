"""Fine-tune a timm ViT under NodeoxStrategy: one host of a run, started by `nodeox launch` (or by hand).

Data: Oxford-IIIT Pet through torchvision when --data-dir holds it (37 breeds); otherwise scikit-learn's
digits, upscaled to RGB images (10 classes, 32x32 by default), which ships offline. Model: any timm name, random
weights unless --pretrained points at a weights file (nothing is downloaded). Every host loads the whole training
set and the coordinator's data ledger shares out each epoch among the hosts, however many come, go or lag; with
--shard each host trains on its own fixed shard instead (NODEOX_HOST_ID of NODEOX_NUM_HOSTS, which `nodeox launch`
sets). See docs/finetune.md.

    nodeox launch --hosts 2 --run-dir runs/demo -- python examples/finetune_vit.py
    nodeox launch --hosts 2 --run-dir runs/vitb -- python examples/finetune_vit.py --preset vit-b-study \\
        --data-dir /data --pretrained /weights/vit_base_patch16_224.safetensors
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings
from pathlib import Path

import timm
import torch
from lightning.fabric.utilities import suggested_max_num_workers
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from lightning_nodeox import NodeoxStrategy, PhaseMonitor

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
MAX_WORKERS = 8

# The settings of the E1 study's runs (full fine-tuning in fp32, batch 32, 20 local steps, Pet at 224x224).
STUDY = {"precision": "32-true", "batch_size": 32, "local_steps": 20, "image_size": 224}
PRESETS = {
    "vit-b-study": {**STUDY, "model": "vit_base_patch16_224"},
    "vit-h-study": {**STUDY, "model": "vit_huge_patch14_224"},
}

PET_FETCH = "python -c \"from torchvision.datasets import OxfordIIITPet; OxfordIIITPet('/data', download=True)\""


class ViTClassifier(LightningModule):
    """A timm model with a fresh head of ``num_classes``, trained with AdamW on cross-entropy."""

    def __init__(self, model: str, num_classes: int, image_size: int, lr: float, pretrained: str | None) -> None:
        super().__init__()
        self.save_hyperparameters()
        weights = {"pretrained": True, "pretrained_cfg_overlay": {"file": pretrained}} if pretrained else {}
        self.net = timm.create_model(model, num_classes=num_classes, img_size=image_size, **weights)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", (logits.argmax(-1) == y).float().mean())
        return loss

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.log("test/loss", nn.functional.cross_entropy(logits, y))
        self.log("test/acc", (logits.argmax(-1) == y).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.05)


class Digits(Dataset):
    """scikit-learn's 8x8 digits as RGB images of ``size`` pixels, upscaled one at a time (not held at full size)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, size: int) -> None:
        self.images, self.labels, self.size = images, labels, size

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = nn.functional.interpolate(self.images[i][None], size=self.size, mode="nearest")[0]
        return image.expand(3, -1, -1), self.labels[i]


def digits_datasets(image_size: int) -> tuple[Dataset, Dataset, int]:
    """Training and held-out digits (4:1, shuffled once with a fixed seed) and the number of classes."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    images = (torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0 - 0.5) / 0.25
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    images, labels = images[order], torch.tensor(y)[order]
    n_test = len(y) // 5
    return (Digits(images[n_test:], labels[n_test:], image_size), Digits(images[:n_test], labels[:n_test], image_size),
            10)


def pet_datasets(data_dir: Path, image_size: int) -> tuple[Dataset, Dataset, int]:
    """Oxford-IIIT Pet's trainval and test splits from ``data_dir`` (never downloaded) and the number of classes."""
    from torchvision import datasets, transforms

    pet = data_dir / "oxford-iiit-pet"
    if not ((pet / "images").is_dir() and (pet / "annotations").is_dir()):
        raise SystemExit(
            f"finetune_vit.py: no Oxford-IIIT Pet in --data-dir {data_dir} (expected {pet}/images and "
            f"{pet}/annotations; give the folder that holds oxford-iiit-pet). Fetch it once on a machine with "
            f"internet: {PET_FETCH}, then copy /data/oxford-iiit-pet into the data dir (see docs/finetune.md).")
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(image_size, scale=(0.6, 1.0)), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    test_tf = transforms.Compose([
        transforms.Resize(int(image_size * 1.14)), transforms.CenterCrop(image_size), transforms.ToTensor(),
        transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    train = datasets.OxfordIIITPet(str(data_dir), split="trainval", transform=train_tf, download=False)
    test = datasets.OxfordIIITPet(str(data_dir), split="test", transform=test_tf, download=False)
    return train, test, 37


def host_of_run() -> tuple[int, int]:
    """This host's number and the number of hosts: NODEOX_HOST_ID of NODEOX_NUM_HOSTS, 0 of 1 when unset."""
    host, hosts = os.environ.get("NODEOX_HOST_ID", "0"), os.environ.get("NODEOX_NUM_HOSTS", "1")
    if not (host.isdigit() and hosts.isdigit() and int(host) < int(hosts)):
        raise SystemExit(f"finetune_vit.py --shard shards its data by host number: set NODEOX_HOST_ID to 0..N-1 and "
                         f"NODEOX_NUM_HOSTS=N (got NODEOX_HOST_ID={host!r}, NODEOX_NUM_HOSTS={hosts!r})")
    return int(host), int(hosts)


def shard(dataset: Dataset, host: int, hosts: int) -> Dataset:
    """This host's share of the training data (every hosts-th sample), disjoint from every other host's.

    A host with several devices splits the shard among them (:class:`ShardLoader`).
    """
    return Subset(dataset, range(host, len(dataset), hosts)) if hosts > 1 else dataset


class ShardLoader(LightningDataModule):
    """``--shard``: the host's shard, shuffled; on a host of several devices split among its ranks by a
    DistributedSampler of its own (the Trainer's ``use_distributed_sampler=False`` leaves it as given)."""

    def __init__(self, train: Dataset, **loader_args) -> None:
        super().__init__()
        self.train, self.loader_args = train, loader_args

    def train_dataloader(self) -> DataLoader:
        ranks, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedSampler(self.train, ranks, rank, shuffle=True) if ranks > 1 else None
        return DataLoader(self.train, shuffle=sampler is None, sampler=sampler, drop_last=True, **self.loader_args)


def parse_args() -> argparse.Namespace:
    """The command line; a --preset fills the defaults that explicit flags then override."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), help="the E1 study's settings (ViT-B/16 or ViT-H/14, fp32, "
                   "batch 32, 20 local steps, 224x224; Pet with --data-dir) as defaults that other flags override")
    p.add_argument("--model", default="vit_tiny_patch16_224", help="timm model name (e.g. vit_base_patch16_224)")
    p.add_argument("--data-dir", type=Path, help="folder holding torchvision's oxford-iiit-pet (else: digits)")
    p.add_argument("--pretrained", type=Path, help="timm weights file to start from (else random weights)")
    p.add_argument("--image-size", type=int, help="default: 224 on Pet and in presets, 32 on the offline digits")
    p.add_argument("--batch-size", type=int, default=32, help="per device")
    p.add_argument("--local-steps", type=int, default=20, help="optimizer steps per host between exchanges")
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--overlap", default="eager", choices=["off", "eager", "delayed"],
                   help="keep training while a round's exchange is in flight (default eager; off: wait for each sync)")
    p.add_argument("--test-images", type=int, default=256, help="held-out images to evaluate the final model on")
    p.add_argument("--lr", type=float, help="default: 1e-4 from pretrained weights, 1e-3 from scratch")
    p.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "16-mixed"],
                   help="Lightning precision; mixed precision on GPUs (16-mixed needs CUDA)")
    p.add_argument("--devices", type=int, default=1, help="devices of this host (one exchange per host)")
    p.add_argument("--workers", type=int, help="data loader processes per device (default: 0 on the in-memory "
                   f"digits, else the CPUs this process may use less one, at most {MAX_WORKERS})")
    p.add_argument("--progress-bar", action="store_true", help="show Lightning's progress bar")
    p.add_argument("--shard", action="store_true", help="each host trains on its own fixed shard (NODEOX_HOST_ID of "
                   "NODEOX_NUM_HOSTS) instead of the share the coordinator's data ledger gives it")
    preset = p.parse_known_args()[0].preset
    if preset:
        p.set_defaults(**PRESETS[preset])
    args = p.parse_args()
    if args.test_images < 1:
        p.error("--test-images must be at least 1")
    if args.pretrained is not None and not args.pretrained.is_file():
        p.error(f"--pretrained {args.pretrained}: no such file; save the weights once on a machine with internet "
                "and copy the file here (see docs/finetune.md)")
    if args.image_size is None:
        args.image_size = 224 if args.data_dir is not None else 32
    if args.lr is None:
        args.lr = 1e-4 if args.pretrained is not None else 1e-3
    if args.workers is None:
        args.workers = 0 if args.data_dir is None else min(MAX_WORKERS, suggested_max_num_workers(args.devices))
    return args


def quiet_lightning(in_memory_data: bool) -> None:
    """Silence Lightning's advertising tips, and its advice to add loader workers when the data is in memory."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: not record.getMessage().startswith("💡 Tip"))
    if in_memory_data:
        warnings.filterwarnings("ignore", ".*does not have many workers", PossibleUserWarning)


def main() -> None:
    args = parse_args()
    host, hosts = host_of_run() if args.shard else (os.environ.get("NODEOX_HOST_ID", "0"), 1)
    run_dir = Path(os.environ.get("NODEOX_RUN_DIR", "runs/finetune"))
    quiet_lightning(in_memory_data=args.data_dir is None)
    torch.manual_seed(0)  # the same initial weights on every host: none has to fetch the model at the start

    if args.data_dir is not None:
        train, test, classes = pet_datasets(args.data_dir, args.image_size)
    else:
        train, test, classes = digits_datasets(args.image_size)
    if args.shard:
        train = shard(train, host, hosts)
    test_order = torch.randperm(len(test), generator=torch.Generator().manual_seed(0))
    test = Subset(test, test_order[:args.test_images].tolist())
    loader_args = {"batch_size": args.batch_size, "num_workers": args.workers, "persistent_workers": args.workers > 0}
    train_loader = DataLoader(train, shuffle=True, drop_last=True, **loader_args)
    test_loader = DataLoader(test, **loader_args)
    if len(train_loader) == 0:
        raise SystemExit(f"finetune_vit.py: host {host}'s training data holds {len(train)} images, fewer than one "
                         f"batch of {args.batch_size}: lower --batch-size or run fewer hosts")
    print(f"host {host}{f' of {hosts}' if args.shard else ''}: {args.model} on {'Pet' if args.data_dir else 'digits'} at {args.image_size}px, "
          f"{len(train)} training images {'in its shard' if args.shard else 'shared out by the run'}, batch {args.batch_size}, {args.local_steps} local steps, "
          f"{args.max_steps} steps, {args.precision}", flush=True)

    model = ViTClassifier(args.model, classes, args.image_size, args.lr,
                          str(args.pretrained) if args.pretrained else None)
    host_dir = run_dir / "hosts" / f"host{host}"
    trainer = Trainer(
        strategy=NodeoxStrategy(local_steps=args.local_steps, overlap=False if args.overlap == "off" else args.overlap),
        devices=args.devices,
        use_distributed_sampler=not args.shard,  # True: the data ledger's sampler; --shard: ShardLoader's
        max_steps=args.max_steps,
        precision=args.precision,
        default_root_dir=host_dir,
        logger=TensorBoardLogger(run_dir / "hosts", name=f"host{host}", version=""),
        callbacks=[PhaseMonitor()],
        enable_checkpointing=False,  # no full-model saves inside rounds; the final model is saved below
        enable_model_summary=False,
        enable_progress_bar=args.progress_bar,  # a bar redraws its line, which `nodeox launch`'s prefixes garble
        log_every_n_steps=min(5, len(train_loader)),
    )
    if args.shard:
        trainer.fit(model, datamodule=ShardLoader(train, **loader_args))
    else:
        trainer.fit(model, train_loader)
    if str(host) == "0":  # every host ends on the same model; one copy is enough
        trainer.save_checkpoint(host_dir / "final.ckpt", weights_only=True)
    if trainer.is_global_zero:
        print(f"host {host}: evaluating the final model on {len(test)} held-out images", flush=True)
    metrics = trainer.test(model, test_loader, verbose=False)[0]
    if trainer.is_global_zero:
        print(f"host {host}: final model {trainer.strategy.model_hash}, test accuracy {metrics['test/acc']:.3f} "
              f"(loss {metrics['test/loss']:.3f})", flush=True)


if __name__ == "__main__":
    main()
