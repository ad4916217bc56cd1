"""``make gpu-check`` (``python -m bnexp.bench.gpu_check``): bnexp validated on the GPU at hand in one call.

It runs, each as its own process so that one failure does not hide the others:

1. the tests marked ``cuda`` (tests/test_cuda.py: every norm, BNP, the device loader and a
   20-step training run on CUDA against the CPU in float64, bf16 against float32, eager
   against compiled, resume bit-exactness, two nccl processes when two GPUs are visible)
   and the CPU tests of the CUDA branches (tests/test_gpu_paths.py);
2. ``bnexp bench norms|step|data|pack|run`` on the GPU at the sizes the targets name (full-size
   shapes; fewer models, norms and repetitions than the defaults, to fit the budget;
   ``run`` on CIFAR-10-shaped synthetic data: no data set is needed);
3. ResNet-20 with ``bn`` and with ``cbn`` for 3 CIFAR-10-sized epochs (50,000 synthetic
   32x32 images; the per-step cost does not depend on what the pixels show) with bf16,
   channels_last and compile, extrapolated to 120 epochs by ``bnexp bench run``, and the
   same with a pack of 10 CBN runs (``trainer.pack=10``);
4. ``bnexp bench imagenet``: ImageNet images per second of the CPU path (1, 8, 16 workers)
   and of ``data.decode=gpu``, against a compiled bf16 ResNet-50 step at batch 128, 64, 32
   (a synthetic tree of ImageNet-sized JPEGs; ``imagenet-input.md`` is its benchmarks row).

Everything goes to ``results/gpu-check/``: ``gpu-check.json`` (each check's command, exit
code, seconds and output tail, the benchmark records, the extrapolated minutes) and
``gpu-check.md``, a summary to paste into docs/benchmarks.md. The exit code is 1 if any
check failed. Without a GPU only step 1 runs (the ``cuda`` tests are skipped, with the
reason) and the exit code is 0 when it passes; a machine with an NVIDIA device that torch
cannot use (a driver older than the CUDA build wants) fails instead of passing as "no GPU".
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

OUT = Path("results/gpu-check")
TESTS = ("tests/test_cuda.py", "tests/test_gpu_paths.py")
STEP_TIMEOUT_S = 240  # one check; the whole call is meant to fit in 10 minutes on one H100
GRACE_S = 20  # after SIGTERM, for a run to checkpoint and its ranks to stop
BENCH_SIZES = {  # the shapes the targets name, fewer variants than the defaults
    "norms": ("nets=resnet20", "reps=3"),  # ResNet-50's 9 shapes x 6 norms compiled: over the check's 4 minutes
    "step": ("models=resnet20", "norms=bn,popnorm,cbn,bnp,none", "reps=3", "trainer.amp=bf16",
             "trainer.channels_last=true"),
    "data": ("reps=3", "train_size=50000"),
    "pack": ("runs=1,2,5,10", "reps=3", "trainer.amp=bf16", "trainer.channels_last=true"),
}
CIFAR_SHAPED = ("data=synthetic", "data.train_size=50000", "data.test_size=10000", "data.image_size=32")
FAST = ("trainer.amp=bf16", "trainer.channels_last=true", "trainer.compile=true", "trainer.epochs=3")
TARGET_NORMS = ("bn", "cbn")  # docs/benchmarks.md: <= 2 and <= 2.5 minutes for 120 epochs
PACK_TARGET = 10  # docs/benchmarks.md: 10 packed ResNet-20 runs of 120 epochs in <= 3 minutes


def bench(name: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "bnexp", "bench", *args, "device=cuda", f"out={OUT / f'{name}.json'}"]


def checks(gpu: bool) -> list[tuple[str, list[str]]]:
    """(name, command) of every check this machine can run."""
    found = [("tests", [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", *TESTS])]
    if not gpu:
        return found
    found += [(f"bench-{what}", bench(f"bench-{what}", what, *sizes)) for what, sizes in BENCH_SIZES.items()]
    found.append(("bench-run", bench("bench-run", "run", "reps=1", *CIFAR_SHAPED)))
    found += [(f"resnet20-{norm}", bench(f"resnet20-{norm}", "run", "reps=1", *CIFAR_SHAPED, *FAST, f"norm={norm}"))
              for norm in TARGET_NORMS]
    found.append((f"resnet20-cbn-pack{PACK_TARGET}", bench(f"resnet20-cbn-pack{PACK_TARGET}", "run", "reps=1",
                                                            *CIFAR_SHAPED, *FAST, "norm=cbn", f"trainer.pack={PACK_TARGET}",
                                                            "target_seconds=180")))
    # ImageNet input (CPU path at 1/8/16 workers, the device path) against ResNet-50's step at
    # batch 128/64/32; about 120 s: the bench starts no case its budget cannot hold
    found.append(("imagenet-input", bench("imagenet-input", "imagenet", "budget_s=120")))
    # CBN Table 1's cost by pack size, conv form and workers per GPU (bnexp/bench/table_cost.py); about 150 s
    found.append(("table-cost", bench("table-cost", "table_cost", "budget=150")))
    return found


def run_check(name: str, command: list[str]) -> dict[str, Any]:
    """Run one check; its outcome and the last lines of its output."""
    print(f"gpu-check: {name}: {' '.join(command)}", flush=True)
    started = time.perf_counter()
    # Output to a file, not a pipe (processes left behind cannot hold the check open), and
    # the check in its own process group: on a timeout the group gets SIGTERM first, which
    # bnexp's launcher passes on to torchrun and its ranks (in sessions of their own), then
    # SIGKILL.
    with open(OUT / f"{name}.log", "w+") as log:  # the whole output, kept for diagnosis
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=STEP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
            for sig, grace in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, None)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=grace)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
        log.seek(0)
        output = log.read() + (f"\ntimed out after {STEP_TIMEOUT_S} s" if code is None else "")
    seconds = round(time.perf_counter() - started, 1)
    tail = "\n".join(str(output).splitlines()[-15:])
    print(tail, flush=True)
    return {"name": name, "command": command, "ok": code == 0, "returncode": code, "seconds": seconds, "tail": tail}


def records(name: str) -> list[dict[str, Any]]:
    path = OUT / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else []


def extrapolated_minutes(name: str) -> float | None:
    found = [r.get("extrapolated_seconds") for r in records(name)]
    return round(found[0] / 60, 2) if found and found[0] is not None else None


def markdown(report: dict[str, Any]) -> str:
    """The summary for docs/benchmarks.md."""
    lines = [f"### gpu-check, {report['date']}, {report['device']}", "",
             f"torch {report['torch']}, CUDA {report['cuda']}, python {report['python']}", "",
             "| check | result | seconds |", "| --- | --- | --- |"]
    lines += [f"| {c['name']} | {'pass' if c['ok'] else 'FAIL'} | {c['seconds']} |" for c in report["checks"]]
    for norm, minutes in report["extrapolated_minutes"].items():
        lines.append(f"\nResNet-20 {norm}, CIFAR-10-sized, 120 epochs (bf16, channels_last, compile): "
                     f"{minutes} minutes (extrapolated)")
    for name, rows in report["benchmarks"].items():
        if rows:
            lines += ["", f"{name}:", "", "| name | mode | seconds (median) | ratio |", "| --- | --- | --- | --- |"]
            lines += [f"| {r.get('name')} | {r.get('mode')} | {r.get('seconds_median')} | {r.get('ratio')} |"
                      for r in rows]
    return "\n".join(lines) + "\n"


def unusable_gpu() -> bool:
    """Whether this machine has an NVIDIA GPU that a CUDA build of torch was meant to use
    and cannot (not a CPU-only torch, nor GPUs hidden on purpose with CUDA_VISIBLE_DEVICES)."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1")
    hardware = Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi") is not None
    return hardware and torch.version.cuda is not None and not hidden and not torch.cuda.is_available()


