"""Batches of JPEG files decoded and augmented on the training device (``data.decode=gpu``).

The work is split in two halves that together do what the CPU path's worker does with PIL:

- **In a DataLoader worker** (:func:`read_encoded`, :class:`DrawAugmentation`,
  :func:`collate_encoded`): read the file's bytes, open its header with PIL (which also
  tells a file that PIL cannot open, so ``data.bad_images`` applies as on the CPU path), and
  draw the image's augmentation from the worker's generator, each step's parameters drawn
  by the step's own ``make_params`` exactly as its ``forward`` draws them on the CPU path
  (:func:`draw_params`). A JPEG that PIL reads as RGB (YCbCr, baseline or progressive) is
  left encoded; anything else (a CMYK or greyscale JPEG, a PNG named ``.JPEG``) is decoded
  there by PIL, as the CPU path decodes it. A batch's bytes travel as one tensor.
- **On the device** (:class:`JpegBatches`): decode the batch's JPEGs in one call of
  ``torchvision.io.decode_jpeg`` (nvJPEG on CUDA; libjpeg-turbo on the CPU, the stand-in
  that runs this path without a GPU), apply each step's ``transform`` with the drawn
  parameters to each uint8 image, stack, and normalize (:func:`bnexp.data.transfer.normalize`).

Crop boxes, flips and resized sizes are therefore the CPU path's for the same draws; pixel
values differ only by the decoder and the resizer (docs/models_and_data.md has the figures).
A batch the device decoder rejects is decoded again image by image; an image it rejects alone
goes to PIL, and one that PIL cannot decode either is reported through ``unreadable`` (which
raises under ``data.bad_images=fail``); under ``skip`` the batch's next readable image is
served in its place, with its label.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from PIL import Image
from torch import Tensor
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from bnexp.data.transfer import Batch, Normalized
from bnexp.support.errors import DataError
from bnexp.support.untrusted import open_regular

MAX_IMAGE_FILE = 2**28  # bytes of one image file: ImageNet's largest JPEG is 15 MB

Params = list[Optional[dict[str, Any]]]  # per step: its drawn parameters, None for a random step not applied


@dataclass
class Encoded:
    """One image as a worker hands it over: ``data`` is the file's bytes (1-D uint8) when
    ``jpeg`` (for the device's decoder), else the image as PIL decoded it (3 x H x W uint8);
    ``size`` is (height, width); ``params`` its drawn augmentation."""

    path: str
    data: Tensor
    jpeg: bool
    size: tuple[int, int]
    params: Params = field(default_factory=list)


def read_encoded(path: str) -> Encoded:
    """The file at ``path`` as :class:`Encoded`: PIL opens its header (raising for a file it
    cannot open) and decodes it only when it is not an RGB JPEG. Only a regular file of an
    image's size is read (:func:`bnexp.support.untrusted.open_regular`)."""
    with open_regular(path, MAX_IMAGE_FILE) as f:
        data = f.read()
    with Image.open(io.BytesIO(data)) as image:
        if image.format == "JPEG" and image.mode == "RGB":
            return Encoded(path, torch.frombuffer(bytearray(data), dtype=torch.uint8), True, (image.height, image.width))
        rgb = image.convert("RGB")  # as torchvision's ImageFolder loader does
    return Encoded(path, F.pil_to_tensor(rgb), False, (rgb.height, rgb.width))


def draw_params(steps: Sequence[v2.Transform], height: int, width: int) -> Params:
    """The parameters of ``steps`` for an image of this size, drawn from the global generator
    as ``v2.Compose(steps)`` draws them: an empty image of the right size stands in for the
    pixels, each step's ``make_params`` draws and its ``transform`` gives the next size."""
    stand_in = torch.empty(0, height, width, dtype=torch.uint8)
    drawn: Params = []
    for step in steps:
        if isinstance(step, v2.RandomHorizontalFlip) and torch.rand(1) >= step.p:  # its forward's own test
            drawn.append(None)
            continue
        params = step.make_params([stand_in])
        stand_in = step.transform(stand_in, params)
        drawn.append(params)
    return drawn


def apply_params(steps: Sequence[v2.Transform], image: Tensor, params: Params) -> Tensor:
    """``image`` through ``steps`` with the parameters :func:`draw_params` drew."""
    for step, drawn in zip(steps, params):
        if drawn is not None:
            image = step.transform(image, drawn)
    return image


class DrawAugmentation:
    """The worker's half of the augmentation: an :class:`Encoded` image's parameters drawn."""

    def __init__(self, steps: Sequence[v2.Transform]) -> None:
        self.steps = list(steps)

    def __call__(self, image: Encoded) -> Encoded:
        image.params = draw_params(self.steps, *image.size)
        return image


@dataclass
class EncodedBatch:
    """A batch of :class:`Encoded` images, the JPEGs' bytes joined into one tensor (a batch
    crosses from its worker as a few tensors, not one per image)."""

    paths: list[str]
    jpeg_bytes: Tensor  # the JPEG files' bytes, in batch order, concatenated
    lengths: list[int]  # per image: its bytes' length in jpeg_bytes (0: decoded by PIL)
    decoded: list[Optional[Tensor]]  # per image: PIL's decoding, or None for a JPEG
    params: list[Params]

    def pin_memory(self) -> EncodedBatch:
        """As it is: the device decoder reads the bytes from the host itself."""
        return self

    def jpegs(self) -> list[Tensor]:
        """Each JPEG file's bytes, in batch order."""
        sizes = [n for n in self.lengths if n]
        return list(self.jpeg_bytes.split(sizes)) if sizes else []


def collate_encoded(samples: list[tuple[Encoded, int]]) -> tuple[EncodedBatch, Tensor]:
    """The DataLoader's ``collate_fn`` for :class:`Encoded` images and their labels."""
    images = [image for image, _ in samples]
    jpegs = [image.data for image in images if image.jpeg]
    batch = EncodedBatch([image.path for image in images],
                         torch.cat(jpegs) if jpegs else torch.empty(0, dtype=torch.uint8),
                         [len(image.data) if image.jpeg else 0 for image in images],
                         [None if image.jpeg else image.data for image in images],
                         [image.params for image in images])
    return batch, torch.tensor([label for _, label in samples])


def decode_with_pil(data: Tensor) -> Tensor:
    """A file's bytes decoded by PIL, as RGB (3 x H x W uint8)."""
    with Image.open(io.BytesIO(data.numpy().tobytes())) as image:
        return F.pil_to_tensor(image.convert("RGB"))


def next_readable(images: Sequence[Optional[Tensor]]) -> list[int]:
    """For each position, itself when its image is there, else the next position (wrapping
    around) whose image is."""
    there = [i for i, image in enumerate(images) if image is not None]
    if not there:
        raise DataError(f"no image of a batch of {len(images)} is readable (data.bad_images=skip)")
    return [i if images[i] is not None else next((j for j in there if j > i), there[0]) for i in range(len(images))]


class JpegBatches:
    """The device's half: an :class:`EncodedBatch` and its labels as normalized images and
    labels on ``device``, augmented by ``steps`` with the drawn parameters.

    ``unreadable(path, error)`` is told of an image neither decoder reads; it raises to stop
    (``data.bad_images=fail``) or returns to go on without the image.
    """

    def __init__(self, steps: Sequence[v2.Transform], mean: Sequence[float], std: Sequence[float],
                 device: torch.device, unreadable: Callable[[str, Exception], None]) -> None:
        self.steps = list(steps)
        self.normalized = Normalized(mean, std, device)
        self.device = device
        self.unreadable = unreadable

    def __call__(self, batch: EncodedBatch, labels: Tensor) -> Batch:
        decoded = self.decode(batch)
        images = [None if image is None else apply_params(self.steps, image, params)
                  for image, params in zip(decoded, batch.params)]
        source = next_readable(images)
        if source != list(range(len(images))):  # an image left out: another one and its label in its place
            images, labels = [images[i] for i in source], labels[source]
        return self.normalized(torch.stack(images), labels)

    def decode(self, batch: EncodedBatch) -> list[Optional[Tensor]]:
        """Each image of ``batch`` on the device (None: unreadable and reported)."""
        jpegs = batch.jpegs()
        try:
            on_device = decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=self.device) if jpegs else []
        except RuntimeError:  # some image the decoder rejects: find which, one by one
            paths = [path for path, n in zip(batch.paths, batch.lengths) if n]
            on_device = [self.decode_one(data, path) for data, path in zip(jpegs, paths)]
        found = iter(on_device)
        return [next(found) if image is None else image.to(self.device, non_blocking=True) for image in batch.decoded]

    def decode_one(self, data: Tensor, path: str) -> Optional[Tensor]:
        """One JPEG by the device decoder, else by PIL, else None (reported as unreadable)."""
        try:
            return decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device)
        except RuntimeError:
            pass
        try:
            return decode_with_pil(data).to(self.device)
        except Exception as err:
            self.unreadable(path, err)
            return None
