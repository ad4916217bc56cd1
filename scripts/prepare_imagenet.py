"""Unpack the official ILSVRC-2012 archives into the folders ``data=imagenet`` reads.

Usage::

    python scripts/prepare_imagenet.py ROOT [--train]

``ROOT`` must hold ``ILSVRC2012_devkit_t12.tar.gz`` and ``ILSVRC2012_img_val.tar`` (and,
with ``--train``, ``ILSVRC2012_img_train.tar``). The script writes ``ROOT/val/<wnid>/``
(the devkit's ground truth sorts the 50,000 validation images into their 1,000 class
folders) and, with ``--train``, ``ROOT/train/<wnid>/``. It uses torchvision's own
ImageNet helpers, which check each archive's md5 first; reading the devkit needs scipy
(``pip install scipy``). Splits whose folder already exists are left alone. Afterwards::

    bnexp train data=imagenet data.root=ROOT data.format=folder ...
"""

from __future__ import annotations

import argparse
from pathlib import Path

from torchvision.datasets.imagenet import META_FILE, parse_devkit_archive, parse_train_archive, parse_val_archive


def prepare(root: Path, train: bool) -> None:
    """Build ``root/val/<wnid>/`` (and ``root/train/<wnid>/``) from the archives in ``root``."""
    if not (root / META_FILE).is_file():
        parse_devkit_archive(str(root))  # writes meta.bin: class names and validation labels
    if not (root / "val").is_dir():
        parse_val_archive(str(root))
    if train and not (root / "train").is_dir():
        parse_train_archive(str(root))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="folder holding the official ILSVRC2012 archives")
    parser.add_argument("--train", action="store_true", help="also unpack the training archive (about 140 GB)")
    args = parser.parse_args()
    prepare(args.root.expanduser(), args.train)
    print(f"ImageNet folders ready under {args.root}")


if __name__ == "__main__":
    main()
