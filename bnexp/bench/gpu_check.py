"""``make gpu-check`` (``python -m bnexp.bench.gpu_check``): bnexp validated on the GPU at hand in one call.

The check is a list of sections (:data:`SECTIONS`), each a command run in its own process
with its own time budget (stopped when it runs over: SIGTERM to its process group, which
bnexp passes on to torchrun's ranks, then SIGKILL), so that one failure does not hide the
others and one slow section cannot eat the others' time. The default sections fit
:data:`TOTAL_BUDGET_S` (with ``make``'s offline install, 10 minutes on one H200, whose lease
of 15 minutes includes its start); the others run when named (``make gpu-check CHECKS="bench-step bench-pack"``):

1. ``tests``: the tests marked ``cuda`` (tests/test_cuda.py: every norm, BNP, the device
   loader and 20 training steps on CUDA against the CPU in float64, bf16 against float32,
   eager against compiled, resume bit-exactness, the CUDA graph's replay against the plain
   step, two nccl processes when two GPUs are visible) and the CPU tests of the CUDA branches
   (tests/test_gpu_paths.py);
2. ``step-graph``: ``bnexp bench graph`` (ResNet-20 ``bn`` and ``cbn`` at batch 128: the
   replayed step against the plain one in bf16 and float32, then ms per step, images/s, the
   GPU's busy share and the projected minutes of a 120-epoch run for today's eager and
   compiled step and the engine's step plain, captured, and compiled and captured, bf16
   first, then float32 while the section's time lasts);
3. ``table-cost``: ``bnexp bench table_cost`` (images/s of seed packs and rho packs of 10 to 60
   ResNet-20 ``cbn`` runs, grouped or per-run convolutions, 1, 2 or 4 workers on the GPU, and
   CBN Table 1's projected GPU-hours at each; ``table-cost.md`` is its benchmarks row);
4. ``imagenet-input``: ``bnexp bench imagenet``, ImageNet images per second of the CPU path
   (1, 8, 16 workers) and of ``data.decode=gpu``, against a compiled bf16 ResNet-50 step at
   batch 128, 64, 32 (a synthetic tree of ImageNet-sized JPEGs; ``imagenet-input.md`` is its
   benchmarks row);
5. by name only: ``bnexp bench norms|step|data|pack|run`` at the sizes the targets name, and
   ResNet-20 ``bn``, ``cbn`` and a pack of 10 ``cbn`` runs for 3 CIFAR-10-sized epochs with
   bf16, channels_last and compile, extrapolated to 120 epochs.

Everything goes to ``results/gpu-check/``, written again after every section (a lease that
ends mid-way keeps what was measured): ``gpu-check.json`` (each section's command, exit code,
seconds, budget and output tail, the benchmark records, the extrapolated minutes),
``gpu-check.md``, a summary to paste into docs/benchmarks.md, and ``<section>.log``, each
section's whole output. The exit code is 1 if any section failed. Without a GPU only the
sections that need none run (the ``cuda`` tests are skipped, with the reason) and the exit
code is 0 when they pass; a machine with an NVIDIA device that torch cannot use (a driver
older than the CUDA build wants) fails instead of passing as "no GPU".
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

OUT = Path("results/gpu-check")
TESTS = ("tests/test_cuda.py", "tests/test_gpu_paths.py")
# The default sections on one H200: 10 of a lease's 15 minutes, 20 s of them left to make's offline install.
TOTAL_BUDGET_S = 580
GRACE_S = 20  # after SIGTERM, for a run to checkpoint and its ranks to stop
CIFAR_SHAPED = ("data=synthetic", "data.train_size=50000", "data.test_size=10000", "data.image_size=32")
FAST = ("trainer.amp=bf16", "trainer.channels_last=true", "trainer.compile=true", "trainer.epochs=3")
TARGET_NORMS = ("bn", "cbn")  # docs/benchmarks.md: <= 2 and <= 2.5 minutes for 120 epochs
PACK_TARGET = 10  # docs/benchmarks.md: 10 packed ResNet-20 runs of 120 epochs in <= 3 minutes


@dataclass(frozen=True)
class Section:
    """One part of the check: ``command``, its time budget in seconds, whether a plain
    ``make gpu-check`` runs it (``default``) and whether it needs a GPU."""

    name: str
    command: tuple[str, ...]
    budget_s: int
    default: bool = True
    gpu: bool = True


def bench(name: str, *args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "bnexp", "bench", *args, "device=cuda", f"out={OUT / f'{name}.json'}")


def short_run(name: str, *args: str) -> tuple[str, ...]:
    """``bnexp bench run`` of 3 CIFAR-10-sized epochs with the fast settings, extrapolated to 120."""
    return bench(name, "run", "reps=1", *CIFAR_SHAPED, *FAST, *args)


SECTIONS = (
    Section("tests", (sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", *TESTS), 130, gpu=False),
    # the replayed-vs-plain comparisons first, then speed blocks (bf16 before float32) while the
    # bench's own 150 s hold one more (30 s left for the start and a block that runs longer)
    Section("step-graph", bench("step-graph", "graph", "reps=3", "number=10", "budget=150"), 180),
    # CBN Table 1's cost by pack size, conv form and workers per GPU (bnexp/bench/table_cost.py): the
    # bench starts no setting after its own 120 s, 30 s left for the setting under way
    Section("table-cost", bench("table-cost", "table_cost", "budget=120"), 150),
    # ImageNet input (CPU path at 1/8/16 workers, the device path) against ResNet-50's step at batch
    # 128/64/32 (issue 37): the bench starts no case its own budget cannot hold, 15 s left for its start
    Section("imagenet-input", bench("imagenet-input", "imagenet", "budget_s=105"), 120),
    Section("bench-norms", bench("bench-norms", "norms", "nets=resnet20", "reps=3"), 90, default=False),
    Section("bench-step", bench("bench-step", "step", "models=resnet20", "norms=bn,popnorm,cbn,bnp,none", "reps=3",
                                "trainer.amp=bf16", "trainer.channels_last=true"), 200, default=False),
    Section("bench-data", bench("bench-data", "data", "reps=3", "train_size=50000"), 60, default=False),
    Section("bench-pack", bench("bench-pack", "pack", "runs=1,2,5,10", "reps=3", "trainer.amp=bf16",
                                "trainer.channels_last=true"), 60, default=False),
    Section("bench-run", bench("bench-run", "run", "reps=1", *CIFAR_SHAPED), 60, default=False),
    *(Section(f"resnet20-{norm}", short_run(f"resnet20-{norm}", f"norm={norm}"), 120, default=False)
      for norm in TARGET_NORMS),
    Section(f"resnet20-cbn-pack{PACK_TARGET}", short_run(f"resnet20-cbn-pack{PACK_TARGET}", "norm=cbn",
                                                         f"trainer.pack={PACK_TARGET}", "target_seconds=180"),
            180, default=False),
)


def checks(gpu: bool) -> list[Section]:
    """The sections this machine can run."""
    return [s for s in SECTIONS if gpu or not s.gpu]


def run_check(section: Section) -> dict[str, Any]:
    """Run one section within its budget; its outcome and the last lines of its output."""
    name, command, budget = section.name, list(section.command), section.budget_s
    print(f"gpu-check: {name} (budget {budget} s): {' '.join(command)}", flush=True)
    started = time.perf_counter()
    # Output to a file, not a pipe (processes left behind cannot hold the check open), and
    # the section in its own process group: over its budget the group gets SIGTERM first,
    # which bnexp's launcher passes on to torchrun and its ranks (in sessions of their own),
    # then SIGKILL.
    with open(OUT / f"{name}.log", "w+") as log:  # the whole output, kept for diagnosis
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=budget)
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
        output = log.read() + (f"\nstopped at its budget of {budget} s" if code is None else "")
    seconds = round(time.perf_counter() - started, 1)
    tail = "\n".join(str(output).splitlines()[-15:])
    print(tail, flush=True)
    return {"name": name, "command": command, "ok": code == 0, "returncode": code, "seconds": seconds,
            "budget_s": budget, "tail": tail}


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
             "| check | result | seconds | budget |", "| --- | --- | --- | --- |"]
    lines += [f"| {c['name']} | {'pass' if c['ok'] else 'FAIL'} | {c['seconds']} | {c.get('budget_s', '')} |"
              for c in report["checks"]]
    for norm, minutes in report["extrapolated_minutes"].items():
        lines.append(f"\nResNet-20 {norm}, CIFAR-10-sized, 120 epochs (bf16, channels_last, compile): "
                     f"{minutes} minutes (extrapolated)")
    for name, rows in report["benchmarks"].items():
        if name == "step-graph":
            lines += step_graph_table(rows)
        elif rows:
            lines += ["", f"{name}:", "", "| name | mode | seconds (median) | ratio |", "| --- | --- | --- | --- |"]
            lines += [f"| {r.get('name')} | {r.get('mode')} | {r.get('seconds_median')} | {r.get('ratio')} |"
                      for r in rows]
    return "\n".join(lines) + "\n"


def step_graph_table(rows: list[dict[str, Any]]) -> list[str]:
    """``bench graph``'s records as two tables: the comparisons, then the speeds."""
    lines = ["", "step-graph, ResNet-20 at batch 128 (largest difference of weights, buffers, momentum):", "",
             "| norm | amp | comparison | steps | max difference |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['name']} | {r['amp']} | {r['mode']} | {r['steps']} | {r['max_difference']:.3g} |"
              for r in rows if "max_difference" in r]
    lines += ["", "| norm | amp | step | ms/step | images/s | GPU busy | 120 epochs (min) |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['name']} | {r['amp']} | {r['mode']} | {r['ms_per_step']:.2f} | {r['images_per_s']:.0f} | "
              f"{'' if r.get('gpu_busy') is None else format(r['gpu_busy'], '.0%')} | {r['projected_minutes']:.2f} |"
              for r in rows if "ms_per_step" in r]
    skipped = [f"{r['name']} {r['amp']}" for r in rows if r.get("skipped")]
    if skipped:
        lines.append(f"\nleft out (budget): {', '.join(skipped)}")
    return lines


