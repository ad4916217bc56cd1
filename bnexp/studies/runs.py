"""In-process runs for the study commands (``bnexp lrsearch``, ``bnexp hessian``): compose a
config from overrides, train it in a run directory of the study, reuse a finished run."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from hydra import compose
from omegaconf import DictConfig

from bnexp.app.compose import hydra_session
from bnexp.app.sweep import skip_reason
from bnexp.engine.checkpoint import read_config
from bnexp.engine.config import check_published_lr, lr_not_applicable
from bnexp.engine.identity import differences, fingerprint
from bnexp.engine.trainer import train
from bnexp.support.errors import ConfigError, OtherRunThere
from bnexp.support.options import exit_on_error, split_options
from bnexp.support.runinfo import read_run_json
from bnexp.support.runlock import RunLock

T = TypeVar("T")


def compose_config(overrides: Sequence[str]) -> DictConfig:
    """The config ``bnexp train`` would run with these overrides."""
    with hydra_session():
        return compose("train", list(overrides))


def list_option(text: str, convert: Callable[[str], T]) -> list[T]:
    """``[a,b,c]`` or ``a,b,c`` as a list of converted items."""
    items = [item.strip() for item in text.strip().strip("[]").split(",") if item.strip()]
    try:
        return [convert(item) for item in items]
    except ValueError as err:
        raise ConfigError(f"cannot read {text!r} as a list: {err}") from None


def run_or_reuse(cfg: DictConfig, run_dir: Path) -> tuple[dict[str, Any], bool]:
    """Train ``cfg`` in ``run_dir`` unless a finished run of the same config is there.

    Returns the run's summary and whether it was reused. As in a sweep
    (:func:`bnexp.app.sweep.skip_reason`), a completed or diverged run is reused unless
    ``trainer.resume=never``, and an unfinished one resumes from its checkpoint. A directory
    holding another config (by :func:`bnexp.engine.identity.fingerprint`) is an error (the study's
    results would mix two settings). The run's lock is held throughout.
    """
    check_published_lr(cfg)  # before a study starts training on a data set the paper never used
    saved = read_config(run_dir / "config.yaml") if (run_dir / "config.yaml").is_file() else None
    if saved is not None and fingerprint(saved) != fingerprint(cfg):
        raise OtherRunThere(f"{run_dir} holds a run with another config ({differences(saved, cfg)}); "
                            "use another out= directory or remove it")
    with RunLock(run_dir):
        reason = skip_reason(cfg, run_dir)
        if reason is None:
            return train(cfg, run_dir), False
    if lr_not_applicable(cfg):
        raise ConfigError(f"cannot train {run_dir}: {reason}; set optim.lr")
    return read_run_json(run_dir / "summary.json"), True


def run_command(main: Callable[[dict[str, str], list[str]], None], args: list[str], defaults: dict[str, str]) -> None:
    """Split the arguments, run ``main(options, overrides)`` with the options over their
    defaults, and end with bnexp's exit code on a user error."""

    def body() -> None:
        given, overrides = split_options(args, defaults)
        main({**defaults, **given}, overrides)

    exit_on_error(body)