def chosen(found: list[tuple[str, list[str]]], names: list[str]) -> list[tuple[str, list[str]]]:
    """The checks named on the command line (all of them when none is), in their usual order."""
    unknown = sorted(set(names) - {name for name, _ in found})
    if unknown:
        raise SystemExit(f"gpu-check: unknown check {unknown[0]!r}; checks: {', '.join(n for n, _ in found)}")
    return [check for check in found if not names or check[0] in names]


def main(names: list[str]) -> int:
    gpu = torch.cuda.is_available()
    todo = chosen(checks(gpu), names)
    OUT.mkdir(parents=True, exist_ok=True)
    results = []
    if unusable_gpu():
        results.append({"name": "cuda-available", "command": [], "ok": False, "returncode": None, "seconds": 0.0,
                        "tail": f"an NVIDIA device is present but torch {torch.__version__} (CUDA "
                                f"{torch.version.cuda}) cannot use it: check the driver (nvidia-smi) against "
                                "the CUDA version of this torch build"})
        print(f"gpu-check: FAILED: {results[0]['tail']}", flush=True)
    elif not gpu:
        print("gpu-check: no CUDA device is visible: running the CPU-side checks only", flush=True)
    results += [run_check(name, command) for name, command in todo]
    benches = [name for name, _ in todo if name != "tests"]
    report = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if gpu else f"no GPU ({platform.processor() or platform.machine()})",
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "checks": results,
        "benchmarks": {name: records(name) for name in benches},
        "extrapolated_minutes": {name: extrapolated_minutes(f"resnet20-{name}")
                                 for name in (*TARGET_NORMS, f"cbn-pack{PACK_TARGET}") if f"resnet20-{name}" in benches},
    }
    (OUT / "gpu-check.json").write_text(json.dumps(report, indent=2, default=str))
    text = markdown(report)
    (OUT / "gpu-check.md").write_text(text)
    print(text)
    failed = [c["name"] for c in results if not c["ok"]]
    if failed:
        print(f"gpu-check: FAILED: {', '.join(failed)} (details in {OUT / 'gpu-check.json'})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
