"""Data sets by ``data.name`` and the loaders the trainer iterates."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from torch.utils.data import Dataset

from bnexp.data.arrays import ArrayData, torch_datasets
from bnexp.data.cifar import cifar_files, load_cifar
from bnexp.data.digits import load_digits
from bnexp.data.files import DataFile, identify
from bnexp.data.imagenet import load_imagenet
from bnexp.data.mnist import load_mnist, mnist_files
from bnexp.data.npz import load_npz
from bnexp.data.synthetic import make_synthetic
from bnexp.models import DataSpec
from bnexp.support.registry import Registry


@dataclass
class DataBundle:
    """A data set ready for training: its splits, its shape, the raw arrays if any, and the
    images left out as unreadable (``data.check_images`` with ``data.bad_images=skip``)."""

    train: Dataset
    test: Dataset
    spec: DataSpec
    arrays: Optional[ArrayData] = None
    skipped_images: tuple[str, ...] = ()


def _from_arrays(load: Callable[[Mapping[str, Any]], ArrayData]) -> Callable[[Mapping[str, Any]], DataBundle]:
    def build(cfg: Mapping[str, Any]) -> DataBundle:
        arrays = load(cfg)
        if not cfg.get("standardize", True):  # pixels / 255 as they are: the one normalization with mean 0, std 1
            arrays.mean, arrays.std = (0.0,) * len(arrays.mean), (1.0,) * len(arrays.std)
        train, test = torch_datasets(arrays, cfg)
        return DataBundle(train, test, arrays.spec, arrays)

    return build


DATASETS: Registry[Callable[[Mapping[str, Any]], DataBundle]] = Registry("data set")
DATASETS.register("cifar10")(_from_arrays(load_cifar))
DATASETS.register("cifar100")(_from_arrays(load_cifar))
DATASETS.register("synthetic")(_from_arrays(make_synthetic))
DATASETS.register("mnist")(_from_arrays(load_mnist))
DATASETS.register("npz")(_from_arrays(load_npz))
DATASETS.register("digits")(_from_arrays(load_digits))


@DATASETS.register("imagenet")
def _imagenet(cfg: Mapping[str, Any]) -> DataBundle:
    """Image folders read lazily (no arrays); classes = class folders, 3 channels."""
    train, test = load_imagenet(cfg)
    spec = DataSpec(len(train.classes), 3, int(cfg.get("image_size", 224)))
    return DataBundle(train, test, spec, skipped_images=(*train.left_out, *test.left_out))


def build_data(cfg: Mapping[str, Any]) -> DataBundle:
    """Load ``data.name`` (from disk, downloaded when possible, or made in memory)."""
    return DATASETS.get(cfg["name"])(cfg)


def data_files(cfg: Mapping[str, Any]) -> tuple[DataFile, ...]:
    """The files a data set is read from: CIFAR's batches, MNIST's idx files, the npz file.
    None for data made in memory or shipped with a package (synthetic, digits), nor for an
    image folder tree (ImageNet's million files are too many to hash at every re-run)."""
    name = cfg["name"]
    if name in ("cifar10", "cifar100"):
        return cifar_files(cfg).files
    if name == "mnist":
        return mnist_files(cfg).files
    if name == "npz" and cfg.get("path"):
        return (DataFile(Path(str(cfg["path"])).expanduser()),)
    return ()


def data_identity(cfg: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """What identifies the content of a data set's files (:func:`bnexp.data.files.identify`),
    once it has been loaded (and so, with ``data.verify``, checked against its release)."""
    return identify(data_files(cfg), verified=bool(cfg.get("verify", True)))
