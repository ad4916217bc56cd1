"""The published numbers (``bnexp/reference/*.csv``), and the BNP learning rates behind ``${bnp_lr:...}``."""

from __future__ import annotations

import csv
import io
from functools import lru_cache
from importlib import resources
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

# norm.name -> the method name the BNP paper's tables use
BNP_METHODS = {"none": "vanilla"}


def _text(name: str) -> str:
    return resources.files("bnexp.reference").joinpath(name).read_text()


@lru_cache(maxsize=None)
def published() -> pd.DataFrame:
    """published_results.csv: one row per cell, all text but ``mean``/``std`` and ``runs``
    (the paper's trials per cell), NaN where blank."""
    import pandas as pd

    frame = pd.read_csv(io.StringIO(_text("published_results.csv")), dtype=str, keep_default_na=False)
    for col in ("mean", "std", "runs"):
        frame[col] = pd.to_numeric(frame[col].replace("", None))
    return frame


@lru_cache(maxsize=None)
def bnp_learning_rates() -> dict[tuple[str, str, int, str], float | None]:
    """(model, dataset, batch size, method) -> the BNP paper's tuned lr, None where N/A."""
    rows = csv.DictReader(io.StringIO(_text("bnp_best_learning_rates.csv")))
    return {
        (r["model"], r["dataset"], int(r["batch_size"]), r["method"]): None if r["best_lr"] == "N/A" else float(r["best_lr"])
        for r in rows
    }


def bnp_lr(model: str, dataset: str, batch_size: int, norm: str) -> float | None:
    """The learning rate the BNP paper tuned for this cell; None where it ran no such model."""
    method = BNP_METHODS.get(norm, norm)
    return bnp_learning_rates().get((model, dataset, int(batch_size), method))

