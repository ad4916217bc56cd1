"""The engine writes what it wrote before issue 26's refactor, and resumes its checkpoints.

``tests/data/engine_before_issue26/`` was written by ``scripts/record_engine_behaviour.py``
on the tree before the refactor (commit recorded in the issue's note): every metric row, the
summary's results, the final checkpoint's keys and weights of each case of
``tests/engine_cases.py``, and each run's first periodic checkpoint (step 2).

The comparison is bit for bit, and float32 results depend on the CPU kernels that compute
them: a loss's mean or a convolution summed in 512-bit vectors (AVX-512) rounds differently in
its last bit from the same sum in 256-bit ones (AVX2). The recording was made with AVX2
kernels (replayed on an AVX-512 machine, every case matches bit for bit under the caps below
and none does without them), so the cases run in one child process held to them:
``ATEN_CPU_CAPABILITY`` caps PyTorch's own kernels, ``ONEDNN_MAX_CPU_ISA`` oneDNN's
convolutions and ``MKL_ENABLE_INSTRUCTIONS`` MKL's matrix products. Each library reads its
variable once, early in a process, which is why the cases need a process of their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine_cases import CASES, RECORDED

RECORDING_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
ROOT = Path(__file__).resolve().parents[1]

# One child process replays every case: the tests of this module run on one worker.
pytestmark = pytest.mark.xdist_group("engine_recorded")


def recorded(name: str) -> list[dict]:
    return json.loads((RECORDED / "recorded.json").read_text())[name]


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What ``python -m tests.engine_cases`` observed, run under the recording's kernels."""
    work = tmp_path_factory.mktemp("engine_recorded")
    out = work / "observed.json"
    subprocess.run([sys.executable, "-m", "tests.engine_cases", str(out), str(work)], cwd=ROOT, check=True,
                   env={**os.environ, **RECORDING_KERNELS})
    seen = json.loads(out.read_text())
    if seen["kernels"] != "AVX2":  # e.g. an ARM machine: the recording's arithmetic cannot be had here
        pytest.skip(f"the recording was made with AVX2 kernels; this machine's PyTorch uses {seen['kernels']}")
    return seen


@pytest.mark.parametrize("name", sorted(CASES))
def test_engine_writes_what_it_wrote_before(name: str, replayed: dict) -> None:
    assert replayed["fresh"][name] == recorded(name)


@pytest.mark.parametrize("name", sorted(CASES))
def test_checkpoint_written_before_resumes_to_the_same_end(name: str, replayed: dict) -> None:
    """Each run starts from its step-2 checkpoint written by the old engine (resume=auto finds
    it in the run directory) and ends where the uninterrupted old run ended."""
    resumed = replayed["resumed"][name]
    for got, want in zip(resumed["observed"], recorded(name), strict=True):
        assert got["metrics"][-1] == want["metrics"][-1] and got["model"] == want["model"]
        assert got["summary"]["status"] == "completed" and got["callback_keys"] == want["callback_keys"]
    assert resumed["resumed_from"] == ["checkpoints/step-000000002.pt"] * len(recorded(name))
