"""ImageNet decoded and augmented on the device (``data.decode=gpu``, bnexp/data/jpeg.py), run
here on the CPU with torchvision's CPU decoder standing in for nvJPEG, against the CPU path
(PIL in the workers); and the synthetic ImageNet-format tree (bnexp/data/make_imagenet.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from PIL import Image
from torchvision.datasets import ImageFolder
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from bnexp.data import build_data, jpeg
from bnexp.data.imagenet import STD, augment_steps, decode_on, imagenet_transform
from bnexp.data.jpeg import apply_params, draw_params, read_encoded
from bnexp.data.loaders import build_loaders
from bnexp.data.make_imagenet import ODD_KINDS, QUALITIES, SIZES, main, write_imagenet
from bnexp.support.errors import ConfigError, DataError
from tests.conftest import read_summary, run_cli, run_dir_of

# torchvision 0.29 deprecates its image decoders in favour of TorchCodec (docs/models_and_data.md)
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")
CPU = torch.device("cpu")
# PIL and torchvision's uint8 CPU resize each filter in two passes rounded to uint8 after each,
# so each is within 1 level of the exact filter output (0.5 per rounding; their fixed-point
# weights add far less), and they differ by at most 2 (docs/models_and_data.md has the measured share).
RESIZER_LEVELS = 2


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 classes x (4 training + 2 validation) ImageNet-sized JPEGs, plus the 3 odd files."""
    root = tmp_path_factory.mktemp("imagenet")
    write_imagenet(root)
    return root


def cfg_of(root: Path, **extra: object) -> dict:
    return {"name": "imagenet", "root": str(root), "num_workers": 0, "sampling": "shuffle", "pin_memory": False,
            "eval_batch_size": 4, **extra}


# ---------------------------------------------------------------- the synthetic tree


def test_make_imagenet_writes_real_jpegs_of_imagenet_sizes(tree: Path, tmp_path: Path) -> None:
    train, val = ImageFolder(str(tree / "train")), ImageFolder(str(tree / "val"))
    assert train.classes == val.classes == ["n01440764", "n01443537"]
    assert (len(train), len(val)) == (2 * 4 + len(ODD_KINDS), 2 * 2)
    odd = write_imagenet(tmp_path / "again").odd  # the same seed writes the same files
    kinds = {}
    for path, _ in train.samples + val.samples:
        assert path.endswith(".JPEG")
        with Image.open(path) as image:
            assert (image.width, image.height) in SIZES
            kinds[Path(path).name] = (image.format, image.mode)
        again = tmp_path / "again" / Path(path).relative_to(tree)
        assert again.read_bytes() == Path(path).read_bytes()
    assert [kinds[odd[kind].name] for kind in ODD_KINDS] == [("JPEG", "CMYK"), ("JPEG", "L"), ("PNG", "RGB")]
    assert sum(mode == ("JPEG", "RGB") for mode in kinds.values()) == 12


def test_make_imagenet_quality_is_imagenets(tree: Path) -> None:
    """Each RGB JPEG's luminance quantization table is PIL's at one of QUALITIES."""
    tables = {}
    for quality in QUALITIES:
        Image.new("RGB", (16, 16)).save(tree.parent / "q.jpg", quality=quality)
        with Image.open(tree.parent / "q.jpg") as probe:
            tables[tuple(probe.quantization[0])] = quality
    for path in (tree / "train").rglob("*.JPEG"):
        with Image.open(path) as image:
            if image.format == "JPEG" and image.mode == "RGB":
                assert tuple(image.quantization[0]) in tables


def test_make_imagenet_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main([str(tmp_path / "tree"), "--classes", "3", "--train-per-class", "1", "--val-per-class", "1"])
    assert "wrote 6 training and 3 validation images" in capsys.readouterr().out
    before = sorted(tmp_path.rglob("*"))
    for args in ([str(tmp_path / "tree")], [str(tmp_path / "other"), "--classes", "0"]):
        with pytest.raises(SystemExit) as stop:
            main(args)
        assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'tree' / 'train'} exists already" in err and "--classes=0 is not valid" in err
    assert sorted(tmp_path.rglob("*")) == before  # nothing written


# ---------------------------------------------------------------- geometry


