"""A harder convergence workload: a small causal transformer language model on the Python standard library's own
source, byte-level, read at run time from this interpreter's install (nothing downloaded).

Text: every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` (``site-packages`` left out), split by file
name: a file whose name's BLAKE2b hash is 0 modulo :data:`VALIDATION_ONE_IN` is validation, the rest training;
host h of N trains on every N-th training file (sorted by name). Tokens are bytes (vocabulary 256). The corpus
is the interpreter's, so figures compare within one Python version.

Model: a GPT-style decoder (:class:`TinyGPT`): learned token and position embeddings, :data:`LAYERS` pre-norm
blocks of causal multi-head attention and a 4x GELU MLP, a final LayerNorm, the output tied to the token
embedding; 3.3M parameters at width 256. Trained with AdamW (the learning rate and batch size are the
benchmark's) on windows of :data:`CONTEXT` + 1 bytes drawn at random from the host's share; validation loss (nats per byte) and perplexity over :data:`VALIDATION_WINDOWS`
fixed windows spread evenly over the validation text.

Imported by benchmarks/convergence.py's hosts (``--workload lm``); ``python benchmarks/lm.py`` prints the
corpus, the split and the model's size.
"""

from __future__ import annotations

import hashlib
import math
import sysconfig
from pathlib import Path

import torch
from torch import nn

VOCAB = 256
CONTEXT = 128
WIDTH = 256
LAYERS = 4
HEADS = 4
WEIGHT_DECAY = 0.1
VALIDATION_ONE_IN = 10
VALIDATION_WINDOWS = 128


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted by their path under it."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted((f for f in root.rglob("*.py") if "site-packages" not in f.relative_to(root).parts),
                  key=lambda f: f.relative_to(root).as_posix())


def is_validation(name: str) -> bool:
    """Whether the file named ``name`` (its path under the standard library) is in the validation split."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") % VALIDATION_ONE_IN == 0


def split(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """(training files, validation files) of the standard library ``files``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val = [], []
    for f in files:
        (val if is_validation(f.relative_to(root).as_posix()) else train).append(f)
    return train, val


def read_bytes(files: list[Path]) -> torch.Tensor:
    """The files' bytes, one after the other, each ending with a newline, as uint8."""
    data = b"".join(f.read_bytes().rstrip(b"\n") + b"\n" for f in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class Windows(torch.utils.data.Dataset):
    """``count`` windows of ``CONTEXT + 1`` bytes of ``text`` at offsets drawn by ``generator`` (a fixed list, so
    that every epoch of a DataLoader sees the same windows in the same order)."""

    def __init__(self, text: torch.Tensor, count: int, generator: torch.Generator) -> None:
        self.text = text
        self.offsets = torch.randint(0, len(text) - CONTEXT - 1, (count,), generator=generator)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> torch.Tensor:
        o = int(self.offsets[i])
        return self.text[o : o + CONTEXT + 1].long()


def validation_windows(text: torch.Tensor, count: int = VALIDATION_WINDOWS) -> torch.Tensor:
    """``count`` windows of ``CONTEXT + 1`` bytes spread evenly over ``text`` (count x (CONTEXT + 1), int64)."""
    starts = torch.linspace(0, len(text) - CONTEXT - 1, count).long()
    return torch.stack([text[s : s + CONTEXT + 1] for s in starts.tolist()]).long()


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, each with a residual connection."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A byte-level causal transformer; ``forward`` gives the next byte's logits at every position."""

    def __init__(self, width: int = WIDTH, layers: int = LAYERS, heads: int = HEADS, context: int = CONTEXT) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos.weight[: tokens.shape[1]]
        return self.ln(self.blocks(h)) @ self.tok.weight.T  # output tied to the token embedding

    def loss(self, windows: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (nats per byte) of each window's bytes 1.. given the ones before."""
        logits = self(windows[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), windows[:, 1:].reshape(-1))


def workload(*, host: int, hosts: int, seed: int, steps: int, batch_size: int, lr: float):
    """What host ``host`` of ``hosts`` trains, as (LightningModule, DataLoader, evaluate): its share of the training
    files as ``steps`` batches, the model (the same on every host for one ``seed``) under AdamW, and ``evaluate()``,
    the validation loss (nats per byte) and perplexity the module has reached."""
    from lightning.pytorch import LightningModule

    train_files, val_files = split(stdlib_files())
    text = read_bytes(train_files[host::hosts])
    windows = Windows(text, steps * batch_size, torch.Generator().manual_seed(1000 * seed + host))
    loader = torch.utils.data.DataLoader(windows, batch_size=batch_size, drop_last=True)
    validation = validation_windows(read_bytes(val_files))

    class LanguageModel(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = TinyGPT()

        def training_step(self, batch, batch_idx):
            return self.net.loss(batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=WEIGHT_DECAY)

    torch.manual_seed(seed)  # every process starts from the same model
    module = LanguageModel()

    def evaluate() -> dict:
        module.eval()
        with torch.no_grad():
            loss = sum(float(module.net.loss(validation[i : i + 16])) * len(validation[i : i + 16])
                       for i in range(0, len(validation), 16)) / len(validation)
        return {"val_loss": loss, "perplexity": math.exp(loss), "val_tokens": len(validation) * CONTEXT}

    return module, loader, evaluate


if __name__ == "__main__":
    train_files, val_files = split(stdlib_files())
    sizes = [sum(f.stat().st_size for f in part) for part in (train_files, val_files)]
    print(f"standard library at {sysconfig.get_paths()['stdlib']}: {len(train_files)} training files "
          f"({sizes[0] / 1e6:.1f} MB), {len(val_files)} validation files ({sizes[1] / 1e6:.1f} MB)")
    print(f"TinyGPT: {sum(p.numel() for p in TinyGPT().parameters()) / 1e6:.2f}M parameters")
