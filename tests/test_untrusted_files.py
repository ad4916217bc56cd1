"""Files of a results tree or a data folder that are not what bnexp writes there: FIFOs, devices,
files larger than bnexp writes, lock files naming no process, CIFAR batches crafted to allocate,
to keep numpy busy or to nest deeply. Each is one line or one warning naming the file, never a
hang, a traceback or memory run out.

Each case is named in docs/resilience.md's fault table.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bnexp.data import build_data
from bnexp.support.errors import EXIT_LOCKED, DataError
from bnexp.support.runlock import LOCK_NAME
from bnexp.support.untrusted import UnsafeFile, read_regular
from tests import warm
from tests.conftest import TINY, run_cli, write_cifar10
from tests.test_bad_data import cifar_cfg
from tests.test_data_sets import imagenet_cfg, write_image_folders

HANG = 120  # seconds after which a command counts as hung (its answer takes a few)


def bnexp(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``bnexp ARGS`` in a process of its own, killed and failed when it hangs."""
    proc = warm.WarmPopen([sys.executable, "-m", "bnexp", *args], cwd)
    try:
        out, err = proc.communicate(HANG)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"bnexp {' '.join(args)} hung")
    return subprocess.CompletedProcess(proc.args, proc.wait(), out, err)


def test_only_regular_files_of_a_sane_size_are_read(tmp_path: Path) -> None:
    """A FIFO (opening it for reading waited for a writer forever), a link to a device (/dev/zero
    never ends), a socket, a directory, or a file above the limit: an UnsafeFile naming it."""
    (tmp_path / "file").write_bytes(b"12345")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "zero").symlink_to("/dev/zero")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "socket"))
    assert read_regular(tmp_path / "file", 5) == read_regular(tmp_path / "link", 5) == b"12345"
    for name, what in (("fifo", "a FIFO (named pipe)"), ("zero", "a character device"), ("socket", "a socket"),
                       (".", "a directory")):
        with pytest.raises(UnsafeFile, match=re.escape(f"{tmp_path / name} is {what}, not a regular file")):
            read_regular(tmp_path / name, 1 << 20)
    with pytest.raises(UnsafeFile, match=f"{tmp_path / 'file'} is 5 bytes, more than the 4 such a file can hold"):
        read_regular(tmp_path / "file", 4)
    server.close()


@pytest.fixture
def finished_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """A folder ``runs`` holding one finished tiny run, ``runs/ok``."""
    assert run_cli(["train", *TINY, f"hydra.run.dir={tmp_path / 'runs' / 'ok'}"], capsys)[0] == 0
    return tmp_path / "runs"


def table_beside_a_fifo_and_a_device(runs: Path, name: str) -> subprocess.CompletedProcess:
    """``bnexp table RUNS`` (exit 0) with a FIFO named ``name`` in RUNS/fifo and a link of that
    name to /dev/zero in RUNS/zero."""
    for folder in ("fifo", "zero"):
        (runs / folder).mkdir()
    os.mkfifo(runs / "fifo" / name)
    (runs / "zero" / name).symlink_to("/dev/zero")
    done = bnexp(["table", str(runs)], runs.parent)
    assert done.returncode == 0, done.stderr
    return done


def test_table_over_a_summary_that_is_a_fifo_or_a_device_warns(finished_run: Path) -> None:
    """``bnexp table`` waited forever on a FIFO named summary.json and read a summary.json linked
    to /dev/zero until memory ran out: each is one warning naming it, the run counts as failed."""
    done = table_beside_a_fifo_and_a_device(finished_run, "summary.json")
    assert f"{finished_run / 'fifo' / 'summary.json'} is a FIFO (named pipe), not a regular file" in done.stderr
    assert f"{finished_run / 'zero' / 'summary.json'} is a character device, not a regular file" in done.stderr
    assert "| 6.25 (1) " in done.stdout and "(0 of 2; 2 failed)" in done.stdout, done.stdout


