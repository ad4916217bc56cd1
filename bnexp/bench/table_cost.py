"""``bnexp bench table_cost``: what CBN Table 1 costs on this device, by way of packing it.

For each pack size K of ``runs`` (10: a cell's seeds; 30 and 60: a row's rho grid, which
costs what the same number of seeds costs), each form of the pack's convolutions of
``convs`` (``grouped``, ``streams``: :class:`bnexp.nn.packed.PackedConv2d`) and each number
of concurrent workers of ``workers`` on the one device, that many worker processes time
``reps`` training steps each (the trainer's own step: forward, loss, backward, the method
hooks, the optimizer) of a pack of K runs of ``model`` with ``norm`` on random batches of
``batch`` ``image_size`` images, after ``warmup`` steps, all at once (a barrier before and
after the timed steps). A setting's images/s is ``workers * K * batch`` over the slowest
worker's median step; its projected Table 1 GPU-hours are the images that Table 1's runs
train on (the preset ``cbn/table1``: 1,350 runs of 120 epochs) at that rate: training
steps only, without evaluation or start-up. The fastest setting is named ``best``.

The first of ``setups`` (``amp:layout``, ``bf16:channels_last`` by default) is measured for
every K, form and worker count (one worker first, then two, then four); every other setup
(``off:contiguous``: float32, NCHW) for the largest K and one worker, each form, so that the
faster form can be chosen per layout and precision. ``budget`` (seconds from the bench's
start, 0 for none) starts no setting it cannot hold: a setting is expected to take what the
last setting of its convolution form took (the slowest form's, per run, before its own was
measured), scaled by its runs per step (K times workers); those left out are listed. The
records (the JSON and the markdown) are written after every setting, so a bench stopped
from outside keeps what it measured. Other ``key=value`` are Hydra overrides of the run
(``trainer.compile=true``; ``model.width=4`` for a toy). Besides ``out`` (JSON), ``out``
with ``.md`` holds the row for docs/benchmarks.md and, per setup (precision and layout),
the faster convolution form.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from bnexp.bench.common import COMMON, Record, compose_train, device_of, environment, record, synchronize
from bnexp.engine.pack_size import packed_step
from bnexp.models import DataSpec
from bnexp.support.errors import ConfigError
from bnexp.support.runinfo import atomic_write, configure_backends

DEFAULTS: dict[str, Any] = {**COMMON, "model": "resnet20", "norm": "cbn", "runs": ("10", "30", "60"),
                            "convs": ("grouped", "streams"), "workers": ("1", "2", "4"),
                            "setups": ("bf16:channels_last", "off:contiguous"), "batch": 128, "image_size": 32,
                            "warmup": 2, "budget": 0.0, "out": "results/bench/table_cost.json"}
COLUMNS = ("name", "mode", "seconds_median", "images_per_second", "table1_gpu_hours", "ratio")
TABLE = "cbn/table1"  # the table whose cost is projected
BARRIER_TIMEOUT_S = 600


@dataclass(frozen=True)
class Setting:
    """One measured way of training Table 1's runs."""

    runs: int
    conv: str
    workers: int
    amp: str
    layout: str

    @property
    def name(self) -> str:
        return f"K={self.runs} {self.conv} x{self.workers} {self.amp} {self.layout}"


def settings(options: Mapping[str, Any]) -> list[Setting]:
    """Every K x form x worker count at the first setup; the largest K, one worker, each form
    at the other setups."""
    runs = [int(k) for k in options["runs"]]
    workers = [int(w) for w in options["workers"]]
    setups = [tuple(s.split(":")) for s in options["setups"]]
    if not runs or not workers or not setups or any(len(s) != 2 for s in setups) or min(runs + workers) < 1:
        raise ConfigError("bench table_cost needs runs=K,... and workers=W,... (integers >= 1) and "
                          "setups=AMP:LAYOUT,... (bf16:channels_last, off:contiguous)")
    (amp, layout), others = setups[0], setups[1:]
    found = [Setting(k, c, w, amp, layout) for w in workers for k in runs for c in options["convs"]]
    return found + [Setting(max(runs), c, 1, a, lay) for a, lay in others for c in options["convs"]]


def table_images() -> int:
    """The training images of Table 1's runs: each run's steps times its batch."""
    from bnexp.report.presets import load_preset, steps_per_run

    p = load_preset(TABLE)
    return sum(steps_per_run(p.cfg, job) * int(p.cfg.trainer.batch_size) for job in p.jobs)


