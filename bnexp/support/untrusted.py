"""Opening files that a results tree or a data folder holds: regular files of a sane size only.

A run folder or a data set can come from elsewhere, and a name bnexp reads there can be a FIFO
(opening it for reading waits for a writer forever), a link to a device (``/dev/zero`` never
ends) or a file far larger than bnexp ever writes. :func:`open_regular` opens without
blocking, looks at what it opened and refuses anything but a regular file (a symbolic link
to one is one) of at most ``limit`` bytes with :class:`UnsafeFile`, an ``OSError``: every
reader already turns an unreadable file into its own one-line error or warning. Every reader
of summaries, metrics, locks, checkpoints, configs and data files goes through it.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from pathlib import Path
from typing import BinaryIO

# How large each kind of file may be, with room to spare over what bnexp writes or reads.
SMALL_FILE = 2**16  # a run's .lock, a checkpoint's .sha256: a line
RECORD_FILE = 2**26  # summary.json, eval.json, config.yaml, overrides.yaml: kilobytes
TABLE_FILE = 2**32  # metrics.csv, probes.csv: a row per evaluation, or per probe, layer and step
CHECKPOINT_FILE = 2**36  # a checkpoint: the model, the optimizer's state and the hooks'
DATA_FILE = 2**38  # a data set's file: CIFAR-100's training batch is 158 MB, an npz what the user saved
CHUNK = 2**24  # bytes read at a time

KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
         (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


class UnsafeFile(OSError):
    """A file bnexp refuses to read: not a regular file, or larger than such a file can be."""


def open_regular(path: str | Path, limit: int) -> BinaryIO:
    """``path`` open for binary reading, if it is a regular file of at most ``limit`` bytes;
    :class:`UnsafeFile` naming it and what it is otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO opens at once, unread
    except OSError as err:
        if err.errno != errno.ENXIO:  # a socket cannot be opened at all
            raise
        raise UnsafeFile(not_regular(path, os.stat(path).st_mode)) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFile(not_regular(path, info.st_mode))
        if info.st_size > limit:
            raise UnsafeFile(f"{path} is {info.st_size} bytes, more than the {limit} such a file can hold")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def not_regular(path: str | Path, mode: int) -> str:
    """The refusal of ``path``, a file of ``mode`` other than a regular file's."""
    what = next((name for test, name in KINDS if test(mode)), "not a regular file")
    return f"{path} is {what}, not a regular file: bnexp reads only regular files there"


def read_regular(path: str | Path, limit: int) -> bytes:
    """The bytes of :func:`open_regular`, read in chunks up to ``limit`` (a file that grows past
    it while it is read is refused)."""
    chunks, total = [], 0
    with open_regular(path, limit) as f:
        while chunk := f.read(CHUNK):
            total += len(chunk)
            if total > limit:
                raise UnsafeFile(f"{path} grew past {limit} bytes while it was read")
            chunks.append(chunk)
    return b"".join(chunks)


def read_regular_text(path: str | Path, limit: int) -> str:
    """The text (UTF-8) of :func:`read_regular`."""
    return read_regular(path, limit).decode()


def text_stream(path: str | Path, limit: int) -> io.StringIO:
    """:func:`read_regular_text` as a stream, for readers that take one (pandas, OmegaConf)."""
    return io.StringIO(read_regular_text(path, limit))
