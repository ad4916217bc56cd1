"""Bad input (docs/resilience.md): each bad file, key or image is named in one DataError."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from bnexp.data import build_data
from bnexp.data.cifar import load_cifar
from bnexp.support.errors import ConfigError, DataError
from tests.conftest import read_summary, run_cli, run_dir_of, write_cifar10
from tests.test_data_sets import imagenet_cfg, mnist_cfg, npz_arrays, write_idx, write_image_folders, write_mnist

# ---------------------------------------------------------------- CIFAR


def cifar_cfg(root: Path, **extra) -> dict:
    return {"name": "cifar10", "root": str(root), "download": False, "verify": False, **extra}


def rewrite_batch(path: Path, **entry) -> None:
    """Replace keys of one pickled CIFAR batch."""
    with open(path, "rb") as f:
        old = pickle.load(f)
    with open(path, "wb") as f:
        pickle.dump({**old, **entry}, f)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"data": np.zeros((20, 3000), np.uint8)}, "'data' is uint8 of shape \\(20, 3000\\); expected uint8 N x 3072"),
        ({"labels": [0] * 19}, "'labels' holds 19 int64 values for 20 images; expected one integer label per image"),
        ({"labels": [12] * 20}, "holds the label 12 but CIFAR-10 has 10 classes; expected labels 0..9"),
        ({"labels": [-1] * 20}, "holds the label -1; expected class labels from 0"),
    ],
)
def test_cifar_bad_batch_is_named(tmp_path: Path, entry: dict, message: str) -> None:
    path = write_cifar10(tmp_path) / "data_batch_2"
    rewrite_batch(path, **entry)
    with pytest.raises(DataError, match=message) as err:
        build_data(cifar_cfg(tmp_path))
    assert str(path) in str(err.value)


class RunsCode:
    """Unpickled in full, this calls ``exec``, as a hostile data file would: it writes ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def test_cifar_batch_that_would_run_code_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A hand-made CIFAR folder read with data.verify=false (as the docs say to) whose
    data_batch_1 calls exec when unpickled in full: one line naming the file, exit 2, nothing
    run and no run folder written."""
    monkeypatch.chdir(tmp_path)
    path = write_cifar10(Path("data")) / "data_batch_1"
    marker = tmp_path / "marker"
    rewrite_batch(path, labels=RunsCode(marker))
    code, out = run_cli(["train", "data=cifar10", "data.root=data", "data.download=false", "data.verify=false",
                         "model.width=4", "trainer.batch_size=25", "trainer.max_steps=2", "trainer.device=cpu"],
                        capsys)
    assert not marker.exists(), "the data file's code ran"
    assert code == 2 and "Traceback" not in out, out
    lines = [line for line in out.splitlines() if line.startswith("bnexp: error:")]
    assert lines == [f"bnexp: error: refused data file {path}: unpickling it needs builtins.exec, which a "
                     "CIFAR batch never holds (only dicts, lists, strings and numpy arrays are read); it may run "
                     "code, so it is not loaded"], out


@pytest.mark.parametrize("writer", ["protocol-2-numpy-1", "protocol-2", "protocol-4", "protocol-5"])
def test_cifar_batches_of_every_writer_are_read(tmp_path: Path, writer: str) -> None:
    """The restricted unpickler reads what real CIFAR files and other writers hold: numpy
    arrays pickled by numpy 1 (``numpy.core``) or 2, bytes from python 3's protocol 2, and
    protocol 5's buffers."""
    path = write_cifar10(tmp_path) / "data_batch_2"
    with open(path, "rb") as f:
        entry = pickle.load(f)
    entry = {**entry, "data": np.asarray(entry["data"]), "batch_label": b"training batch 2 of 5"}
    protocol = 2 if writer.startswith("protocol-2") else int(writer[-1])
    raw = pickle.dumps(entry, protocol=protocol)
    if writer == "protocol-2-numpy-1":
        assert b"numpy._core.multiarray\n_reconstruct" in raw
        raw = raw.replace(b"numpy._core.multiarray\n", b"numpy.core.multiarray\n")
    path.write_bytes(raw)
    data = load_cifar(cifar_cfg(tmp_path))
    assert (data.x_train[20:40].reshape(20, -1).numpy() == entry["data"]).all()
    assert data.y_train[20:40].tolist() == entry["labels"]


