"""Probes: exact values on hand-built cases, and no effect on the training trajectory."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from bnexp.engine.trainer import train
from bnexp.nn import CBN2d, POPNorm2d
from bnexp.probes import read_probes
from bnexp.probes.callback import PROBES, ProbesCallback, ProbeWriter, probes_callback
from bnexp.probes.eta_tau import QUANTILES, AmatRatio, EtaTau, quantity_name
from bnexp.probes.gradients import GradNorm, gradient_variance
from tests.conftest import TINY, compose_cfg, read_metrics

RUN = [*TINY, "trainer.max_steps=5", "trainer.eval_every=2", "trainer.eval_unit=step"]


def test_grad_var_equals_least_squares_closed_form() -> None:
    g = torch.Generator().manual_seed(0)
    k, n, d = 6, 7, 5
    xs = torch.randn(k, n, d, generator=g, dtype=torch.float64)
    ys = torch.randn(k, n, generator=g, dtype=torch.float64)
    model = nn.Sequential(nn.Linear(d, 1, bias=False)).double()

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return 0.5 * (out.squeeze(1) - y).square().mean()

    got = gradient_variance(model, list(zip(xs, ys)), loss, list(model.named_parameters()))

    w = model[0].weight.detach().numpy()[0]
    x, y = xs.numpy(), ys.numpy()
    grads = np.stack([((x[i] @ w - y[i])[:, None] * x[i]).mean(axis=0) for i in range(k)])  # mean_j r_j x_j
    expected = ((grads - grads.mean(axis=0)) ** 2).sum(axis=1).mean()
    assert got == {"0.weight": pytest.approx(expected, rel=1e-12)}


def test_grad_norm_equals_numpys_norm_of_the_gradients() -> None:
    g = torch.Generator().manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2, bias=False))
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 10
    probe = GradNorm({"every": 1}, None)
    probe.after_backward(SimpleNamespace(model=model, step=0, total_steps=1))
    got = {layer: value for step, _, layer, quantity, value in probe.drain() if (step, quantity) == (0, "norm")}

    grads = {name: p.grad.double().numpy().ravel() for name, p in model.named_parameters()}
    expected = {"0": np.linalg.norm(np.concatenate([grads["0.weight"], grads["0.bias"]])),
                "2": np.linalg.norm(grads["2.weight"]), "all": np.linalg.norm(np.concatenate(list(grads.values())))}
    assert got == pytest.approx(expected, rel=1e-12)


def test_grad_norm_under_bnp_reads_the_raw_gradient(tmp_path: Path) -> None:
    """BNP changes no forward pass, so its first raw gradient is that of the same network
    without BNP (norm=none with biases, the same initial weights); the probe must see that
    one, not BNP's rewrite: probes come before the methods in the trainer's callbacks."""
    norms = {}
    for name, norm in (("bnp", ["norm=bnp"]), ("plain", ["norm=none", "norm.op_bias=true"])):
        train(compose_cfg([*RUN, "model=mlp2x100", *norm, "probes=[grad_norm]", "trainer.max_steps=1"]),
              tmp_path / name)
        rows = read_probes(tmp_path / name).query("step == 0 and layer == 'all' and quantity == 'norm'")
        norms[name] = float(rows["value"].iloc[0])
    assert norms["bnp"] == norms["plain"]
    weights = {name: torch.load(tmp_path / name / "checkpoint.pt", weights_only=False)["model"] for name in norms}
    assert not torch.equal(weights["bnp"]["fc.op.weight"], weights["plain"]["fc.op.weight"])  # BNP rewrote the step


@pytest.mark.parametrize("amat", [True, False])
def test_eta_tau_quantiles_equal_the_formula(amat: bool) -> None:
    g = torch.Generator().manual_seed(1)
    layer = (CBN2d(6, rho=2.0) if amat else POPNorm2d(6, rho=2.0)).double()
    with torch.no_grad():
        layer.weight.copy_(torch.rand(6, generator=g) + 0.5)
        layer.bias.copy_(torch.randn(6, generator=g))
        if amat:
            layer.amat_mean = torch.randn(6, generator=g, dtype=torch.float64) + 3.0
            layer.amat_steps.fill_(4)
        else:
            layer.running_mean.copy_(torch.randn(6, generator=g) + 3.0)
    mu_a = (layer.amat_mean if amat else layer.running_mean).double().numpy().copy()
    model = nn.Sequential(layer)
    x = torch.randn(5, 6, 3, 3, generator=g, dtype=torch.float64) * 2 + 1
    probe = EtaTau({"every": 1}, None)
    state = SimpleNamespace(model=model, step=0, total_steps=3)
    probe.on_train_start(state)
    probe.before_step(state)
    if amat:
        layer.set_learning_rate(0.05)
    model(x)
    got = {(layer_name, q): v for _, _, layer_name, q, v in probe.drain()}

    xn = x.double().numpy()
    beta, gamma = layer.bias.detach().double().numpy(), layer.weight.detach().double().numpy()
    mu_b = xn.mean(axis=(0, 2, 3))
    x1 = xn - mu_b[None, :, None, None] + beta[None, :, None, None]
    sigma_b = np.sqrt((x1**2).mean(axis=(0, 2, 3)) + layer.eps)
    if amat:  # eta_k = 1 - 10 * 0.05: mu_A averages this batch in, then r_mu = mu_A / mu_B is clipped at 3
        ratio = (0.5 * mu_a + 0.5 * mu_b) / mu_b
        assert (np.abs(ratio) > 3).any() and (np.abs(ratio) < 3).any()  # the clip binds on some channels only
        mu_a = np.clip(ratio, -3.0, 3.0) * mu_b
    expected = {"eta": (mu_b - beta) / mu_a, "tau": gamma / (2.0 * sigma_b)}
    assert len(got) == 2 * len(QUANTILES)
    for prefix, values in expected.items():
        for q, value in zip(QUANTILES, np.quantile(values, QUANTILES)):
            assert got[("0", quantity_name(prefix, q))] == pytest.approx(value, rel=1e-9)


def test_amat_probe_reports_the_ratio_the_forward_uses() -> None:
    """max |r_mu| with r_mu = clip((eta mu_A + (1 - eta) mu_B) / mu_B, -3, 3), and min |mu_B|."""
    g = torch.Generator().manual_seed(2)
    layer = CBN2d(5).double()
    layer.amat_mean = torch.tensor([1.0, -2.0, 0.5, 3.0, 0.2], dtype=torch.float64)
    layer.amat_steps.fill_(4)
    x = torch.randn(6, 5, 3, 3, generator=g, dtype=torch.float64) + torch.tensor([1.0, -1.0, 0.05, 2.0, 0.3],
                                                                                  dtype=torch.float64).view(1, 5, 1, 1)
    mu_b = x.mean(dim=(0, 2, 3))
    ratio = (0.5 * layer.amat_mean + 0.5 * mu_b) / mu_b  # eta = 1 - 10 * 0.05
    assert ratio.abs().max() > 3  # the bound binds on this batch
    probe = AmatRatio({"every": 1}, None)
    state = SimpleNamespace(model=nn.Sequential(layer), step=0, total_steps=3)
    probe.on_train_start(state)
    probe.before_step(state)
    layer.set_learning_rate(0.05)
    layer(x)
    got = {quantity: value for _, _, _, quantity, value in probe.drain()}
    assert got == pytest.approx({"r_mu_max_abs": ratio.clamp(-3, 3).abs().max().item(),
                                 "mu_b_min_abs": mu_b.abs().min().item()}, rel=1e-12)


def _trajectory(run: Path) -> tuple[list[dict[str, str]], dict[str, torch.Tensor]]:
    """metrics.csv without its wall-clock column, and the final model state."""
    rows = [{k: v for k, v in r.items() if k != "seconds"} for r in read_metrics(run / "metrics.csv")]
    return rows, torch.load(run / "checkpoint.pt", weights_only=False)["model"]


SETUPS = {
    "cbn": ["norm=cbn", "optim.lr=0.02"],  # AMAT buffers, decoupled layers (eta_tau)
    "bn": [],  # running statistics, scale-invariant weights
    "bnp": ["model=mlp2x100", "norm=bnp"],  # BNP statistics in forward hooks, the hessian probe
}
CASES = [("grad_norm", "bnp"), ("grad_var", "cbn"), ("grad_var", "bnp"), ("loss", "cbn"), ("eta_tau", "cbn"),
         ("amat", "cbn"), ("weights", "bn"), ("time", "bn"), ("hessian", "bnp")]


def test_every_probe_is_checked_for_leaving_training_unchanged() -> None:
    assert {probe for probe, _ in CASES} == set(PROBES.names())


@pytest.fixture(scope="module")
def baselines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("baseline")
    for name, overrides in SETUPS.items():
        summary = train(compose_cfg([*RUN, *overrides]), root / name)
        assert summary["status"] == "completed"
    return {name: root / name for name in SETUPS}


@pytest.mark.xdist_group("probe_baselines")  # in one worker: the baselines train once
@pytest.mark.parametrize(("probe", "setup"), CASES)
def test_probe_leaves_training_unchanged(probe: str, setup: str, baselines: dict[str, Path], tmp_path: Path) -> None:
    every = [f"probe.{probe}.every=2"] + ([f"probe.{probe}.k=3"] if probe in ("grad_var", "loss") else [])
    train(compose_cfg([*RUN, *SETUPS[setup], f"probes=[{probe}]", *every]), tmp_path)
    rows, weights = _trajectory(tmp_path)
    base_rows, base_weights = _trajectory(baselines[setup])
    assert rows == base_rows
    assert weights.keys() == base_weights.keys()
    assert all(torch.equal(weights[k], base_weights[k]) for k in weights)
    measured = read_probes(tmp_path)
    assert len(measured) and set(measured["probe"]) == {probe}


def test_schedule_and_layout(tmp_path: Path) -> None:
    train(compose_cfg([*RUN, "probes=[grad_norm,loss]", "probe.grad_norm.every=3", "probe.loss.every=2"]), tmp_path)
    frame = read_probes(tmp_path)
    assert list(frame.columns) == ["step", "probe", "layer", "quantity", "value"]
    norms = frame[(frame["probe"] == "grad_norm") & (frame["layer"] == "all")]
    assert norms["step"].tolist() == [0, 3, 4]  # the schedule, then the last step
    assert frame[frame["probe"] == "loss"]["step"].tolist() == [0, 2, 4, 5]  # ... then the final weights
    wide = frame.pivot_table(index="step", columns=["probe", "layer", "quantity"], values="value")
    assert ("loss", "all", "loss") in wide.columns


def test_resume_cuts_rows_written_after_the_checkpoint(tmp_path: Path) -> None:
    cfg = compose_cfg([*RUN, "probes=[grad_norm]"])
    callback = probes_callback(cfg)
    assert isinstance(callback, ProbesCallback)
    writer = ProbeWriter(tmp_path / "probes.csv")
    writer.append([(0, "grad_norm", "all", "norm", 1.0)])
    checkpoint_length = writer.length()
    writer.append([(1, "grad_norm", "all", "norm", 2.0)])
    callback.writer = writer
    callback.load_state_dict({"csv_length": checkpoint_length, "probes": {}})
    writer.append([(1, "grad_norm", "all", "norm", 3.0)])
    assert read_probes(tmp_path)["value"].tolist() == [1.0, 3.0]


def test_unknown_probe_is_a_config_error(tmp_path: Path) -> None:
    from bnexp.support.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown probe 'nope'"):
        train(compose_cfg([*RUN, "probes=[nope]"]), tmp_path)


def test_plot_draws_every_probe(tmp_path: Path) -> None:
    from bnexp.probes.plot import plot_results

    probes = "probes=[grad_norm,grad_var,weights,time,loss]"
    train(compose_cfg([*RUN, probes, "probe.grad_var.k=2"]), tmp_path / "r" / "bn")
    train(compose_cfg([*RUN, *SETUPS["cbn"], "probes=[eta_tau]", "probe.eta_tau.every=2"]), tmp_path / "r" / "cbn")
    paths = plot_results(tmp_path / "r", tmp_path / "plots")
    names = {"grad_norm", "grad_var", "weights", "time", "loss", "eta_tau_cbn"}
    assert sorted(p.name for p in paths) == sorted(f"probe_{n}.png" for n in names)
    assert all(p.stat().st_size > 0 for p in paths)
