"""``bnexp eval RUN [data=NAME] [data.KEY=VALUE ...] [split=test|train]``: a finished run's
final weights evaluated on a data set, written to ``eval.json`` beside its summary.

The run's model is rebuilt from its ``config.yaml`` and loads its ``checkpoint.pt``
(weights only). Without ``data=`` it is evaluated on its own data set; ``data=NAME`` (and
``data.*`` overrides) composes another one, which must have the run's number of classes
and image shape. ``split=train`` evaluates the training images without augmentation.
``eval.json`` holds one entry per ``<data>/<split>`` (``<data>(<data.* overrides>)/<split>``
when some are given): loss, top-1 (and top-5 with more
than 5 classes), the images counted, the checkpoint's step, and versions; options
``device`` (auto | cpu | cuda) and ``batch`` (the evaluation batch, default the data
config's ``eval_batch_size``).
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict
from torch.utils.data import DataLoader

from bnexp.bench.common import compose_train
from bnexp.data import build_data
from bnexp.engine import checkpoint
from bnexp.engine.schema import DEVICES
from bnexp.engine.trainer import evaluate
from bnexp.models import build_model
from bnexp.support.errors import ConfigError, unknown_choice
from bnexp.support.options import exit_on_error, output_errors, print_warning, run_dir_argument, split_options
from bnexp.support.runinfo import read_run_json, resolve_device, version_stamp, write_json

SPLITS = ("test", "train")
OPTIONS = {"split": "test", "device": "auto", "batch": "0"}
EVAL_FILE = "eval.json"


def data_config(run_cfg: DictConfig, overrides: list[str], split: str) -> DictConfig:
    """The run's data config, or the one ``data=...`` / ``data.*=...`` overrides compose;
    without augmentation for ``split=train``."""
    bad = [o for o in overrides if not o.startswith(("data=", "data."))]
    if bad:
        raise ConfigError(f"bnexp eval: {bad[0]!r} is not valid here: give data=NAME, data.KEY=VALUE, "
                          f"or the options {', '.join(OPTIONS)}")
    if any(o.startswith("data=") for o in overrides):
        cfg = compose_train(overrides).data
    else:
        cfg = run_cfg.data.copy()
        for o in overrides:
            key, _, value = o.partition("=")
            OmegaConf.update(cfg, key.removeprefix("data."), OmegaConf.create({"v": value}).v, merge=False)
    if split == "train" and "augment" in cfg:
        with open_dict(cfg):
            cfg.augment = False
    return cfg


def evaluate_run(run_dir: Path, overrides: list[str], split: str = "test", device: str = "auto",
                 batch: int = 0) -> dict[str, Any]:
    """Evaluate ``run_dir``'s final weights; the entry written to its eval.json."""
    if split not in SPLITS:
        raise unknown_choice("split", split, SPLITS)
    if device not in DEVICES:
        raise unknown_choice("device", device, DEVICES)
    run_cfg, payload = checkpoint.finished_run(run_dir, "eval")
    data_cfg = data_config(run_cfg, overrides, split)
    bundle = build_data(data_cfg)
    model = build_model(run_cfg.model, run_cfg.norm, run_cfg.act.name, bundle.spec)
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as err:
        raise ConfigError(f"bnexp eval: data.name={data_cfg.name} does not fit the run's model ({bundle.spec}): "
                          f"{str(err).splitlines()[1].strip()}") from err
    target = resolve_device(device)
    images = bundle.test if split == "test" else bundle.train
    loader = DataLoader(images, batch_size=batch or int(data_cfg.get("eval_batch_size", 500)))
    result = evaluate(model.to(target), loader, target, bundle.spec.num_classes)[0]
    entry = {**result, "images": len(images), "data": data_cfg.name, "split": split, "step": payload["step"],
             "checkpoint": str(run_dir / checkpoint.FINAL), "device": str(target),
             "evaluated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             **version_stamp()}
    path = run_dir / EVAL_FILE
    changed = [o for o in overrides if o.startswith("data.")]
    with output_errors(f"bnexp eval: cannot write {EVAL_FILE} in the run folder {run_dir}", "make the folder "
                       "writable (nothing was changed there)"):
        entries = earlier_entries(path)
        entries[f"{data_cfg.name}{'(' + ','.join(changed) + ')' if changed else ''}/{split}"] = entry
        write_json(path, entries)
    return entry


def earlier_entries(path: Path) -> dict[str, Any]:
    """The entries of the run's eval.json, if it has one. A damaged one (bnexp's own output,
    so it should not stop a new evaluation) is renamed to the first free
    ``eval.json.damaged[-N]`` beside it, with a warning: the new file starts empty, and
    nothing is lost."""
    if not path.is_file():
        return {}
    try:
        return read_run_json(path)
    except ConfigError as err:
        kept = path.with_name(f"{path.name}.damaged")
        copies = 1
        while kept.exists():
            copies += 1
            kept = path.with_name(f"{path.name}.damaged-{copies}")
        path.rename(kept)
        print_warning(f"{err}; kept as {kept.name}, and a new {path.name} started")
        return {}


def command(args: list[str]) -> None:
    """``bnexp eval RUN [data=...] [split=test] [device=auto] [batch=N]``."""
    def body() -> None:
        run_dir = run_dir_argument(args, "bnexp eval RUN_DIR [data=NAME] [data.KEY=VALUE ...] [split=test|train] "
                                         "[device=auto] [batch=N]")
        options, overrides = split_options(args[1:], OPTIONS)
        opts = {**OPTIONS, **options}
        if not opts["batch"].isdigit():
            raise ConfigError(f"batch={opts['batch']!r} is not valid: use a whole number (0: the data config's)")
        entry = evaluate_run(run_dir, overrides, opts["split"], opts["device"], int(opts["batch"]))
        top5 = f", top-5 {entry['test_top5']:.2f}%" if "test_top5" in entry else ""
        print(f"{args[0]}: {entry['data']}/{entry['split']}, {entry['images']} images: loss {entry['test_loss']:.4f}, "
              f"top-1 {entry['test_acc']:.2f}%{top5} (written to {Path(args[0]) / EVAL_FILE})")

    exit_on_error(body)