def step_seconds(setting: Setting, options: Mapping[str, Any], overrides: Sequence[str],
                 barrier: Any) -> list[float] | str:
    """The seconds of each timed step of one worker (an error's text if it could not train),
    in step with the other workers of the setting (``barrier``)."""
    device = device_of(options)
    timed: list[float] | str
    try:
        cfg = compose_train([f"model={options['model']}", f"norm={options['norm']}", "optim.lr=0.001",
                             f"trainer.amp={setting.amp}", f"trainer.channels_last={setting.layout == 'channels_last'}",
                             f"trainer.pack_conv={setting.conv}", *overrides])
        configure_backends(cfg.trainer.tf32, cfg.trainer.deterministic)  # cudnn.benchmark as in a run
        spec = DataSpec(10, 3, int(options["image_size"]))
        step = packed_step(cfg, spec, int(options["batch"]), setting.runs, device)[0]
        for _ in range(int(options["warmup"])):
            step()
        synchronize(device)
        timed = []
    except (RuntimeError, ConfigError) as err:  # out of memory, mostly
        timed = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    barrier.wait(BARRIER_TIMEOUT_S)
    if isinstance(timed, list):
        for _ in range(int(options["reps"])):
            start = time.perf_counter()
            step()
            synchronize(device)
            timed.append(time.perf_counter() - start)
    barrier.wait(BARRIER_TIMEOUT_S)
    step = None  # type: ignore[assignment]
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return timed


def worker(index: int, options: Mapping[str, Any], overrides: Sequence[str], barriers: Mapping[int, Any],
           inbox: Any, outbox: Any) -> None:
    """A worker process: say it has started, then measure each setting it is sent, until it is sent None."""
    if options.get("threads"):
        torch.set_num_threads(int(options["threads"]))
    outbox.put((index, None))
    while (setting := inbox.get()) is not None:
        outbox.put((index, step_seconds(setting, options, overrides, barriers[setting.workers])))


class Workers:
    """The worker processes (as many as the largest worker count), each with its inbox, and
    one barrier per worker count, all started (their imports done) before any setting is
    timed; with one worker at most, this process itself."""

    def __init__(self, options: Mapping[str, Any], overrides: Sequence[str], count: int) -> None:
        self.options, self.overrides, self.count = options, overrides, count
        context = multiprocessing.get_context("spawn")
        self.barriers = {w: context.Barrier(w) for w in {s.workers for s in settings(options)}}
        self.outbox = context.Queue()
        self.inboxes = [context.Queue() for _ in range(count)] if count > 1 else []
        self.procs = [context.Process(target=worker, args=(i, options, overrides, self.barriers, box, self.outbox))
                      for i, box in enumerate(self.inboxes)]
        for proc in self.procs:
            proc.start()
        for _ in self.procs:
            self.outbox.get(timeout=BARRIER_TIMEOUT_S)

    def measure(self, setting: Setting) -> list[list[float] | str]:
        """Each of the setting's workers' step seconds (or error)."""
        if not self.procs:
            return [step_seconds(setting, self.options, self.overrides, self.barriers[1])]
        for box in self.inboxes[: setting.workers]:
            box.put(setting)
        got = dict(self.outbox.get(timeout=2 * BARRIER_TIMEOUT_S) for _ in range(setting.workers))
        return [got[i] for i in range(setting.workers)]

    def close(self) -> None:
        for box in self.inboxes:
            box.put(None)
        for proc in self.procs:
            proc.join()


def bench(options: Mapping[str, Any], overrides: Sequence[str]) -> list[Record]:
    started = time.perf_counter()
    device = device_of(options)
    todo = settings(options)
    mode = "compiled" if any(o.replace(" ", "") == "trainer.compile=true" for o in overrides) else "eager"
    images = table_images()
    pool = Workers(options, overrides, max(s.workers for s in todo))
    records: list[Record] = []
    left_out: list[str] = []
    took: dict[str, tuple[int, float]] = {}  # conv form -> (runs per step, seconds) of its last setting
    try:
        for setting in todo:
            spent = time.perf_counter() - started
            if options["budget"] and spent + expected_seconds(setting, took) > options["budget"]:
                left_out.append(setting.name)
            else:
                begun = time.perf_counter()
                results = pool.measure(setting)
                took[setting.conv] = (setting.runs * setting.workers, time.perf_counter() - begun)
                records.append(setting_record(setting, results, mode, device, images, int(options["batch"])))
            save(rank(records, left_out, images, options), options)
    finally:
        pool.close()
    return rank(records, left_out, images, options)


def setting_record(setting: Setting, results: list[list[float] | str], mode: str, device: torch.device,
                   images: int, batch: int) -> Record:
    """A setting's record from its workers' step seconds (or errors): images/s at the slowest
    worker's median step, Table 1's GPU-hours at that rate."""
    errors = [r for r in results if isinstance(r, str)]
    slowest = max(statistics.median(r) for r in results if not isinstance(r, str)) if not errors else None
    rate = setting.workers * setting.runs * batch / slowest if slowest else None
    return record(setting.name, mode, device, [slowest] if slowest else [float("nan")], "images per second",
                  ratio=None, **asdict(setting), images_per_second=rate,
                  table1_gpu_hours=images / rate / 3600 if rate else None, error=errors[0] if errors else None)