def test_a_sweep_list_or_metrics_that_is_a_fifo_or_a_device_is_not_read(finished_run: Path) -> None:
    """A sweep folder's cells.txt and a run's metrics.csv were read with plain ``open``: a FIFO
    under either name made ``bnexp table`` (and a dry run's projected time) wait forever, a
    link to /dev/zero read until memory ran out. A list that is neither lists nothing, with a
    warning naming it; a run's training time is then taken from its summary."""
    from bnexp.app.sweep import trained_seconds

    done = table_beside_a_fifo_and_a_device(finished_run, "cells.txt")
    for name, what in (("fifo", "a FIFO (named pipe)"), ("zero", "a character device")):
        assert (f"bnexp: warning: {finished_run / name / 'cells.txt'} is {what}, not a regular file: bnexp reads "
                "only regular files there; it lists no cells") in done.stderr.splitlines()
    assert "| 6.25 (1) " in done.stdout, done.stdout
    run = finished_run / "ok"
    wall = json.loads((run / "summary.json").read_text())["wall_seconds"]
    for target in (None, "/dev/zero"):
        (run / "metrics.csv").unlink()
        if target is None:
            os.mkfifo(run / "metrics.csv")
        else:
            (run / "metrics.csv").symlink_to(target)
        assert trained_seconds(run) == wall


@pytest.mark.parametrize("lock", ["fifo", "pid 2**70"])
def test_a_lock_that_is_a_fifo_or_names_no_process_is_exit_4(tmp_path: Path, lock: str) -> None:
    """A FIFO named .lock made ``bnexp train`` wait forever; a lock naming PID 2**70 on this host
    stopped it with OverflowError (exit 1). Either is a lock whose owner cannot be told: exit 4,
    one line saying which file to delete once its process is known to be gone."""
    run = tmp_path / "run"
    run.mkdir()
    if lock == "fifo":
        os.mkfifo(run / LOCK_NAME)
    else:
        (run / LOCK_NAME).write_text(json.dumps({"pid": 2**70, "host": socket.gethostname()}))
    done = bnexp(["train", *TINY, f"hydra.run.dir={run}"], tmp_path)
    assert done.returncode == EXIT_LOCKED, done.stderr
    assert done.stderr.splitlines()[-1] == (f"bnexp: error: {run} is being written by a process that left an unreadable "
                                            f"lock file ({run / LOCK_NAME}); wait for it to finish, or, if that process "
                                            f"is gone, delete {run / LOCK_NAME} and run again")


