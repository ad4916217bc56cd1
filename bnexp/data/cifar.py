"""CIFAR-10/100 through torchvision, with explicit offline and corrupt-file errors."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Mapping

import torch
from torchvision.datasets import CIFAR10, CIFAR100

from bnexp.data.arrays import ArrayData
from bnexp.data.files import DataFiles, ensure_present, read_or_fail, verify_checksums


def _verified(cls: type[CIFAR10]) -> type[CIFAR10]:
    """A torchvision CIFAR class whose own md5 checks are replaced by ours (done first, and
    skippable with data.verify=false); bnexp needs no class names, so the meta file is not read."""
    return type(f"Checked{cls.__name__}", (cls,), {"_check_integrity": lambda self: True, "_load_meta": lambda self: None})


def _files(cls: type[CIFAR10], root: Path, label: str) -> DataFiles:
    folder = root / cls.base_folder
    files = [(folder / name, md5) for name, md5 in cls.train_list + cls.test_list]
    files.append((folder / cls.meta["filename"], cls.meta["md5"]))
    holds = f"{cls.base_folder}/ (or its {cls.filename} archive)"
    return DataFiles(label, folder, holds, tuple(files))


def _unpickle(path: Path) -> object:
    with open(path, "rb") as f:
        return pickle.load(f, encoding="latin1")


def _split(cls: type[CIFAR10], root: Path, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ds = _verified(cls)(str(root), train=train, download=False)
    images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()
    return images, torch.as_tensor(ds.targets, dtype=torch.int64)


def load_cifar(cfg: Mapping[str, Any]) -> ArrayData:
    """CIFAR-10 or CIFAR-100 from ``data.root`` (downloaded there when allowed)."""
    cls, label = (CIFAR10, "CIFAR-10") if cfg["name"] == "cifar10" else (CIFAR100, "CIFAR-100")
    root = Path(str(cfg["root"])).expanduser()
    files = _files(cls, root, label)
    # A release archive already in data.root is extracted even with downloading off.
    allowed = bool(cfg.get("download", True)) or (root / cls.filename).is_file()
    ensure_present(files, lambda: cls(str(root), train=True, download=True), allowed)
    if cfg.get("verify", True):
        verify_checksums(files)
    (x_train, y_train), (x_test, y_test) = read_or_fail(
        files, lambda: (_split(cls, root, train=True), _split(cls, root, train=False)), _unpickle
    )
    return ArrayData(cfg["name"], x_train, y_train, x_test, y_test, 10 if cls is CIFAR10 else 100)
