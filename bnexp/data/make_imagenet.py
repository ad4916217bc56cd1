"""``python -m bnexp.data.make_imagenet DIR``: a small ImageNet-format tree of real JPEG files.

It writes ``DIR/train/<wnid>/<wnid>_<n>.JPEG`` and ``DIR/val/<wnid>/ILSVRC2012_val_<n>.JPEG``
(the layout ``data=imagenet data.format=folder`` reads) for the first ILSVRC-2012 class ids.
Each image is a random region of one of scikit-learn's two bundled photographs (``china.jpg``
and ``flower.jpg``, 640 x 427), scaled to a size ILSVRC-2012 images typically have (mostly
500 x 375 or 375 x 500, some 500 x 333, 500 x 500, 640 x 480 ...) and saved by PIL at a JPEG
quality of 75 to 95 with 4:2:0 chroma subsampling, one of them progressive. The first
class's training folder also holds the three kinds of file in ILSVRC-2012 that nvJPEG does
not decode as RGB JPEGs (:data:`ODD_KINDS`): a CMYK JPEG, a greyscale JPEG and a PNG file
named ``.JPEG``. Everything follows from ``--seed``: the same tree every time.

The tests use it at a few images per class (about 60 kB each); the GPU check at a few
hundred (``bnexp bench imagenet``).
"""

from __future__ import annotations

import argparse
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
from PIL import Image

from bnexp.support.errors import ConfigError
from bnexp.support.options import exit_on_error

# The first ILSVRC-2012 class ids in sorted order (tench, goldfish, great white shark, ...).
WNIDS = ("n01440764", "n01443537", "n01484850", "n01491361", "n01494475",
         "n01496331", "n01498041", "n01514668", "n01514859", "n01518878")
# (width, height) and how often each appears: ILSVRC-2012 is dominated by 500 x 375 and
# 375 x 500, then 500 x 333 / 333 x 500; squares and larger photographs are rarer.
SIZES = ((500, 375), (375, 500), (500, 333), (333, 500), (500, 500), (640, 480), (400, 300), (800, 600))
SIZE_WEIGHTS = (0.35, 0.2, 0.15, 0.1, 0.08, 0.05, 0.04, 0.03)
QUALITIES = (75, 85, 90, 95)
ODD_KINDS = ("cmyk", "greyscale", "png")  # what nvJPEG cannot decode as an RGB JPEG, one file each


@dataclass(frozen=True)
class ImageNetTree:
    """What :func:`write_imagenet` wrote: its root, the odd files by kind, and the counts."""

    root: Path
    odd: dict[str, Path]
    train_images: int
    val_images: int


def wnids(classes: int) -> list[str]:
    """``classes`` class ids: ILSVRC-2012's first ones, then made-up ids of the same form."""
    return [*WNIDS, *(f"n9{k:07d}" for k in range(len(WNIDS), classes))][:classes]


def photograph(photos: Sequence[np.ndarray], rng: np.random.Generator) -> Image.Image:
    """A random region (a third to all of the height, any aspect from 3/4 to 4/3) of a
    random bundled photograph, scaled to a typical ILSVRC-2012 size."""
    width, height = SIZES[rng.choice(len(SIZES), p=SIZE_WEIGHTS)]
    photo = photos[rng.integers(len(photos))]
    rows, cols = photo.shape[:2]
    h = int(rows * rng.uniform(1 / 3, 1))
    w = min(cols, int(h * width / height * rng.uniform(3 / 4, 4 / 3)))
    top, left = rng.integers(rows - h + 1), rng.integers(cols - w + 1)
    region = Image.fromarray(photo[top: top + h, left: left + w])
    return region.resize((width, height), Image.Resampling.BICUBIC)


def jpeg_bytes(image: Image.Image, quality: int, progressive: bool = False) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality, subsampling="4:2:0", progressive=progressive)
    return buffer.getvalue()


def odd_file(kind: str, image: Image.Image) -> bytes:
    """``image`` as one of :data:`ODD_KINDS`."""
    if kind == "png":
        buffer = io.BytesIO()
        image.save(buffer, "PNG")
        return buffer.getvalue()
    return jpeg_bytes(image.convert("CMYK" if kind == "cmyk" else "L"), quality=90)


def check_counts(classes: int, train: int, val: int) -> None:
    for name, value in (("classes", classes), ("train-per-class", train), ("val-per-class", val)):
        if value < 1:
            raise ConfigError(f"--{name}={value} is not valid: it must be at least 1")


def write_imagenet(root: Path, classes: int = 2, train_per_class: int = 4, val_per_class: int = 2,
                   seed: int = 0) -> ImageNetTree:
    """Write the tree under ``root`` (which must not hold ``train/`` or ``val/`` yet)."""
    from sklearn.datasets import load_sample_images

    check_counts(classes, train_per_class, val_per_class)
    taken = [root / split for split in ("train", "val") if (root / split).exists()]
    if taken:
        raise ConfigError(f"{taken[0]} exists already; make_imagenet writes a new tree: choose an empty or new folder")
    photos = load_sample_images().images
    rng = np.random.default_rng(seed)
    odd: dict[str, Path] = {}
    val_number = 0
    for c, wnid in enumerate(wnids(classes)):
        for split, count in (("train", train_per_class), ("val", val_per_class)):
            folder = root / split / wnid
            folder.mkdir(parents=True)
            for n in range(count):
                val_number += split == "val"
                name = f"{wnid}_{n + 1}.JPEG" if split == "train" else f"ILSVRC2012_val_{val_number:08d}.JPEG"
                progressive = (c, split, n) == (0, "train", 0)
                (folder / name).write_bytes(jpeg_bytes(photograph(photos, rng), int(rng.choice(QUALITIES)), progressive))
            if (c, split) == (0, "train"):
                for k, kind in enumerate(ODD_KINDS):
                    odd[kind] = folder / f"{wnid}_{count + k + 1}.JPEG"
                    odd[kind].write_bytes(odd_file(kind, photograph(photos, rng)))
    return ImageNetTree(root, odd, classes * train_per_class + len(ODD_KINDS), classes * val_per_class)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bnexp.data.make_imagenet",
                                     description="Write a small ImageNet-format tree of real JPEG files.")
    parser.add_argument("root", type=Path, help="the folder to write train/ and val/ into")
    parser.add_argument("--classes", type=int, default=2)
    parser.add_argument("--train-per-class", type=int, default=4)
    parser.add_argument("--val-per-class", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    def write() -> None:
        tree = write_imagenet(args.root, args.classes, args.train_per_class, args.val_per_class, args.seed)
        print(f"wrote {tree.train_images} training and {tree.val_images} validation images under {tree.root} "
              f"(odd files: {', '.join(f'{kind} {path.name}' for kind, path in tree.odd.items())})")

    exit_on_error(write)


if __name__ == "__main__":
    main()
