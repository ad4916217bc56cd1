"""``data=imagenet``: ILSVRC-2012 from class folders or from the official archives.

``data.format``:

- ``folder``: ``<data.root>/train/<wnid>/*.JPEG`` and ``<data.root>/val/<wnid>/*.JPEG``,
  read by ``torchvision.datasets.ImageFolder``; ``scripts/prepare_imagenet.py`` sorts the
  official validation archive into ``val/<wnid>/``.
- ``archive``: ``<data.root>`` holds ``ILSVRC2012_img_train.tar``, ``ILSVRC2012_img_val.tar``
  and ``ILSVRC2012_devkit_t12.tar.gz``; ``torchvision.datasets.ImageNet`` checks their md5,
  unpacks them into ``train/`` and ``val/`` on first use (the devkit supplies the
  validation labels; reading it needs scipy).
- ``auto`` (default): ``folder`` when ``train/`` and ``val/`` both exist, else ``archive``
  when any official archive is there, else ``folder`` (whose error names the layout).

``data.aug``: ``cbn`` trains on RandomResizedCrop(image_size) + flip and evaluates on
resize(resize_size) (shorter side) + center crop(image_size), the CBN ImageNet protocol;
``popnorm`` resizes every image to resize_size x resize_size, then trains on a random
crop(image_size) + flip and evaluates on the center crop(image_size) (POP-Norm's
"resize 256x256, random crop 224"). Both normalize with the ImageNet mean and std.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from torchvision.datasets import ImageFolder, ImageNet
from torchvision.datasets.folder import IMG_EXTENSIONS
from torchvision.datasets.imagenet import ARCHIVE_META
from torchvision.transforms import v2

from bnexp.errors import ConfigError, DataError, DataUnavailable, unknown_choice

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
FORMATS = ("auto", "folder", "archive")
AUGS = ("cbn", "popnorm")
SPLITS = ("train", "val")
ARCHIVES = tuple(name for name, _ in ARCHIVE_META.values())


def imagenet_transform(cfg: Mapping[str, Any], train: bool) -> v2.Transform:
    """The ``data.aug`` pipeline for one split, ending in mean/std normalization."""
    size, resize = int(cfg.get("image_size", 224)), int(cfg.get("resize_size", 256))
    aug = cfg.get("aug", "cbn")
    if aug not in AUGS:
        raise unknown_choice("data.aug", aug, AUGS)
    if size > resize:
        raise ConfigError(f"data.image_size={size} must not exceed data.resize_size={resize}")
    if aug == "cbn":
        steps = [v2.RandomResizedCrop(size)] if train else [v2.Resize(resize), v2.CenterCrop(size)]
    else:
        steps = [v2.Resize((resize, resize)), v2.RandomCrop(size) if train else v2.CenterCrop(size)]
    if train:
        steps.append(v2.RandomHorizontalFlip())
    return v2.Compose([*steps, v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])


def detect_format(root: Path, fmt: str) -> str:
    """``folder`` or ``archive`` for ``data.format`` (``auto`` looks at what is in ``root``)."""
    if fmt not in FORMATS:
        raise unknown_choice("data.format", fmt, FORMATS)
    if fmt != "auto":
        return fmt
    splits = [(root / split).is_dir() for split in SPLITS]
    if all(splits):
        return "folder"
    if any((root / name).is_file() for name in ARCHIVES):
        return "archive"
    if any(splits):
        return "folder"
    raise DataUnavailable(
        f"ImageNet was not found under {root}: expected {root}/train/<class>/<images> and "
        f"{root}/val/<class>/<images>, or the official archives {', '.join(ARCHIVES)} in {root}. "
        "ImageNet cannot be downloaded automatically; point data.root=DIR at a folder holding either, "
        "or use data=synthetic to run offline."
    )


def _folder_split(root: Path, split: str, transform: v2.Transform) -> ImageFolder:
    folder = root / split
    expected = f"expected {folder}/<class>/<images>"
    if not folder.is_dir():
        raise DataError(f"{folder} is not a folder; {expected} (data.format=folder)")
    if not any(p.is_dir() for p in folder.iterdir()):
        loose = any(p.suffix.lower() in IMG_EXTENSIONS for p in folder.iterdir())
        found = "images but no class folders" if loose else "no class folders"
        tip = " (scripts/prepare_imagenet.py sorts the official validation images)" if split == "val" else ""
        raise DataError(f"{folder} holds {found}; {expected}{tip}")
    try:
        return ImageFolder(str(folder), transform=transform)
    except FileNotFoundError as err:
        raise DataError(f"{folder}: {err}; {expected}") from err


def _folder_splits(root: Path, cfg: Mapping[str, Any]) -> tuple[ImageFolder, ImageFolder]:
    train = _folder_split(root, "train", imagenet_transform(cfg, train=True))
    val = _folder_split(root, "val", imagenet_transform(cfg, train=False))
    if train.classes != val.classes:
        only = sorted(set(train.classes) ^ set(val.classes))[:5]
        raise DataError(
            f"{root}/train has {len(train.classes)} class folders and {root}/val has {len(val.classes)}; "
            f"expected the same class folders in both (not in both: {', '.join(only)})"
        )
    return train, val


def _archive_splits(root: Path, cfg: Mapping[str, Any]) -> tuple[ImageNet, ImageNet]:
    try:
        return (
            ImageNet(str(root), "train", transform=imagenet_transform(cfg, train=True)),
            ImageNet(str(root), "val", transform=imagenet_transform(cfg, train=False)),
        )
    except ModuleNotFoundError as err:  # torchvision reads the devkit's meta.mat with scipy
        devkit = root / ARCHIVE_META["devkit"][0]
        raise DataError(f"reading {devkit} needs the {err.name} package (pip install {err.name})") from err
    except RuntimeError as err:  # torchvision's missing / corrupt archive message
        raise DataError(f"cannot use the ImageNet archives in {root} (data.format=archive): {err}") from err


def load_imagenet(cfg: Mapping[str, Any]) -> tuple[ImageFolder, ImageFolder]:
    """The train and val splits (with their transforms) from ``data.root``."""
    root = Path(str(cfg["root"])).expanduser()
    if detect_format(root, cfg.get("format", "auto")) == "folder":
        return _folder_splits(root, cfg)
    return _archive_splits(root, cfg)
