"""The engine writes what it wrote before issue 26's refactor, and resumes its checkpoints.

``tests/data/engine_before_issue26/`` was written by ``scripts/record_engine_behaviour.py``
on the tree before the refactor (commit recorded in the issue's note): every metric row, the
summary's results, the final checkpoint's keys and weights of each case of
``tests/engine_cases.py``, and each run's first periodic checkpoint (step 2).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.engine_cases import CASES, case_cfgs, observe, run_case, train_case

RECORDED = Path(__file__).parent / "data" / "engine_before_issue26"


def recorded(name: str) -> list[dict]:
    return json.loads((RECORDED / "recorded.json").read_text())[name]


@pytest.mark.parametrize("name", sorted(CASES))
def test_engine_writes_what_it_wrote_before(name: str, tmp_path: Path) -> None:
    assert observe(run_case(name, tmp_path)) == recorded(name)


@pytest.mark.parametrize("name", sorted(CASES))
def test_checkpoint_written_before_resumes_to_the_same_end(name: str, tmp_path: Path) -> None:
    """Each run starts from its step-2 checkpoint written by the old engine (resume=auto finds
    it in the run directory) and ends where the uninterrupted old run ended."""
    cfgs = case_cfgs(name)
    dirs = [tmp_path / f"seed{c.trainer.seed}" for c in cfgs]
    for i, d in enumerate(dirs):
        (d / "checkpoints").mkdir(parents=True)
        old = RECORDED / f"{name}.{i}.pt"
        shutil.copy(old, d / "checkpoints" / "step-000000002.pt")
        shutil.copy(old.with_name(old.name + ".sha256"), d / "checkpoints" / "step-000000002.pt.sha256")
    train_case(cfgs, dirs)
    for got, want in zip(observe(dirs), recorded(name)):
        assert got["metrics"][-1] == want["metrics"][-1] and got["model"] == want["model"]
        assert got["summary"]["status"] == "completed" and got["callback_keys"] == want["callback_keys"]
    for d in dirs:
        resumed = json.loads((d / "summary.json").read_text())["resumed_from"]
        assert Path(resumed) == d / "checkpoints" / "step-000000002.pt"
