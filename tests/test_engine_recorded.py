"""The engine writes what it wrote before issue 26's refactor, and resumes its checkpoints.

``tests/data/engine_before_issue26/`` was written by ``scripts/record_engine_behaviour.py``
on the tree before the refactor (commit recorded in the issue's note): every metric row, the
summary's results, the final checkpoint's keys and weights of each case of
``tests/engine_cases.py``, and each run's first periodic checkpoint (step 2).

The comparison is bit for bit, so the cases run in one child process held to the CPU kernels
the recording was made with (``RECORDING_KERNELS``; why, in ``tests/engine_cases.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine_cases import CASES, RECORDED, RECORDED_ON, RECORDING_KERNELS

ROOT = Path(__file__).resolve().parents[1]
REPLAY_TIMEOUT_S = 600  # the replay takes about 10 s of CPU: a hung child fails instead of holding its worker

# One child process replays every case: the tests of this module run on one worker.
pytestmark = pytest.mark.xdist_group("engine_recorded")


def recorded(name: str) -> list[dict]:
    return json.loads((RECORDED / "recorded.json").read_text())[name]


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What ``python -m tests.engine_cases`` observed, run under the recording's kernels."""
    work = tmp_path_factory.mktemp("engine_recorded")
    out = work / "observed.json"
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"} | RECORDING_KERNELS
    child = subprocess.run([sys.executable, "-m", "tests.engine_cases", str(out), str(work)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=REPLAY_TIMEOUT_S)
    if child.returncode:
        pytest.fail(f"the replay exited with {child.returncode}:\n{child.stderr[-3000:]}")
    seen = json.loads(out.read_text())
    if seen["kernels"] != RECORDED_ON:  # e.g. an ARM machine: the recording's arithmetic cannot be had here
        pytest.skip(f"the recording was made with {RECORDED_ON} kernels; this machine's PyTorch uses {seen['kernels']}")
    return seen


def observed(replayed: dict, kind: str, name: str) -> dict:
    """What the replay observed for one case, or the case's test fails with its error."""
    case = replayed[kind][name]
    if "error" in case:
        pytest.fail(f"{kind} case {name} stopped:\n{case['error']}")
    return case["observed"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_engine_writes_what_it_wrote_before(name: str, replayed: dict) -> None:
    assert observed(replayed, "fresh", name) == recorded(name)


@pytest.mark.parametrize("name", sorted(CASES))
def test_checkpoint_written_before_resumes_to_the_same_end(name: str, replayed: dict) -> None:
    """Each run starts from its step-2 checkpoint written by the old engine (resume=auto finds
    it in the run directory) and ends where the uninterrupted old run ended."""
    resumed = observed(replayed, "resumed", name)
    for got, want in zip(resumed["runs"], recorded(name), strict=True):
        assert got["metrics"][-1] == want["metrics"][-1] and got["model"] == want["model"]
        assert got["summary"]["status"] == "completed" and got["callback_keys"] == want["callback_keys"]
    for run_dir, resumed_from in zip(resumed["dirs"], resumed["resumed_from"], strict=True):
        assert Path(resumed_from) == Path(run_dir) / "checkpoints" / "step-000000002.pt"
