"""bnexp's cache folder: what it can compute again, kept between commands.

Four things live there: the result configs of a preset's jobs and their fingerprints
(:func:`bnexp.report.presets.job_configs`, :func:`~bnexp.report.presets.job_fingerprints`),
a preset's composed config and sweeps (:func:`bnexp.report.presets.read_preset`), the rows a
results folder's summaries give (:class:`bnexp.report.results.RowCache`) and the configs
whose keys shell completion lists (:func:`bnexp.app.config_tree.key_choices`). Every
entry is keyed by what it was computed from, bnexp's own files included (:func:`tree_digest`),
and is plain JSON, never a pickle. Anything in the folder may be deleted at any time; each
of its folders keeps its :data:`CACHE_ENTRIES` most recently written entries (:func:`prune`).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
from pathlib import Path
from typing import Iterable, Optional

import bnexp

CACHE_ENV = "BNEXP_CACHE_DIR"  # where bnexp keeps what it can compute again (see cache_dir)
# A file whose modification or change time is this recent when it is read is not trusted to
# a cache: a file system's clock ticks coarsely (milliseconds, up to seconds), so a second
# write within the same tick of the same size would leave every recorded state unchanged (the
# "racy" entries of git's index). A network file system whose server's clock lags by more
# than this leaves in-place edits exposed; bnexp itself replaces a summary (a new inode).
RACY_SECONDS = 2.0
# Entries kept in each folder of the cache (a preset's job configs, a results folder's rows, a
# completion's config, ...): the least recently written go first (prune). bnexp's own files are
# part of every key, so each new version, or edit of a checkout, starts new entries.
CACHE_ENTRIES = 128


def cache_dir() -> Path:
    """bnexp's cache folder: ``$BNEXP_CACHE_DIR``, else ``bnexp`` in ``$XDG_CACHE_HOME``
    (``~/.cache``); an OSError when there is no home folder to put it in. Anything in it may
    be deleted at any time."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    try:
        home = Path.home()
    except RuntimeError as err:  # no $HOME and no passwd entry
        raise OSError(f"no cache folder: {err}") from None
    return Path(os.environ.get("XDG_CACHE_HOME") or home / ".cache") / "bnexp"


def package_dir() -> Path:
    """The folder of the installed bnexp package."""
    return Path(bnexp.__file__).resolve().parent


@functools.cache
def package_digest() -> str:
    """A digest of bnexp's own files (code, configs, tables), computed once per process."""
    digest = hashlib.sha256()
    tree_digest(digest, (package_dir(),))
    return digest.hexdigest()


def tree_digest(digest: "hashlib._Hash", roots: Iterable[Path]) -> None:
    """Feed every file under ``roots`` (names and contents, bytecode caches left out) into ``digest``."""
    for root in roots:
        for path in sorted(p for p in Path(root).rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            digest.update(f"\0{path.relative_to(root)}\0".encode())
            digest.update(path.read_bytes())


def file_state(path: str | Path, now_ns: int) -> Optional[list[int]]:
    """What changes when a file is written, replaced or touched (device, inode, size, and
    modification and change times in nanoseconds); empty when there is no such file; None
    when it changed within :data:`RACY_SECONDS` of ``now_ns`` (see there), so not to be cached."""
    try:
        st = os.stat(path)
    except OSError:
        return []
    if now_ns - max(st.st_mtime_ns, st.st_ctime_ns) < RACY_SECONDS * 1e9:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def write_cache(path: Path, data: bytes) -> None:
    """Write a cache file whole, one command at a time (a lock beside it), then
    :func:`prune` its folder; an OSError when the folder cannot be made or written."""
    from bnexp.support.runinfo import atomic_write  # here: a completion read from the cache need not import it

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes
        atomic_write(path, lambda f: f.write(data))
    prune(path.parent)


def prune(folder: Path, keep: Optional[int] = None) -> None:
    """Delete all but the ``keep`` (:data:`CACHE_ENTRIES`) most recently written entries of a
    cache folder. An entry is the files whose names share what comes before the first dot (its
    data, its lock, a preset's fingerprints), written when one of them last was (a lock is
    written each time it is taken: a preset's job configs count as written when read). An
    entry another command is reading is at worst computed again; files being written
    (hidden) are left alone."""
    try:
        with os.scandir(folder) as entries:
            files = [(e.name.split(".", 1)[0], e.stat().st_mtime_ns, e.path) for e in entries
                     if not e.name.startswith(".") and e.is_file(follow_symlinks=False)]
    except OSError:
        return
    last: dict[str, int] = {}  # each entry's latest write
    for key, written, _ in files:
        last[key] = max(last.get(key, 0), written)
    stale = set(sorted(last, key=lambda k: (last[k], k), reverse=True)[CACHE_ENTRIES if keep is None else keep:])
    for key, _, path in files:
        if key in stale:
            try:
                os.unlink(path)
            except OSError:
                pass
