"""uint8 to the device (bnexp/data/transfer.py): a DataLoader batch normalized after the
transfer is bit-identical to the batch of images normalized one by one, as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from bnexp.data import build_data
from bnexp.data.loaders import build_loaders
from bnexp.data.make_imagenet import write_imagenet

CPU = torch.device("cpu")


def synthetic_cfg() -> dict:
    return {"name": "synthetic", "num_classes": 10, "image_size": 32, "train_size": 48, "test_size": 20,
            "augment": True, "padding": 4, "sampling": "shuffle", "num_workers": 0, "eval_batch_size": 8}


def imagenet_cfg(root: Path, aug: str) -> dict:
    return {"name": "imagenet", "root": str(root), "aug": aug, "image_size": 32, "resize_size": 40, "decode": "cpu",
            "sampling": "shuffle", "num_workers": 0, "eval_batch_size": 8}


@pytest.mark.parametrize("data", ["synthetic", "imagenet-cbn", "imagenet-popnorm"])
def test_uint8_transfer_is_bit_identical(data: str, tmp_path: Path) -> None:
    if data == "synthetic":
        cfg = synthetic_cfg()
    else:
        write_imagenet(tmp_path, train_per_class=5)
        cfg = imagenet_cfg(tmp_path, data.split("-")[1])
    bundle = build_data(cfg)
    loaders = build_loaders(bundle, cfg, 8, 0, False, CPU)
    assert next(iter(loaders.train))[0].dtype == torch.uint8
    torch.manual_seed(0)
    new = [loaders.to_device(*batch) for batch in loaders.train] + list(loaders.test)
    torch.manual_seed(0)  # the data set's own images, each normalized by torchvision (the path before)
    own = torch.Generator()  # as build_loaders': creating an iterator draws nothing from the global RNG
    old = list(DataLoader(bundle.train, batch_size=8, sampler=loaders.train.sampler, generator=own))
    old += list(DataLoader(bundle.test, batch_size=8, generator=own))
    assert len(new) == len(old) > 2
    for (xa, ya), (xb, yb) in zip(new, old):
        assert xa.dtype == xb.dtype == torch.float32 and torch.equal(xa, xb) and torch.equal(ya, yb)