def test_cifar_checksum_names_the_file(tmp_path: Path) -> None:
    folder = write_cifar10(tmp_path)
    with pytest.raises(DataError, match=f"corrupt data file {folder / 'data_batch_1'}: its md5 checksum"):
        build_data(cifar_cfg(tmp_path, verify=True))


# ---------------------------------------------------------------- MNIST


def test_mnist_size_disagrees_with_header(tmp_path: Path) -> None:
    write_mnist(tmp_path)
    path = tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes() + b"\0" * 7)
    size = 16 + 12 * 28 * 28
    with pytest.raises(DataError, match=f"corrupt data file {path}: it is {size + 7} bytes but its header "
                                        f"\\(uint8 12 x 28 x 28\\) says {size}"):
        build_data(mnist_cfg(tmp_path))


def test_mnist_not_an_idx_file(tmp_path: Path) -> None:
    write_mnist(tmp_path)
    path = tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte"
    path.write_bytes(b"<html>not found</html>")
    with pytest.raises(DataError, match=f"corrupt data file {path}: it does not start with an idx header"):
        build_data(mnist_cfg(tmp_path))


def test_mnist_official_size_with_verify(tmp_path: Path) -> None:
    write_mnist(tmp_path)
    path = tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte"
    with pytest.raises(DataError, match=f"corrupt data file {path}: it is 9424 bytes; the official file is "
                                        "47040016 bytes. .*data.verify=false"):
        build_data(mnist_cfg(tmp_path, verify=True))


def test_mnist_label_out_of_range(tmp_path: Path) -> None:
    write_mnist(tmp_path)
    path = tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte"
    write_idx(path, np.full(6, 11))
    with pytest.raises(DataError, match=f"{path} holds the label 11 but MNIST has 10 classes"):
        build_data(mnist_cfg(tmp_path))


# ---------------------------------------------------------------- npz


def with_value(x: np.ndarray, value: float) -> np.ndarray:
    """``x`` as float32 with one entry set to ``value``."""
    x = x.astype(np.float32)
    x.flat[5] = value
    return x


@pytest.mark.parametrize(
    ("change", "extra", "message"),
    [
        (lambda a: a.update(x_train=with_value(a["x_train"], np.nan)), {}, "x_train contains NaN; expected uint8"),
        (lambda a: a.update(x_test=with_value(a["x_test"], np.inf)), {}, "x_test contains infinity"),
        (lambda a: a.update(y_test=np.array([0.0, 1.0, np.nan, 2.0])), {}, "y_test contains NaN; expected integer"),
        (lambda a: a.update(y_test=np.array([0.5, 1, 2, 3])), {}, "y_test has dtype float64; expected integer"),
        (lambda a: a["y_train"].__setitem__(3, -2), {}, "y_train holds the label -2; expected class labels from 0"),
        (lambda a: a["y_test"].__setitem__(0, 7), {"num_classes": 5},
         "y_test holds the label 7 but data.num_classes=5; expected labels 0..4"),
    ],
)
def test_npz_bad_values_name_the_key(tmp_path: Path, change, extra: dict, message: str) -> None:
    arrays = npz_arrays()
    change(arrays)
    path = tmp_path / "set.npz"
    np.savez(path, **arrays)
    with pytest.raises(DataError, match=f"{path}: {message}"):
        build_data({"name": "npz", "path": str(path), **extra})


def test_npz_that_is_not_a_zip_archive_says_so(tmp_path: Path) -> None:
    path = tmp_path / "set.npz"
    path.write_text("x_train,y_train\n1,2\n")
    with pytest.raises(DataError, match=f"{path} is not an .npz file: expected a zip archive of .npy arrays"):
        build_data({"name": "npz", "path": str(path)})


# ---------------------------------------------------------------- ImageFolder


