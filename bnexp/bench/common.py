"""What every ``bnexp bench`` subcommand shares: options, timing, records and output.

Timing runs each case ``number`` times back to back between two device synchronizations
and divides; that block is repeated ``reps`` times after ``warmup`` untimed calls (which
absorb compilation, autotuning and lazy initialization). The blocks of the cases that are
compared are interleaved (unless a case keeps working in the background), so a noisy
spell on a shared machine slows them all alike; a ratio is the median over repetitions
of the per-repetition ratio.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import pandas as pd
import torch
import torchvision
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig

from bnexp.app.compose import config_dir, prepare_config_tree
from bnexp.support.errors import ConfigError
from bnexp.support.options import split_options
from bnexp.support.runinfo import atomic_write, resolve_device

MODES = ("eager", "compiled")
# Options every subcommand takes, with their defaults; each subcommand adds its own.
# threads: intra-op CPU threads (0 keeps torch's default; 1 is steadier on a shared machine).
COMMON: dict[str, Any] = {"reps": 5, "warmup": 3, "device": "auto", "threads": 0}
MINIMA = {"reps": 1, "number": 1, "warmup": 0, "threads": 0}  # the smallest valid value of integer options
# Every compiled case is its own module object, and torch.compile caches per object, so a
# benchmark needs more cache entries per function than torch's default limit of 8.
RECOMPILE_LIMIT = 256

Record = dict[str, Any]


def parse(args: Sequence[str], defaults: Mapping[str, Any],
          overrides_ok: bool = False) -> tuple[dict[str, Any], list[str]]:
    """``key=value`` options typed like their defaults (tuples: comma lists), plus Hydra overrides.

    Keys that are not options are Hydra overrides, accepted only where ``overrides_ok``.
    """
    given, overrides = split_options(args, defaults)
    if overrides and not overrides_ok:
        raise ConfigError(f"unknown option {overrides[0].partition('=')[0]!r}; options: {', '.join(defaults)}")
    options = {**defaults, **{key: typed(key, text, defaults[key]) for key, text in given.items()}}
    for key, least in MINIMA.items():
        if key in options and options[key] < least:
            raise ConfigError(f"{key}={options[key]} is not valid: {key} must be an integer >= {least}")
    bad = [m for m in options.get("modes", ()) if m not in MODES]
    if bad:
        raise ConfigError(f"unknown mode {bad[0]!r}; valid modes: {', '.join(MODES)}")
    return options, overrides


def typed(key: str, text: str, default: Any) -> Any:
    """``text`` converted to the type of ``default``."""
    if isinstance(default, bool):
        return text.lower() in ("true", "1", "yes")
    if isinstance(default, tuple):
        return tuple(v for v in text.split(",") if v)
    try:
        return type(default)(text)
    except ValueError as err:
        raise ConfigError(f"{key}={text!r} is not valid: expected a {type(default).__name__}") from err


def norm_presets() -> list[str]:
    """The ``norm`` presets of bnexp's config tree (``configs/norm/*.yaml``)."""
    return sorted(p.stem for p in (config_dir() / "norm").glob("*.yaml"))


def compose_train(overrides: Sequence[str]) -> DictConfig:
    """The config ``bnexp train`` would run with these overrides."""
    prepare_config_tree()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        try:
            return compose("train", list(overrides))
        except HydraException as err:
            raise ConfigError(str(err).replace("\n", " ")) from err


def device_of(options: Mapping[str, Any]) -> torch.device:
    return resolve_device(options["device"])


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn: Callable[[], Any], number: int, device: torch.device,
                     clock: Callable[[], float] = time.perf_counter) -> float:
    """Mean seconds of ``fn`` over ``number`` back-to-back calls, device work included
    (``clock``: wall time, or ``time.process_time`` for this process's CPU time)."""
    synchronize(device)
    start = clock()
    for _ in range(number):
        fn()
    synchronize(device)
    return (clock() - start) / number


def measure(cases: Mapping[str, Callable[[], Any]], reps: int, number: int, warmup: int, device: torch.device,
            interleave: bool = True, clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds per call of every case, ``reps`` blocks each, after ``warmup`` calls.

    ``interleave=False`` times all blocks of one case before the next case (for cases
    that leave work running in the background, such as DataLoader workers); ``clock`` as
    :func:`seconds_per_call`.
    """
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    synchronize(device)
    items = list(cases.items())
    order = [item for _ in range(reps) for item in items] if interleave else [i for i in items for _ in range(reps)]
    times: dict[str, list[float]] = {name: [] for name in cases}
    for name, fn in order:
        times[name].append(seconds_per_call(fn, number, device, clock))
    return times


class Budget:
    """Seconds left of a bench's budget (0: unlimited) since it started."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start = seconds, time.perf_counter()

    def allows(self, expected: float) -> bool:
        """Whether a case expected to take ``expected`` seconds still fits."""
        return not self.seconds or time.perf_counter() - self.start + expected <= self.seconds


def iqr(values: Sequence[float]) -> float:
    """Interquartile range (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q3 - q1


def environment(device: torch.device) -> dict[str, Any]:
    """Date, machine and library versions, stored with every record."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = cpu_model()
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "device_name": name,
            "host": platform.node(), "threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "torchvision": torchvision.__version__, "cuda": torch.version.cuda}


def cpu_model() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``), else what platform reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def record(name: str, mode: str, device: torch.device, times: Sequence[float], baseline: str,
           base_times: Sequence[float] | None = None, ratio: float | None = None, **fields: Any) -> Record:
    """One result: median and spread of ``times`` and the ratio to the baseline.

    The ratio is the median of the per-repetition ratios to ``base_times`` when given,
    else ``ratio`` (a comparison the caller made itself).
    """
    ratios = [t / b for t, b in zip(times, base_times or ())]
    return {
        "name": name, "mode": mode, "device": device.type, "seconds_median": statistics.median(times),
        "seconds_iqr": iqr(times), "reps": len(times), "baseline": baseline,
        "ratio": statistics.median(ratios) if ratios else ratio, "ratio_iqr": iqr(ratios) if ratios else None,
        **fields,
    }


def finish(records: list[Record], out: str, columns: Sequence[str], device: torch.device) -> None:
    """Stamp the records with the environment, print them as a table and write ``out`` (JSON)."""
    env = environment(device)
    for r in records:
        r["env"] = env
    table = pd.DataFrame(records, columns=list(columns))
    print(f"{env['device_name']} ({device.type}), torch {env['torch']}, {env['threads']} threads, {env['date']}")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(records, indent=2, default=str)
    atomic_write(path, lambda f: f.write(text.encode()))
    print(f"wrote {path}", file=sys.stderr)
