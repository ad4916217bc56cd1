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

``data.bad_images`` says what an image PIL cannot read does: ``fail`` (default) stops the
run with a DataError naming the file; ``skip`` logs a warning naming it and serves the next
readable image of the split in its place. ``data.check_images=true`` opens every image's
header once before training (threads: ``data.num_workers``), so that ``fail`` lists the
unreadable ones up front and ``skip`` leaves them out of the split and counts them
(:attr:`CheckedImages.left_out`); images that pass the header check but fail to decode
later are still handled per sample.

``data.decode`` says where a DataLoader's images are decoded and augmented: ``cpu`` in the
workers with PIL (as above, then the uint8 batch is normalized on the training device);
``gpu`` on the training device (:mod:`bnexp.data.jpeg`: the workers read bytes and draw the
augmentation, the device decodes, crops, resizes, flips and normalizes; on a CPU device
torchvision's CPU decoder stands in for nvJPEG); ``auto`` (default) is ``gpu`` when training
on CUDA, else ``cpu``. The data set's own splits (what probes and ``bnexp eval`` read) always
decode with PIL.
"""

from __future__ import annotations

import copy
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Collection, Mapping, Optional

import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.datasets import ImageFolder, ImageNet
from torchvision.datasets.folder import IMG_EXTENSIONS
from torchvision.datasets.imagenet import ARCHIVE_META
from torchvision.transforms import v2

from bnexp.data.jpeg import MAX_IMAGE_FILE, DrawAugmentation, JpegBatches, collate_encoded, read_encoded
from bnexp.data.transfer import Feed, Normalized
from bnexp.support.errors import ConfigError, DataError, DataUnavailable, unknown_choice
from bnexp.support.untrusted import open_regular

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
FORMATS = ("auto", "folder", "archive")
AUGS = ("cbn", "popnorm")
SPLITS = ("train", "val")
ARCHIVES = tuple(name for name, _ in ARCHIVE_META.values())
BAD_IMAGES = ("fail", "skip")
DECODES = ("auto", "gpu", "cpu")
LISTED = 5  # unreadable images named in one message

log = logging.getLogger(__name__)


def report_unreadable(path: str, err: Exception, skip: bool) -> None:
    """``data.bad_images`` for the image at ``path`` that failed with ``err``: a DataError
    naming it (``fail``), or a warning (``skip``: the caller serves another image)."""
    why = f"unreadable image {path}: {type(err).__name__}: {err}"
    if not skip:
        raise DataError(f"{why}. Replace or delete it, or set data.bad_images=skip to go on without it") from err
    log.warning("%s; serving the next readable image instead (data.bad_images=skip)", why)


class CheckedImages(Dataset):
    """One split of an ImageFolder, minus the images ``left_out``: each image's file read by
    ``load`` (PIL by default), then passed through ``transform``. ``data.bad_images`` applies to
    any image that fails to load: ``fail`` raises a DataError naming it; ``skip`` warns and
    serves the next readable image in index order (so the substitute is the same in every
    run)."""

    def __init__(self, images: ImageFolder, skip: bool, transform: Callable[[Any], Any],
                 left_out: Collection[str] = ()) -> None:
        self.images, self.skip, self.transform = images, skip, transform
        self.load: Callable[[str], Any] = read_image
        self.classes = images.classes
        self.left_out = sorted(left_out)
        self.samples = [sample for sample in images.samples if sample[0] not in left_out]
        self.unreadable: set[int] = set()  # indices this process failed to load (skip)

    def view(self, load: Callable[[str], Any], transform: Callable[[Any], Any]) -> CheckedImages:
        """The same images (and left-out ones) read by ``load`` and passed through ``transform``."""
        other = copy.copy(self)
        other.load, other.transform, other.unreadable = load, transform, set()
        return other

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        if not 0 <= index < len(self):  # ends iteration; the search below wraps around
            raise IndexError(f"index {index} is out of range for {len(self)} images")
        for step in range(len(self)):
            i = (index + step) % len(self)
            if i in self.unreadable:
                continue
            path, target = self.samples[i]
            try:
                image = self.load(path)
            except Exception as err:
                report_unreadable(path, err, self.skip)
                self.unreadable.add(i)
                continue
            return self.transform(image), target
        raise DataError(f"no image under {self.images.root} is readable (data.bad_images=skip)")


def read_image(path: str) -> Image.Image:
    """An image file as RGB, as torchvision's loader reads it, if it is a regular file of an
    image's size (torchvision's loader waits forever on a FIFO)."""
    with open_regular(path, MAX_IMAGE_FILE) as f, Image.open(f) as image:
        return image.convert("RGB")


def _header_problem(path: str) -> Optional[str]:
    """Why PIL cannot open the image at ``path`` (its header, not its pixels), or None."""
    try:
        with open_regular(path, MAX_IMAGE_FILE) as f, Image.open(f) as image:
            image.verify()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def unreadable_images(images: ImageFolder, threads: int) -> dict[str, str]:
    """Each image of ``images`` whose header PIL cannot open, with the reason."""
    paths = [path for path, _ in images.samples]
    with ThreadPoolExecutor(max(1, threads)) as pool:
        problems = pool.map(_header_problem, paths)
    return {path: why for path, why in zip(paths, problems) if why is not None}


def _listed(bad: Mapping[str, str]) -> str:
    named = "; ".join(f"{path} ({why})" for path, why in list(bad.items())[:LISTED])
    return named + (f"; and {len(bad) - LISTED} more" if len(bad) > LISTED else "")


def _checked(images: ImageFolder, skip: bool, cfg: Mapping[str, Any], transform: v2.Transform) -> CheckedImages:
    """``images`` wrapped per ``data.bad_images`` with the split's ``transform``, scanned first
    with ``data.check_images``."""
    bad = unreadable_images(images, int(cfg.get("num_workers", 0))) if cfg.get("check_images", False) else {}
    where = f"{len(bad)} of {len(images.samples)} images under {images.root}"
    if bad and not skip:
        raise DataError(f"{where} are unreadable: {_listed(bad)}. Replace or delete them, "
                        "or set data.bad_images=skip to leave them out")
    if bad:
        log.warning("left out %s as unreadable (data.bad_images=skip): %s", where, _listed(bad))
    return CheckedImages(images, skip, transform, bad)


def augment_steps(cfg: Mapping[str, Any], train: bool) -> list[v2.Transform]:
    """The ``data.aug`` crops, resizes and flip of one split."""
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
    return steps


def imagenet_transform(cfg: Mapping[str, Any], train: bool, normalized: bool = True) -> v2.Transform:
    """A PIL image through the ``data.aug`` pipeline of one split to a uint8 tensor, then
    mean/std normalization (unless ``normalized`` is false)."""
    scaled = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)] if normalized else []
    return v2.Compose([*augment_steps(cfg, train), v2.ToImage(), *scaled])


def decode_on(cfg: Mapping[str, Any], device: torch.device) -> str:
    """``data.decode`` resolved for a run on ``device``: ``gpu`` or ``cpu``."""
    decode = cfg.get("decode", "auto")
    if decode not in DECODES:
        raise unknown_choice("data.decode", decode, DECODES)
    if decode == "auto":
        return "gpu" if device.type == "cuda" else "cpu"
    return decode


def imagenet_feed(train: CheckedImages, test: CheckedImages, cfg: Mapping[str, Any], device: torch.device) -> Feed:
    """What the DataLoaders of a run on ``device`` read (``data.decode``): uint8 images that
    PIL decoded and augmented, or encoded images for :class:`bnexp.data.jpeg.JpegBatches`."""
    if decode_on(cfg, device) == "cpu":
        to_device = Normalized(MEAN, STD, device)
        return Feed(train.view(train.load, imagenet_transform(cfg, True, normalized=False)),
                    test.view(test.load, imagenet_transform(cfg, False, normalized=False)), to_device, to_device)
    unreadable = functools.partial(report_unreadable, skip=train.skip)
    train_steps, val_steps = augment_steps(cfg, train=True), augment_steps(cfg, train=False)
    return Feed(train.view(read_encoded, DrawAugmentation(train_steps)),
                test.view(read_encoded, DrawAugmentation(val_steps)),
                JpegBatches(train_steps, MEAN, STD, device, unreadable),
                JpegBatches(val_steps, MEAN, STD, device, unreadable), collate_encoded)


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


def _folder_split(root: Path, split: str) -> ImageFolder:
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
        return ImageFolder(str(folder))
    except FileNotFoundError as err:
        raise DataError(f"{folder}: {err}; {expected}") from err


def _folder_splits(root: Path) -> tuple[ImageFolder, ImageFolder]:
    train, val = _folder_split(root, "train"), _folder_split(root, "val")
    if train.classes != val.classes:
        only = sorted(set(train.classes) ^ set(val.classes))[:5]
        raise DataError(
            f"{root}/train has {len(train.classes)} class folders and {root}/val has {len(val.classes)}; "
            f"expected the same class folders in both (not in both: {', '.join(only)})"
        )
    return train, val


def _archive_splits(root: Path) -> tuple[ImageNet, ImageNet]:
    try:
        return ImageNet(str(root), "train"), ImageNet(str(root), "val")
    except ModuleNotFoundError as err:  # torchvision reads the devkit's meta.mat with scipy
        devkit = root / ARCHIVE_META["devkit"][0]
        raise DataError(f"reading {devkit} needs the {err.name} package (pip install {err.name})") from err
    except RuntimeError as err:  # torchvision's missing / corrupt archive message
        raise DataError(f"cannot use the ImageNet archives in {root} (data.format=archive): {err}") from err


def load_imagenet(cfg: Mapping[str, Any]) -> tuple[CheckedImages, CheckedImages]:
    """The train and val splits (with their transforms) from ``data.root``."""
    mode = cfg.get("bad_images", "fail")
    if mode not in BAD_IMAGES:
        raise unknown_choice("data.bad_images", mode, BAD_IMAGES)
    transforms = imagenet_transform(cfg, train=True), imagenet_transform(cfg, train=False)
    root = Path(str(cfg["root"])).expanduser()
    folder = detect_format(root, cfg.get("format", "auto")) == "folder"
    train, val = _folder_splits(root) if folder else _archive_splits(root)
    return _checked(train, mode == "skip", cfg, transforms[0]), _checked(val, mode == "skip", cfg, transforms[1])
