"""Record what the training engine writes for a set of tiny runs and packs (issue 26).

Run on the tree before a refactor of the engine; ``tests/test_engine_recorded.py`` reruns the
same cases and compares every metric row, the summary and the checkpoint's keys bit for bit.
It also keeps one checkpoint per case written before the refactor, which the test resumes.
float32 results depend on the CPU's kernels, and the test replays the cases under
``RECORDING_KERNELS`` (``tests/engine_cases.py``): record under the same environment, e.g.
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python ...``;
the script stops when PyTorch runs other kernels.
Usage: python scripts/record_engine_behaviour.py tests/data/engine_before_issue26
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from tests.engine_cases import CASES, RECORDED_ON, RECORDING_KERNELS, observe, run_case  # noqa: E402


def main(out: Path) -> None:
    kernels = torch.backends.cpu.get_cpu_capability()
    if kernels != RECORDED_ON:
        sys.exit(f"PyTorch runs {kernels} kernels here, the test replays with {RECORDED_ON}: set "
                 + " ".join(f"{k}={v}" for k, v in RECORDING_KERNELS.items()))
    out.mkdir(parents=True, exist_ok=True)
    recorded = {}
    for name in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            dirs = run_case(name, Path(tmp))
            recorded[name] = observe(dirs)
            for i, d in enumerate(dirs):  # the mid-run checkpoint, for the resume test
                first = sorted(d.glob("checkpoints/step-*.pt"))[0]
                shutil.copy(first, out / f"{name}.{i}.pt")
                shutil.copy(first.with_name(first.name + ".sha256"), out / f"{name}.{i}.pt.sha256")
    (out / "recorded.json").write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
