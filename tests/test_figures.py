"""The figure presets (CBN Figs. 2-3, 7 and 10, BNP Fig. 7) train at toy size, and ``bnexp plot``
draws each in the paper's layout; BNP's TensorFlow nets see pixels / 255."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import torch
from torchvision.transforms import v2

from bnexp.data import build_data
from bnexp.report.plot import draw
from bnexp.report.presets import load_preset
from bnexp.report.results import load_summaries
from bnexp.report.selection import preset_runs
from bnexp.studies.claims import NOT_RUN, TOO_FEW, Sample, compare
from tests.conftest import compose_cfg, run_cli

# One cell of each figure preset, and what its figure shows: the panels' titles (one per table
# column, or per layer), the y label of the first panel, a log axis or not.
FIGURES = {
    "cbn/amat": (["amat_mode=bn", "act=relu"], "variance of the stochastic gradient", True),
    "cbn/grad_norm": (["cbn_part=l2_division", "act=tanh"], "gradient norm", True),
    "cbn/eta_tau": (["act=relu"], "eta (across channels)", False),
    "bnp/fig7": (["norm=bnp_gn"], "training loss (dashed)", False),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", FIGURES)
def test_a_figure_preset_trains_at_toy_size_and_draws_its_figure(
        name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cell, ylabel, log = FIGURES[name]
    run = tmp_path / "results" / "cell"
    code, out = run_cli(["train", f"experiment={name}", "scale=quick", *cell, "trainer.device=cpu",
                         "trainer.max_steps=4", "trainer.eval_every=2", f"hydra.run.dir={run}"], capsys)
    assert code == 0, out
    p = load_preset(name, "quick", ["trainer.max_steps=4", "trainer.eval_every=2"])
    runs = preset_runs(p, load_summaries(run.parent), run.parent)
    assert list(runs["run_dir"]) == [str(run)] and list(runs["status"]) == ["completed"]
    fig = draw(p.layout, runs, note="scale=quick, toy")
    first = fig.axes[0]
    assert first.get_ylabel() == ylabel and (first.get_yscale() == "log") == log
    assert any(ax.lines for ax in fig.axes) and fig.get_suptitle().endswith("[scale=quick, toy]")
    plt.close(fig)
    code, out = run_cli(["plot", name, "scale=quick", "trainer.max_steps=4", "trainer.eval_every=2",
                         f"results={run.parent}", f"out={tmp_path / 'plots'}"], capsys)
    assert code == 0, out
    assert (tmp_path / "plots" / f"{name.replace('/', '_')}.png").stat().st_size > 1000


def test_bnp_tensorflow_nets_see_pixels_over_255_through_the_one_normalization() -> None:
    """``bnp/fc`` and ``bnp/cnn5`` set ``data.standardize=false``: the data set's mean 0 and std 1,
    so the one normalization step gives exactly torchvision's uint8 -> [0, 1] conversion; other
    presets standardize per channel with the training split's statistics."""
    raw = build_data(compose_cfg(["experiment=bnp/cnn5", "data=digits"]).data)
    assert raw.arrays is not None and raw.arrays.mean == (0.0,) * 3 and raw.arrays.std == (1.0,) * 3
    image, _ = raw.test[0]
    assert torch.equal(image, v2.ToDtype(torch.float32, scale=True)(raw.arrays.x_test[0]))
    assert compose_cfg(["experiment=bnp/fc"]).data.standardize is False
    standard = build_data(compose_cfg(["experiment=bnp/hessian", "data=digits"]).data)
    assert standard.arrays is not None and standard.arrays.mean != (0.0,) * 3
    assert "standardize" not in compose_cfg(["experiment=bnp/hessian"]).data


def test_a_claim_whose_cells_ran_with_one_seed_says_too_few_seeds_not_not_run() -> None:
    assert compare("c", ("A", "B"), Sample([90.0]), Sample([95.0]), "beats").verdict == TOO_FEW
    assert compare("c", ("A", "B"), Sample([90.0, 91.0]), Sample(), "beats").verdict == NOT_RUN
