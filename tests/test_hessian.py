"""The Hessian study: exact Hessians, condition numbers, BNP's preconditioning, the command."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from bnexp.nn import BNPLayer
from bnexp.probes.hessian import condition_number, nonzero_spectrum, output_neuron_hessian
from tests.conftest import run_cli

EPS64 = np.finfo(np.float64).eps


def _layer(n_in: int, n_out: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n_out, n_in, generator=g, dtype=torch.float64)
    return weight, torch.randn(n_out, generator=g, dtype=torch.float64)


def _extended(h: torch.Tensor) -> np.ndarray:
    """[1, h_j] per row: the inputs of [b_n, w_n]."""
    return np.hstack([np.ones((h.shape[0], 1)), h.numpy()])


def test_hessian_of_a_quadratic_loss_is_the_gram_matrix() -> None:
    h = torch.randn(8, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    weight, bias = _layer(4, 3, 1)
    got = output_neuron_hessian(h, weight, bias, neuron=1, loss=lambda z: 0.5 * z[:, 1].square().mean())
    hat = _extended(h)
    np.testing.assert_allclose(got.numpy(), hat.T @ hat / 8, rtol=1e-12, atol=1e-14)


def test_hessian_of_the_cross_entropy_matches_its_closed_form() -> None:
    h = torch.randn(10, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    weight, bias = _layer(4, 3, 3)
    got = output_neuron_hessian(h, weight, bias, neuron=0)
    p = torch.softmax(h @ weight.T + bias, dim=1)[:, 0].numpy()
    hat = _extended(h)
    expected = hat.T @ np.diag(p * (1 - p) / 10) @ hat  # BNP Prop. 2: H^T S H, S = diag(L'') / N
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-10, atol=1e-14)
    labels = torch.randint(3, (10,), generator=torch.Generator().manual_seed(4))
    ce = output_neuron_hessian(h, weight, bias, 0, loss=lambda z: nn.functional.cross_entropy(z, labels))
    torch.testing.assert_close(ce, got, rtol=1e-10, atol=1e-14)


def test_condition_numbers_equal_numpys() -> None:
    rng = np.random.default_rng(5)
    a = rng.normal(size=(6, 6))
    spd = a @ a.T + 0.1 * np.eye(6)
    assert condition_number(torch.from_numpy(spd)) == pytest.approx(np.linalg.cond(spd), rel=1e-9)
    low = rng.normal(size=(7, 3))
    singular = low @ np.diag([1.0, 10.0, 1000.0]) @ low.T  # rank 3 of 7
    sv = np.linalg.svd(singular, compute_uv=False)
    kept = sv[sv > 7 * EPS64 * sv[0]]
    assert len(kept) == np.linalg.matrix_rank(singular) == 3
    assert nonzero_spectrum(torch.from_numpy(singular)).numel() == 3
    assert condition_number(torch.from_numpy(singular)) == pytest.approx(kept[0] / kept[-1], rel=1e-9)


def test_bnp_preconditioning_lowers_the_condition_number_of_badly_scaled_inputs() -> None:
    g = torch.Generator().manual_seed(6)
    scales = torch.logspace(0, 2, 10, dtype=torch.float64)  # input features from 1x to 100x
    h = (torch.randn(60, 10, generator=g, dtype=torch.float64) + 3.0) * scales
    linear = nn.Linear(10, 4).double()
    nn.init.zeros_(linear.weight)  # unsaturated softmax: H is a multiple of the inputs' Gram matrix
    stats = BNPLayer("fc", linear, rho=0.0, eps1=1e-2, eps2=1e-4)  # rho = 0: this batch's statistics
    stats.observe(h)
    hessian = output_neuron_hessian(h, linear.weight, linear.bias, 0)
    p = stats.matrix()
    assert condition_number(p.T @ hessian @ p) < condition_number(hessian) / 100


def test_hessian_command_writes_csv_and_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["hessian", f"out={tmp_path}", "data=synthetic", "data.image_size=8", "data.train_size=120",
            "data.test_size=32", "model.width=6", "trainer.max_steps=3", "trainer.device=cpu", "probe.hessian.every=2"]
    code, out = run_cli(args, capsys)
    assert code == 0, out
    assert (tmp_path / "hessian.csv").read_text().splitlines()[0] == \
        "norm,step,kappa_hessian,kappa_preconditioned,kappa_d,rank_hessian"  # as docs/instruments/hessian.md says
    table = pd.read_csv(tmp_path / "hessian.csv")
    assert table["rank_hessian"].dtype == np.int64
    assert table[["norm", "step"]].values.tolist() == [["none", 0], ["none", 2], ["bnp", 0], ["bnp", 2]]
    assert (table["kappa_hessian"] >= 1).all() and (table["rank_hessian"] <= 7).all()  # [b, w]: 6 + 1
    assert (tmp_path / "hessian.png").stat().st_size > 0
    code, out = run_cli(args, capsys)  # a second call reuses the finished runs
    assert code == 0 and out.count("(reused)") == 2


def test_hessian_on_data_without_a_published_lr_needs_optim_lr(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    base = ["hessian", f"out={tmp_path}", "data=digits", "data.image_size=8", "data.channels=1", "model.width=6",
            "trainer.max_steps=2", "trainer.device=cpu", "probe.hessian.every=2"]
    code, out = run_cli(base, capsys)
    assert code == 2 and "no learning rate for data=digits: set optim.lr" in out
    assert not (tmp_path / "none").exists()  # refused before any training
    code, out = run_cli([*base, "optim.lr=0.05"], capsys)
    assert code == 0, out