def unusable_gpu() -> bool:
    """Whether this machine has an NVIDIA GPU that a CUDA build of torch was meant to use
    and cannot (not a CPU-only torch, nor GPUs hidden on purpose with CUDA_VISIBLE_DEVICES)."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1")
    hardware = Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi") is not None
    return hardware and torch.version.cuda is not None and not hidden and not torch.cuda.is_available()


def chosen(found: list[Section], names: list[str]) -> list[Section]:
    """The sections named on the command line in their usual order, or the default ones."""
    unknown = sorted(set(names) - {s.name for s in found})
    if unknown:
        raise SystemExit(f"gpu-check: unknown check {unknown[0]!r}; checks: {', '.join(s.name for s in found)}")
    return [s for s in found if s.name in names] if names else [s for s in found if s.default]


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
    for section in todo:
        results.append(run_check(section))
        text = write_report(results, [s.name for s in todo if s.name != "tests"], gpu)
    print(text if todo else "gpu-check: nothing to run")
    failed = [c["name"] for c in results if not c["ok"]]
    if failed:
        print(f"gpu-check: FAILED: {', '.join(failed)} (details in {OUT / 'gpu-check.json'})", file=sys.stderr)
    return 1 if failed else 0


def write_report(results: list[dict[str, Any]], benches: list[str], gpu: bool) -> str:
    """``gpu-check.json`` and ``gpu-check.md`` of the sections run so far; the summary's text."""
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
    return text


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
