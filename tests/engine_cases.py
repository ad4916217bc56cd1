"""Tiny runs and packs whose every output ``tests/test_engine_recorded.py`` compares with what
the engine wrote before issue 26's refactor (``tests/data/engine_before_issue26/``).

Each case is a list of seeds trained alone (one seed) or as one pack (several); periodic
checkpoints every 2 steps, evaluation every 2 steps, 6 steps in all.

``python -m tests.engine_cases OUT.json WORKDIR`` (from the repository's root, under
``RECORDING_KERNELS``) trains every case, resumes each from the checkpoints the old engine wrote
at step 2 and writes what it observed to OUT.json: the test runs it in a child process.

float32 results depend on the CPU kernels that compute them: a sum done in 512-bit vectors
(AVX-512) can round differently in its last bit from the same sum in 256-bit ones (AVX2). The
recording was made with AVX2 kernels: on an AVX-512 machine 12 of the 14 tests failed on such
last-bit differences (the first one seen in a training loss), and all 14 match bit for bit
under ``ATEN_CPU_CAPABILITY=avx2`` (PyTorch's own kernels; alone it mends the 4 MLP tests) and
``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN's convolutions). ``MKL_ENABLE_INSTRUCTIONS=AVX2`` changed
nothing on that machine (an AMD one); it is set in case MKL's matrix products on an Intel
AVX-512 machine need it, which was not tried. ``MKL_CBWR`` is cleared: it changes MKL's results
(``MKL_CBWR=AVX2`` broke 6 of the tests). Each library reads its variable once, early in a
process, hence the child process.
"""

from __future__ import annotations

import csv
import json
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from bnexp.engine import checkpoint
from tests.conftest import TINY, compose_cfg

RECORDED = Path(__file__).parent / "data" / "engine_before_issue26"
RECORDED_ON = "AVX2"  # torch.backends.cpu.get_cpu_capability() of the recording
RECORDING_KERNELS = {"ATEN_CPU_CAPABILITY": RECORDED_ON.lower(), "ONEDNN_MAX_CPU_ISA": RECORDED_ON,
                     "MKL_ENABLE_INSTRUCTIONS": RECORDED_ON}
STEPS = [
    "trainer.max_steps=6", "trainer.checkpoint_every=2", "trainer.checkpoint_unit=step",
    "trainer.eval_every=2", "trainer.eval_unit=step", "trainer.keep_checkpoints=10",
]
# name -> (overrides, seeds)
CASES: dict[str, tuple[list[str], list[int]]] = {
    "alone_bn": (["norm=bn"], [0]),
    "alone_cbn": (["norm=cbn"], [1]),
    "alone_bnp_mlp": (["norm=bnp", "model=mlp3x100", "model.width=8"], [0]),
    "alone_brn": (["norm=brn"], [2]),
    "pack_bn": (["norm=bn"], [0, 1, 2]),
    "pack_cbn": (["norm=cbn"], [3, 4]),
    "pack_bnp_mlp": (["norm=bnp", "model=mlp3x100", "model.width=8"], [0, 1]),
}
# Columns and summary keys that hold wall time, versions or paths, not results.
UNTIMED = ("time", "seconds", "throughput", "per_s")
SUMMARY_SKIP = ("wall_seconds", "git_commit", "git_dirty", "config", "packed_with", "torch_version",
                "bnexp_version")


def case_cfgs(name: str) -> list:
    """The composed config of each seed of case ``name``."""
    overrides, seeds = CASES[name]
    return [compose_cfg([*TINY, *STEPS, *overrides, f"trainer.seed={s}"]) for s in seeds]


def run_case(name: str, root: Path) -> list[Path]:
    """Train case ``name`` under ``root``; return its run directories, checkpoints kept."""
    from bnexp.engine import checkpoint as ckpt_module

    cfgs = case_cfgs(name)
    dirs = [root / f"seed{c.trainer.seed}" for c in cfgs]
    keep = ckpt_module.prune
    ckpt_module.prune = lambda run_dir, keep_n: None  # keep the mid-run checkpoints to compare
    try:
        train_case(cfgs, dirs)
    finally:
        ckpt_module.prune = keep
    return dirs


def train_case(cfgs: list, dirs: list[Path]) -> None:
    """Train ``cfgs`` in ``dirs``: alone for one config, as one pack for several."""
    if len(cfgs) == 1:
        from bnexp.engine.trainer import train
        train(cfgs[0], dirs[0])
    else:
        from bnexp.engine.pack import train_pack
        train_pack(cfgs, dirs)