@pytest.mark.parametrize("aug", ["cbn", "popnorm"])
@pytest.mark.parametrize("train", [True, False])
def test_device_steps_draw_and_crop_as_the_cpu_transform(aug: str, train: bool) -> None:
    """Same seed, same image: the parameters drawn from the size alone and applied to the
    tensor give torchvision's own pipeline output bit for bit (so the same crop boxes,
    flips and resized sizes), and leave the generator where the pipeline leaves it."""
    steps = augment_steps({"aug": aug, "image_size": 64, "resize_size": 72}, train)
    for shape in [(3, 375, 500), (3, 500, 333), (3, 80, 90)]:
        image = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        for seed in range(10):
            torch.manual_seed(seed)
            expected = v2.Compose(steps)(image)
            after = torch.get_rng_state()
            torch.manual_seed(seed)
            drawn = draw_params(steps, *shape[1:])
            assert torch.equal(torch.get_rng_state(), after)
            assert torch.equal(apply_params(steps, image, drawn), expected)


def test_flip_and_crop_are_drawn() -> None:
    """Over 40 seeds the training draws flip some images and not others, and crop different boxes."""
    steps = augment_steps({"aug": "cbn"}, train=True)
    drawn = []
    for seed in range(40):
        torch.manual_seed(seed)
        drawn.append(draw_params(steps, 375, 500))
    assert 5 < sum(d[1] is not None for d in drawn) < 35
    assert len({tuple(d[0].values()) for d in drawn}) == 40