def test_a_periodic_checkpoint_that_is_a_fifo_is_passed_over(tmp_path: Path) -> None:
    """Resuming read every ``checkpoints/step-*.pt``: a FIFO among them made the run wait forever.
    It is an unreadable checkpoint: a warning names it and the run starts over."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    os.mkfifo(run / "checkpoints" / "step-000000002.pt")
    done = bnexp(["train", *TINY, f"hydra.run.dir={run}"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert (f"unreadable checkpoint {run / 'checkpoints' / 'step-000000002.pt'}: {run / 'checkpoints'}"
            "/step-000000002.pt is a FIFO (named pipe), not a regular file") in done.stderr + done.stdout


# ---- CIFAR batches crafted against the restricted unpickler -------------------------------------

DATA = b"X\x04\x00\x00\x00data"  # the key 'data', as protocol 2 writes it
LABELS = b"X\x06\x00\x00\x00labels"


def batch(*items: bytes) -> bytes:
    """A protocol-2 pickle of a dict holding the given key and value opcodes."""
    return b"\x80\x02}(" + b"".join(items) + b"u."


def shared_lists(depth: int) -> bytes:
    """A list holding the same list twice, ``depth`` deep: 9 bytes per level, 2**depth labels to
    a reader that walks it (numpy's asarray does)."""
    return b"]K\x01a" + b"q\x000](h\x00h\x00e" * depth  # [1], then (memo it, drop it) [it, it], ...


CRAFTED = {
    # numpy._core.multiarray._reconstruct(ndarray, (10**9,), b'Q'): 7.45 GiB asked by a few bytes
    "reconstruct 7.45 GiB": (batch(DATA, b"cnumpy._core.multiarray\n_reconstruct\ncnumpy\nndarray\nJ\x00\xca\x9a;\x85"
                                   b"C\x01Q\x87R", LABELS, b"]"),
                             "unpickling it needs numpy's _reconstruct of an array of shape (1000000000,)"),
    "ndarray called": (batch(DATA, b"cnumpy\nndarray\nJ\x00\xca\x9a;\x85X\x01\x00\x00\x00Q\x86R", LABELS, b"]"),
                       "unpickling it needs numpy.ndarray((1000000000,), 'Q')"),
    "bytes of 10**9": (batch(DATA, b"c__builtin__\nbytes\nJ\x00\xca\x9a;\x85R", LABELS, b"]"),
                       "unpickling it needs bytes(1000000000,)"),
    "codec other than latin1": (batch(DATA, b"c_codecs\nencode\nX\x01\x00\x00\x00aX\x08\x00\x00\x00punycode\x86R",
                                      LABELS, b"]"), "unpickling it needs _codecs.encode with the encoding 'punycode'"),
    "array of objects": (pickle.dumps({"data": np.array([1, "a"], dtype=object), "labels": [0]}, protocol=2),
                         "unpickling it needs an array of Python objects (object)"),
    # labels sharing lists 20 deep: numpy walked 2**20 of them (40 deep: 44 s and more)
    "shared lists": (batch(DATA, pickle.dumps(np.zeros((1, 3072), np.uint8), protocol=2)[2:-1], LABELS,
                           shared_lists(20)), "'labels' is not a list of integer labels"),
    # images nested 100,000 lists deep: the message did not name the file
    "nested 100000 deep": (batch(DATA, b"]" * 100_000 + b"a" * 99_999, LABELS, b"]"),
                           "'data' is a list; expected a numpy array"),
}


@pytest.mark.parametrize("name", CRAFTED)
def test_a_crafted_cifar_batch_is_refused_naming_the_file(tmp_path: Path, name: str) -> None:
    raw, message = CRAFTED[name]
    path = write_cifar10(tmp_path) / "data_batch_1"
    path.write_bytes(raw)
    with pytest.raises(DataError) as err:
        build_data(cifar_cfg(tmp_path))
    assert str(path) in str(err.value) and message in str(err.value), err.value


def test_an_empty_protocol_2_batch_is_read(tmp_path: Path) -> None:
    """Python 3 writes an empty array's bytes in protocol 2 as ``bytes()``, which was refused."""
    folder = write_cifar10(tmp_path)
    (folder / "data_batch_5").write_bytes(pickle.dumps({"data": np.zeros((0, 3072), np.uint8), "labels": []},
                                                       protocol=2))
    assert len(build_data(cifar_cfg(tmp_path)).train) == 4 * 20


@pytest.mark.parametrize("decode", ["cpu", "gpu"])
def test_an_image_that_is_a_fifo_is_unreadable_not_a_hang(tmp_path: Path, decode: str) -> None:
    """torchvision's image loader opened a FIFO among ImageNet's images and waited forever: it is
    an unreadable image (data.bad_images=fail stops naming it; skip serves the next one), on
    both paths: PIL's (``data.decode=cpu``) and the encoded files the device decodes (``gpu``,
    read here on the CPU by :func:`bnexp.data.jpeg.read_encoded`)."""
    write_image_folders(tmp_path)
    first = sorted((tmp_path / "train").rglob("*.JPEG"))[0]
    first.unlink()
    os.mkfifo(first)
    cpu = torch.device("cpu")
    with pytest.raises(DataError, match=re.escape(f"unreadable image {first}: UnsafeFile: {first} is a FIFO")):
        build_data(imagenet_cfg(tmp_path, decode=decode)).feed(cpu).train[0]
    assert build_data(imagenet_cfg(tmp_path, decode=decode, bad_images="skip")).feed(cpu).train[0][1] == 0