def expected_seconds(setting: Setting, took: Mapping[str, tuple[int, float]]) -> float:
    """The seconds ``setting`` is expected to take: those of the last measured setting of its
    convolution form (of the slowest form, before its own has been measured), scaled by its
    runs per step; 0 before anything was measured."""
    if not took:
        return 0.0
    runs, seconds = took.get(setting.conv) or max(took.values(), key=lambda t: t[1] / t[0])
    return seconds * setting.runs * setting.workers / runs


def save(records: list[Record], options: Mapping[str, Any]) -> None:
    """The records so far into ``out`` (JSON, stamped with the environment), as the finished
    bench writes them."""
    env = environment(device_of(options))
    text = json.dumps([{**r, "env": env} for r in records], indent=2, default=str)
    path = Path(str(options["out"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: f.write(text.encode()))


def rank(records: list[Record], left_out: list[str], images: int, options: Mapping[str, Any]) -> list[Record]:
    """Name the fastest setting (``best``), give each its images/s relative to it (``ratio``,
    below 1: slower), and write the markdown row beside ``out``; the records, and one that
    lists the settings left out, if any."""
    measured = [r for r in records if r["images_per_second"]]
    best = max(measured, key=lambda r: r["images_per_second"]) if measured else None
    for r in records:
        r["best"] = r is best
        r["ratio"] = r["images_per_second"] / best["images_per_second"] if r["images_per_second"] and best else None
    ranked = list(records)
    if left_out:
        ranked.append({"name": "left out (budget)", "mode": "", "seconds_median": None, "images_per_second": None,
                       "table1_gpu_hours": None, "ratio": None, "left_out": list(left_out), "table1_images": images})
    write_markdown(Path(str(options["out"])).with_suffix(".md"), ranked, best, device_of(options))
    return ranked


def faster_forms(records: list[Record]) -> list[str]:
    """Per setup (precision and layout), how the two convolution forms compare where both were
    measured at the same K and workers: the median of streams' images/s over grouped's, and
    the form that is faster."""
    rates = {(r["amp"], r["layout"], r["runs"], r["workers"], r["conv"]): r["images_per_second"]
             for r in records if r.get("images_per_second")}
    lines = []
    for amp, layout in dict.fromkeys((a, lay) for a, lay, *_ in rates):
        pairs = [(rates[a, lay, k, w, "streams"], rate) for (a, lay, k, w, conv), rate in rates.items()
                 if (a, lay) == (amp, layout) and conv == "grouped" and (a, lay, k, w, "streams") in rates]
        if pairs:
            ratio = statistics.median(s / g for s, g in pairs)
            lines.append(f"{amp} {layout}: {'streams' if ratio > 1 else 'grouped'} faster (streams / grouped "
                         f"images/s, median of {len(pairs)}: {ratio:.2f})")
    return lines


def write_markdown(path: Path, records: list[Record], best: Record | None, device: torch.device) -> None:
    """The row for docs/benchmarks.md (date, device, best setting, its images/s and projected
    Table 1 GPU-hours, the seed packs' for comparison) and the table of every setting."""
    env = environment(device)
    seeds = next((r for r in records if r.get("runs") == 10 and r.get("workers") == 1 and r["images_per_second"]), None)

    def hours(r: Record | None) -> str:
        return f"{r['table1_gpu_hours']:.2f}" if r and r.get("table1_gpu_hours") else "-"

    lines = ["| date | device | best setting | images/s | Table 1 GPU-hours | seed packs of 10, 1 worker |",
             "| --- | --- | --- | --- | --- | --- |",
             f"| {datetime.date.today().isoformat()} | {env['device_name']} | {best['name'] if best else '-'} | "
             f"{best['images_per_second']:,.0f} | {hours(best)} | {hours(seeds)} |" if best else
             f"| {datetime.date.today().isoformat()} | {env['device_name']} | - | - | - | - |", "",
             "| setting | images/s | Table 1 GPU-hours | relative to the best |", "| --- | --- | --- | --- |"]
    for r in records:
        if "left_out" in r:
            lines.append(f"\nleft out (budget): {', '.join(r['left_out'])}")
        else:
            rate = f"{r['images_per_second']:,.0f}" if r["images_per_second"] else (r.get("error") or "-")
            ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
            lines.append(f"| {r['name']} | {rate} | {hours(r)} | {ratio} |")
    lines += ["", *faster_forms(records)]
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))