def resume_case(name: str, root: Path) -> list[Path]:
    """Train case ``name`` under ``root`` from the step-2 checkpoints the old engine wrote,
    placed where ``resume=auto`` finds them; return its run directories."""
    cfgs = case_cfgs(name)
    dirs = [root / f"seed{c.trainer.seed}" for c in cfgs]
    for i, d in enumerate(dirs):
        (d / "checkpoints").mkdir(parents=True)
        old = RECORDED / f"{name}.{i}.pt"
        shutil.copy(old, d / "checkpoints" / "step-000000002.pt")
        shutil.copy(old.with_name(old.name + ".sha256"), d / "checkpoints" / "step-000000002.pt.sha256")
    train_case(cfgs, dirs)
    return dirs


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return [{k: v for k, v in row.items() if not any(t in k for t in UNTIMED)} for row in csv.DictReader(f)]


def _tensor_digest(value: Any) -> Any:
    """Tensors as (shape, dtype, exact float64 sum as hex); containers recursively."""
    if isinstance(value, torch.Tensor):
        return [list(value.shape), str(value.dtype), value.double().sum().item().hex() if value.numel() else ""]
    if isinstance(value, dict):
        return {str(k): _tensor_digest(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_tensor_digest(v) for v in value]
    return value if isinstance(value, (int, float, str, bool, type(None))) else repr(type(value))


def observe(dirs: list[Path]) -> list[dict[str, Any]]:
    """What each run directory holds that must not change: metric rows, the summary's results,
    the final checkpoint's model weights and its keys (callback state keys, parameter names)."""
    seen = []
    for d in dirs:
        summary = json.loads((d / "summary.json").read_text())
        final = checkpoint.load(d / checkpoint.FINAL)
        seen.append({
            "metrics": _rows(d / "metrics.csv"),
            "weights": _rows(d / "weights.csv") if (d / "weights.csv").is_file() else [],
            "packed_with": [Path(p).name for p in summary.get("packed_with", [])],
            "summary": {k: v for k, v in summary.items() if k not in SUMMARY_SKIP and not any(t in k for t in UNTIMED)},
            "checkpoint_keys": sorted(final),
            "callback_keys": sorted(final.get("callbacks", {})),
            "model": _tensor_digest(final["model"]),
            "periodic": sorted(p.name for p in (d / "checkpoints").glob("*.pt")) if (d / "checkpoints").is_dir() else [],
        })
    return seen


def outcome(observe_case: Callable[[str, Path], Any], name: str, root: Path) -> dict[str, Any]:
    """What ``observe_case(name, root)`` observed, or the error that stopped it."""
    try:
        return {"observed": observe_case(name, root)}
    except Exception:  # noqa: BLE001 - one case's failure is reported in its own test
        return {"error": traceback.format_exc()}


def fresh(name: str, root: Path) -> list[dict[str, Any]]:
    """What case ``name`` wrote when trained from the start."""
    return observe(run_case(name, root))


def resumed(name: str, root: Path) -> dict[str, Any]:
    """What case ``name`` wrote when resumed from the old checkpoints, and the run directory and
    checkpoint each of its runs says it resumed from."""
    dirs = resume_case(name, root)
    return {"runs": observe(dirs), "dirs": [str(d) for d in dirs],
            "resumed_from": [json.loads((d / "summary.json").read_text()).get("resumed_from") for d in dirs]}


def replay(out: Path, work: Path) -> None:
    """Every case trained from the start and resumed from the old step-2 checkpoints, as JSON in
    ``out`` with the CPU kernels PyTorch used; nothing is trained when they are not
    ``RECORDED_ON`` (the recording cannot be matched there)."""
    kernels = torch.backends.cpu.get_cpu_capability()
    seen: dict[str, Any] = {"kernels": kernels, "fresh": {}, "resumed": {}}
    if kernels == RECORDED_ON:
        for name in CASES:
            seen["fresh"][name] = outcome(fresh, name, work / "fresh" / name)
            seen["resumed"][name] = outcome(resumed, name, work / "resumed" / name)
    out.write_text(json.dumps(seen))


if __name__ == "__main__":
    replay(Path(sys.argv[1]), Path(sys.argv[2]))
