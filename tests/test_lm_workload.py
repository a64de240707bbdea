"""benchmarks/lm.py, the language model workload: its split of the standard library by file name, its windows,
and its model (no training here)."""

from __future__ import annotations

import math
import sys
import sysconfig
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # as `python benchmarks/x.py` has it
import lm


def test_the_standard_library_splits_by_file_name_into_disjoint_parts():
    files = lm.stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val = lm.split(files)
    assert set(train).isdisjoint(val) and sorted(train + val) == sorted(files) and len(files) > 500
    assert 0.05 < len(val) / len(files) < 0.15
    assert all(lm.is_validation(f.relative_to(root).as_posix()) for f in val)
    assert not any("site-packages" in f.parts for f in files)
    assert lm.split(list(reversed(files))) == (sorted(train, reverse=True), sorted(val, reverse=True))


def test_windows_are_the_same_for_one_seed_and_validation_windows_are_spread_evenly():
    text = torch.arange(1000, dtype=torch.int64).remainder(256).to(torch.uint8)
    a, b = (lm.Windows(text, 5, torch.Generator().manual_seed(3)) for _ in range(2))
    assert len(a) == 5 and all(torch.equal(a[i], b[i]) for i in range(5))
    assert a[0].shape == (lm.CONTEXT + 1,) and a[0].dtype == torch.int64
    assert all(int(a[i][0]) == int(a.offsets[i]) % 256 for i in range(5))  # the bytes at each window's offset
    assert torch.equal((a[0][1:] - a[0][:-1]) % 256, torch.ones(lm.CONTEXT, dtype=torch.int64))
    val = lm.validation_windows(text, 4)
    assert val.shape == (4, lm.CONTEXT + 1) and val[0, 0] == 0 and val[-1, -1] == text[-1]


def test_the_model_has_a_few_million_parameters_and_starts_near_a_uniform_guess():
    torch.manual_seed(0)
    model = lm.TinyGPT()
    assert 3.0e6 < sum(p.numel() for p in model.parameters()) < 3.5e6
    assert model.tok.weight is next(model.parameters())  # the output is tied to the token embedding
    windows = torch.randint(0, 256, (4, lm.CONTEXT + 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert abs(float(model.loss(windows)) - math.log(256)) < 0.3
        logits = model(windows[:, :10])
        longer = model(windows[:, :20])
    assert torch.allclose(logits, longer[:, :10], atol=1e-5)  # causal: later bytes change nothing before them