def pil_path(path: str, cfg: dict, train: bool, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    with Image.open(path) as image:
        return imagenet_transform(cfg, train, normalized=False)(image.convert("RGB"))


def device_path(path: str, cfg: dict, train: bool, seed: int) -> torch.Tensor:
    encoded = read_encoded(path)
    steps = augment_steps(cfg, train)
    torch.manual_seed(seed)
    params = draw_params(steps, *encoded.size)
    image = decode_jpeg(encoded.data, mode=ImageReadMode.RGB) if encoded.jpeg else encoded.data
    return apply_params(steps, image, params)


@pytest.mark.parametrize("aug", ["cbn", "popnorm"])
def test_pixels_differ_by_the_resizers_only(tree: Path, aug: str) -> None:
    """ImageNet-sized JPEGs at 224: the device path (CPU decoder standing in) against PIL,
    same draws: the decoders (both libjpeg-turbo) agree exactly, the resizers within RESIZER_LEVELS."""
    cfg = {"aug": aug}
    paths = sorted(str(p) for p in tree.rglob("*.JPEG"))
    for i, path in enumerate(paths):
        encoded = read_encoded(path)
        if encoded.jpeg:
            with Image.open(path) as image:
                assert torch.equal(decode_jpeg(encoded.data, mode=ImageReadMode.RGB), F.pil_to_tensor(image))
        for train in (True, False):
            a, b = pil_path(path, cfg, train, i), device_path(path, cfg, train, i)
            assert a.shape == b.shape == (3, 224, 224) and a.dtype == b.dtype == torch.uint8
            assert (a.int() - b.int()).abs().max() <= RESIZER_LEVELS


# ---------------------------------------------------------------- the loaders


def uint8_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference of two normalized batches, in levels of the uint8 images."""
    return float(((a - b) * 255 * torch.tensor(STD).view(1, 3, 1, 1)).abs().max())


@pytest.mark.parametrize(("aug", "workers"), [("cbn", 0), ("popnorm", 0), ("cbn", 2)])
def test_gpu_path_serves_the_cpu_paths_batches(tree: Path, aug: str, workers: int) -> None:
    """The same images, labels, crops and flips batch for batch, two epochs and the
    evaluation; the odd files (CMYK, greyscale, PNG) among them, decoded by PIL in both."""
    extra = dict(aug=aug, num_workers=workers, image_size=64, resize_size=72)
    streams = {}
    for decode in ("cpu", "gpu"):
        cfg = cfg_of(tree, decode=decode, **extra)
        loaders = build_loaders(build_data(cfg), cfg, 4, 0, False, CPU)
        torch.manual_seed(0)  # workers=0: the augmentation draws from the global generator
        epochs = loaders.epochs_from(0)
        streams[decode] = ([loaders.to_device(*next(epochs)) for _ in range(2 * loaders.steps_per_epoch)],
                           list(loaders.test))
    (train_a, test_a), (train_b, test_b) = streams["cpu"], streams["gpu"]
    assert len(train_a) == len(train_b) == 6 and len(test_a) == len(test_b) == 1
    for (xa, ya), (xb, yb) in zip(train_a + test_a, train_b + test_b):
        assert xa.dtype == xb.dtype == torch.float32 and xa.shape == xb.shape
        assert torch.equal(ya, yb) and uint8_difference(xa, xb) <= RESIZER_LEVELS + 1e-3


def test_cmyk_greyscale_and_png_go_to_pil(tree: Path) -> None:
    odd = {kind: next(tree.rglob(name)) for kind, name in
           zip(ODD_KINDS, ["n01440764_5.JPEG", "n01440764_6.JPEG", "n01440764_7.JPEG"])}
    for kind, path in odd.items():
        encoded = read_encoded(str(path))
        assert not encoded.jpeg and encoded.data.shape == (3, *encoded.size), kind
        with Image.open(path) as image:
            assert torch.equal(encoded.data, F.pil_to_tensor(image.convert("RGB")))
    assert read_encoded(str(tree / "val" / "n01440764" / "ILSVRC2012_val_00000001.JPEG")).jpeg


@pytest.fixture
def truncated(tmp_path: Path) -> Path:
    """A tree whose first training JPEG ends 200 bytes into its image data: PIL opens its
    header, and neither decoder reads its pixels."""
    write_imagenet(tmp_path / "imagenet", train_per_class=2, val_per_class=1)
    path = tmp_path / "imagenet" / "train" / "n01440764" / "n01440764_1.JPEG"
    data = path.read_bytes()
    path.write_bytes(data[: data.index(b"\xff\xda") + 200])
    return path


def first_batch(root: Path, **extra: object) -> tuple[torch.Tensor, torch.Tensor]:
    """The first 6 training images, in order, as one batch on the device (data.decode=gpu)."""
    cfg = cfg_of(root, decode="gpu", image_size=32, resize_size=36, **extra)
    feed = build_data(cfg).feed(CPU)
    torch.manual_seed(0)
    return feed.train_to_device(*feed.collate([feed.train[i] for i in range(6)]))


def test_unreadable_on_the_device_fails_naming_it(truncated: Path) -> None:
    with pytest.raises(DataError, match=f"unreadable image {truncated}: OSError: image file is truncated"):
        first_batch(truncated.parents[2])


def test_unreadable_on_the_device_skipped(truncated: Path, caplog: pytest.LogCaptureFixture) -> None:
    """data.bad_images=skip: the batch's next readable image stands in for it, with its label."""
    with caplog.at_level(logging.WARNING):
        x, y = first_batch(truncated.parents[2], bad_images="skip")
    assert torch.equal(x[0], x[1]) and not torch.equal(x[1], x[2]) and y[0] == y[1]
    assert f"unreadable image {truncated}" in caplog.text and "serving the next readable image" in caplog.text


def test_a_batch_the_decoder_rejects_is_decoded_image_by_image(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoder that rejects any batch holding one image, and that image alone: the batch
    comes out as before, that image from PIL."""
    expected = first_batch(tree)
    real, refused = decode_jpeg, read_encoded(str(tree / "train" / "n01440764" / "n01440764_2.JPEG")).data
    calls = []

    def picky(data, **kw):
        calls.append(len(data) if isinstance(data, list) else 1)
        if any(torch.equal(d, refused) for d in (data if isinstance(data, list) else [data])):
            raise RuntimeError("refused")
        return real(data, **kw)

    monkeypatch.setattr(jpeg, "decode_jpeg", picky)
    x, y = first_batch(tree)
    assert torch.equal(x, expected[0]) and torch.equal(y, expected[1])
    assert calls[0] > 1 and calls[1:] == [1] * calls[0]


def test_decode_choice(tree: Path) -> None:
    assert [decode_on({}, torch.device(d)) for d in ("cuda", "cpu")] == ["gpu", "cpu"]
    assert decode_on({"decode": "gpu"}, CPU) == "gpu" and decode_on({"decode": "cpu"}, torch.device("cuda")) == "cpu"
    with pytest.raises(ConfigError, match="unknown data.decode 'nvjpeg'; valid choices: auto, cpu, gpu"):
        build_loaders(build_data(cfg_of(tree, decode="nvjpeg")), cfg_of(tree, decode="nvjpeg"), 4, 0, False, CPU)


def test_cli_trains_with_decode_gpu(tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(["train", "data=imagenet", f"data.root={tree}", "data.decode=gpu", "data.image_size=32",
                         "data.resize_size=36", "data.num_workers=1", "model.width=4", "trainer.batch_size=4",
                         "trainer.max_steps=2", "trainer.device=cpu", *run_dir_of(tmp_path)], capsys)
    assert code == 0, out
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "completed" and summary["config"]["data"]["decode"] == "gpu"