@pytest.fixture
def bad_jpeg(tmp_path: Path) -> Path:
    """A class-folder tree (3 images per class and split) with one garbage training JPEG."""
    write_image_folders(tmp_path / "imagenet")
    path = tmp_path / "imagenet" / "train" / "n01440764" / "n01440764_1.JPEG"
    path.write_bytes(b"\xff\xd8 not really a JPEG")
    return path


def data_error(loader: DataLoader) -> str:
    """The message of the DataError that iterating ``loader`` raises. Keeping only the message
    frees the loader's workers at once (a kept traceback makes their shutdown wait 5 s)."""
    try:
        list(loader)
    except DataError as err:
        return str(err)
    pytest.fail("no DataError")


def test_unreadable_image_fails_in_a_worker(bad_jpeg: Path) -> None:
    bundle = build_data(imagenet_cfg(bad_jpeg.parents[2]))
    message = data_error(DataLoader(bundle.train, batch_size=6, num_workers=2))
    # torch re-raises the worker's error with its traceback; only the message is kept
    assert message.startswith(f"unreadable image {bad_jpeg}: UnidentifiedImageError") and "Traceback" not in message
    assert "data.bad_images=skip" in message


@pytest.mark.slow
def test_unreadable_image_skipped(bad_jpeg: Path, caplog: pytest.LogCaptureFixture) -> None:
    bundle = build_data(imagenet_cfg(bad_jpeg.parents[2], bad_images="skip"))
    images = [image for image, _ in bundle.train]
    assert len(images) == 6 and bundle.skipped_images == ()
    assert (images[1] == images[2]).all()  # the next readable image in index order stands in for it
    assert all(not torch.equal(images[i], images[j]) for i in range(6) for j in range(i) if (i, j) != (2, 1))
    assert f"unreadable image {bad_jpeg}" in caplog.text and "serving the next readable image" in caplog.text


def test_bad_images_is_checked(bad_jpeg: Path) -> None:
    with pytest.raises(ConfigError, match="unknown data.bad_images 'ignore'; valid choices: fail, skip"):
        build_data(imagenet_cfg(bad_jpeg.parents[2], bad_images="ignore"))


def test_check_images_lists_unreadable_ones(bad_jpeg: Path) -> None:
    root = bad_jpeg.parents[2]
    with pytest.raises(DataError, match=f"1 of 6 images under {root / 'train'} are unreadable: {bad_jpeg} "
                                        "\\(UnidentifiedImageError"):
        build_data(imagenet_cfg(root, check_images=True))


def test_check_images_leaves_them_out(bad_jpeg: Path, caplog: pytest.LogCaptureFixture) -> None:
    bundle = build_data(imagenet_cfg(bad_jpeg.parents[2], check_images=True, bad_images="skip"))
    assert bundle.skipped_images == (str(bad_jpeg),)
    assert len(bundle.train) == 5 and len(bundle.test) == 6
    assert str(bad_jpeg) not in [path for path, _ in bundle.train.samples]
    assert "left out 1 of 6 images" in caplog.text


def imagenet_args(tmp_path: Path, *extra: str, batch: int = 6) -> list[str]:
    return ["train", "data=imagenet", f"data.root={tmp_path / 'imagenet'}", "data.image_size=16",
            "data.resize_size=20", "data.num_workers=1", "model.width=4", f"trainer.batch_size={batch}",
            "trainer.max_steps=2", "trainer.device=cpu", *extra, *run_dir_of(tmp_path)]


def test_cli_names_the_unreadable_image(bad_jpeg: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(imagenet_args(tmp_path), capsys)
    assert code == 2 and f"bnexp: error: unreadable image {bad_jpeg}" in out and "Traceback" not in out
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "failed" and summary["error"].startswith(f"DataError: unreadable image {bad_jpeg}")


def test_cli_trains_past_skipped_images(bad_jpeg: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the 5 readable images make one batch of 5
    code, out = run_cli(imagenet_args(tmp_path, "data.bad_images=skip", "data.check_images=true", batch=5), capsys)
    assert code == 0, out
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "completed" and summary["skipped_images"] == 1
    assert f"left out 1 of 6 images under {tmp_path / 'imagenet' / 'train'}" in out
