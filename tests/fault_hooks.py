"""``bnexp`` with a fault injected at an exact moment, for tests that need a real signal there.

Usage: python tests/fault_hooks.py HOOK[:STEP] BNEXP_ARGS...

- ``sigterm-in-final-save``: SIGTERM to this process once the final ``checkpoint.pt`` is
  written to its temporary file, before it is renamed into place.
- ``sigkill-in-final-save``: the same with SIGKILL (the temporary file stays behind).
- ``sigkill-after-final-save``: SIGKILL once ``checkpoint.pt`` is in place and the periodic
  checkpoints are removed, before ``summary.json`` says the run completed.
- ``nan``: the second training batch of the pack's run 1 holds a NaN (that run diverges, as
  in tests/test_packing.py).
- ``nan-then-sigkill:STEP``: the same, then SIGKILL once the last run's periodic checkpoint
  of step STEP is on disk.
- ``sigterm-in-setup``: SIGTERM to this process as the run starts reading its data set.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bnexp.cli import main  # noqa: E402
from bnexp.engine import checkpoint, trainer  # noqa: E402
from bnexp.engine.pack import PackMember  # noqa: E402


def signal_in_final_save(signum: int) -> None:
    """``signum`` to this process once the final checkpoint's bytes are in its temporary file."""
    real = checkpoint.atomic_write

    def atomic_write(path: Path, write: Callable[[Any], None]) -> None:
        def write_then_signal(f: Any) -> None:
            write(f)
            if path.name == checkpoint.FINAL:
                os.kill(os.getpid(), signum)

        real(path, write_then_signal)

    checkpoint.atomic_write = atomic_write


def sigkill_after_final_save() -> None:
    """SIGKILL once the final checkpoint is in place and the periodic ones are removed,
    before the run's summary is written."""
    prune = checkpoint.prune

    def prune_then_kill(run_dir: Path, keep: int) -> None:
        prune(run_dir, keep)
        if keep == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.prune = prune_then_kill


def nan_in_run_1() -> None:
    """The second training batch of the pack's run 1 holds a NaN."""
    next_batch = PackMember.next_batch
    drawn = {"count": 0}

    def poisoned(self: PackMember, swap_rng: bool) -> Any:
        x, y = next_batch(self, swap_rng)
        if self.index == 1:
            drawn["count"] += 1
            if drawn["count"] == 2:
                x = x.clone()
                x[0, 0, 0, 0] = float("nan")
        return x, y

    PackMember.next_batch = poisoned


def nan_then_sigkill(step: int) -> None:
    """:func:`nan_in_run_1`, then SIGKILL once the periodic checkpoint of step ``step`` of the
    pack's seed-2 run is on disk (the pack writes its runs' in order)."""
    nan_in_run_1()
    save = checkpoint.save_with_checksum

    def save_then_kill(payload: dict[str, Any], path: Path) -> None:
        save(payload, path)
        if path == checkpoint.periodic_path(path.parent.parent, step) and payload["config"]["trainer"]["seed"] == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.save_with_checksum = save_then_kill


def sigterm_in_setup() -> None:
    """SIGTERM to this process as the run starts reading its data set (before training)."""
    build = trainer.build_data

    def signal_then_build(cfg: Any) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)
        return build(cfg)

    trainer.build_data = signal_then_build


if __name__ == "__main__":
    hook, _, arg = sys.argv[1].partition(":")
    {"sigterm-in-final-save": lambda: signal_in_final_save(signal.SIGTERM),
     "sigkill-in-final-save": lambda: signal_in_final_save(signal.SIGKILL),
     "sigkill-after-final-save": sigkill_after_final_save,
     "nan": nan_in_run_1,
     "nan-then-sigkill": lambda: nan_then_sigkill(int(arg)),
     "sigterm-in-setup": sigterm_in_setup}[hook]()
    main(sys.argv[2:])
