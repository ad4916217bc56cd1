"""BNP (METHODS.md section 4): gradients against explicit (1/q2) P P^T products."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from bnexp.nn import BNP, preconditioner_matrix

DT = torch.float64
RHO = 0.9
EPS1, EPS2 = 1e-2, 1e-4


def shifted(shape, seed):
    """Random input whose features/channels have clearly different means and spreads."""
    g = torch.Generator().manual_seed(seed)
    c = shape[1]
    view = (1, c) + (1,) * (len(shape) - 2)
    spread = torch.linspace(0.3, 2.0, c, dtype=DT).view(view)
    centre = torch.linspace(-1.5, 2.5, c, dtype=DT).view(view)
    return torch.randn(shape, generator=g, dtype=DT) * spread + centre


def track(batches, rho):
    """The running statistics of METHODS.md section 4, feature by feature, written out."""
    c = batches[0].shape[1]
    mu, sigma2 = [0.0] * c, [1.0] * c
    for x in batches:
        for j in range(c):
            h = x[:, j].flatten()
            if h.numel() == 1:
                mean, var = float(h[0]), (float(h[0]) - mu[j]) ** 2
            else:
                mean = float(h.sum()) / h.numel()
                var = float(((h - mean) ** 2).sum()) / h.numel()
            mu[j] = rho * mu[j] + (1 - rho) * mean
            sigma2[j] = rho * sigma2[j] + (1 - rho) * var
    return mu, sigma2


def explicit_p(mu, s2):
    """P = [[1, -mu^T], [0, I]] diag(1, 1/sqrt(s2)), entry by entry."""
    n = len(mu)
    p = torch.zeros(n + 1, n + 1, dtype=DT)
    p[0, 0] = 1.0
    for j in range(n):
        p[0, 1 + j] = -mu[j] / math.sqrt(s2[j])
        p[1 + j, 1 + j] = 1.0 / math.sqrt(s2[j])
    return p


def input_channel(layer, i, position):
    """The input channel that entry ``position`` of ``weight[i].flatten()`` reads."""
    if isinstance(layer, nn.Linear):
        return position
    per_group = layer.in_channels // layer.groups
    group = i // (layer.out_channels // layer.groups)
    kernel = layer.weight.shape[2] * layer.weight.shape[3]
    return group * per_group + position // kernel


def expected_gradients(layer, g_w, g_b, mu, sigma2, q2):
    """(1/q2) P P^T [g_b; g_w] for every output unit, P built over [b_i, w_i flattened]."""
    s2 = [v + EPS1 * max(sigma2) + EPS2 for v in sigma2]
    new_w, new_b = torch.empty_like(g_w), None if g_b is None else torch.empty_like(g_b)
    for i in range(g_w.shape[0]):
        cols = [input_channel(layer, i, p) for p in range(g_w[i].numel())]
        if g_b is None:  # no centering: P = diag(1/sqrt(s2)) over w alone
            new_w[i] = (g_w[i].flatten() / torch.tensor([s2[j] for j in cols], dtype=DT) / q2).view(g_w[i].shape)
            continue
        p = explicit_p([mu[j] for j in cols], [s2[j] for j in cols])
        v = torch.cat([g_b[i : i + 1], g_w[i].flatten()])
        out = p @ p.T @ v / q2
        new_b[i] = out[0]
        new_w[i] = out[1:].view(g_w[i].shape)
    return new_w, new_b


CASES = [
    # (layer, input shape, hand-computed q2)
    (lambda: nn.Linear(5, 3), (4, 5), 5 / 4),
    (lambda: nn.Linear(5, 3), (8, 5), 1.0),
    (lambda: nn.Linear(4, 2), (1, 4), 4.0),  # batch size 1: variance around the running mean
    (lambda: nn.Linear(5, 3, bias=False), (4, 5), 5 / 4),
    (lambda: nn.Conv2d(3, 4, 3, padding=1), (2, 3, 5, 5), 27 / 2),
    (lambda: nn.Conv2d(2, 3, 1), (8, 2, 6, 6), 6.0),  # sqrt(H W) dominates
    (lambda: nn.Conv2d(3, 2, (3, 1), bias=False), (2, 3, 4, 4), 9 / 2),
    (lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2), (2, 4, 4, 4), 18 / 2),  # fan-in (4/2)*9
    (lambda: nn.Conv2d(3, 6, 3, groups=3), (3, 3, 5, 5), 5.0),  # depthwise x2: fan-in 9, 9/3 < sqrt(25)
    (lambda: nn.Conv2d(2, 3, 3, padding=1), (1, 2, 4, 4), 18.0),  # batch size 1: stats over H W
]


@pytest.mark.parametrize("make_layer,shape,q2", CASES)
def test_rewritten_gradients_equal_explicit_preconditioner(make_layer, shape, q2):
    torch.manual_seed(0)
    layer = make_layer().to(DT)
    bnp = BNP(layer, rho=RHO, eps1=EPS1, eps2=EPS2)
    batches = [shifted(shape, s) for s in range(3)]
    for x in batches:
        out = layer(x)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=DT)
    (out * up).sum().backward()
    g_w = layer.weight.grad.clone()
    g_b = None if layer.bias is None else layer.bias.grad.clone()

    mu, sigma2 = track(batches, RHO)
    (state,) = bnp.layers()
    torch.testing.assert_close(state.mu, torch.tensor(mu, dtype=DT), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state.sigma2, torch.tensor(sigma2, dtype=DT), rtol=1e-12, atol=1e-12)
    assert state.q2() == pytest.approx(q2, rel=1e-15)

    bnp.step()
    want_w, want_b = expected_gradients(layer, g_w, g_b, mu, sigma2, q2)
    torch.testing.assert_close(layer.weight.grad, want_w, rtol=1e-10, atol=1e-12)
    if g_b is not None:
        torch.testing.assert_close(layer.bias.grad, want_b, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(layer.weight.grad, g_w)


def test_layer_matrix_matches_the_explicit_p_of_each_group():
    layer = nn.Conv2d(4, 6, 3, padding=1, groups=2).to(DT)
    bnp = BNP(layer, rho=RHO)
    batches = [shifted((2, 4, 4, 4), s) for s in range(2)]
    for x in batches:
        layer(x)
    mu, sigma2 = track(batches, RHO)
    s2 = [v + EPS1 * max(sigma2) + EPS2 for v in sigma2]
    (state,) = bnp.layers()
    for group in range(2):
        i = group * 3  # first output channel of the group
        cols = [input_channel(layer, i, p) for p in range(18)]
        want = explicit_p([mu[j] for j in cols], [s2[j] for j in cols])
        torch.testing.assert_close(state.matrix(group), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        preconditioner_matrix(torch.tensor(mu, dtype=DT), torch.tensor(s2, dtype=DT)), explicit_p(mu, s2), rtol=1e-12, atol=1e-12
    )


def test_eval_forwards_leave_the_statistics_alone():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    bnp = BNP(model)
    model(shifted((5, 3), 0))
    before = copy.deepcopy(bnp.state_dict())
    model.eval()
    model(shifted((5, 3), 1))
    for key, value in bnp.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_reduce_fn_sees_batch_statistics_before_the_running_update():
    layer = nn.Linear(3, 2).to(DT)
    seen = []

    def reduce_fn(means, variances):
        seen.append(([m.clone() for m in means], [v.clone() for v in variances]))
        return [torch.ones_like(m) for m in means], [torch.full_like(v, 2.0) for v in variances]

    bnp = BNP(layer, rho=RHO, reduce_fn=reduce_fn)
    x = shifted((6, 3), 0)
    layer(x).sum().backward()
    assert not seen  # nothing reduced inside the forward
    bnp.step()
    torch.testing.assert_close(seen[0][0][0], x.mean(0))
    torch.testing.assert_close(seen[0][1][0], x.var(0, unbiased=False))
    (state,) = bnp.layers()
    torch.testing.assert_close(state.mu, torch.full((3,), 1 - RHO, dtype=DT))
    torch.testing.assert_close(state.sigma2, torch.full((3,), RHO + 2 * (1 - RHO), dtype=DT))


def test_reduce_fn_is_called_once_per_step_for_every_layer():
    """Under DDP every layer's statistics go out in one call (one all-reduce per step, not
    one per layer); an identity reduce_fn then gives exactly the statistics and gradients
    of BNP without one, step after step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 2 * 2, 2)).to(DT)
    fused_model = copy.deepcopy(model)
    calls = []

    def identity(means, variances):
        calls.append(len(means))
        return means, variances

    plain, fused = BNP(model, rho=RHO), BNP(fused_model, rho=RHO, reduce_fn=identity)
    for _ in range(3):
        x = torch.randn(5, 2, 4, 4, dtype=DT)
        for m, bnp in ((model, plain), (fused_model, fused)):
            m.zero_grad()
            m(x).square().sum().backward()
            bnp.step()
        for a, b in zip(model.parameters(), fused_model.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0)
    assert calls == [2, 2, 2]
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in fused.state_dict().items())


def test_state_dict_round_trip_and_remove():
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(3 * 2 * 2, 2)).to(DT)
    bnp = BNP(model)
    model(shifted((4, 2, 4, 4), 0))
    state = bnp.state_dict()
    assert set(state) == {"0.mu", "0.sigma2", "2.mu", "2.sigma2"}
    other = BNP(copy.deepcopy(model))
    other.load_state_dict(state)
    for key, value in other.state_dict().items():
        assert torch.equal(value, state[key])
    with pytest.raises(KeyError, match="missing"):
        other.load_state_dict({"0.mu": state["0.mu"]})
    bnp.remove()
    model(shifted((4, 2, 4, 4), 1))
    for key, value in bnp.state_dict().items():
        assert torch.equal(value, state[key])
    assert set(BNP(nn.Linear(2, 2)).state_dict()) == {"mu", "sigma2"}


def test_step_before_any_training_forward_raises():
    layer = nn.Linear(2, 2)
    bnp = BNP(layer)
    layer.weight.grad = torch.ones_like(layer.weight)
    with pytest.raises(RuntimeError, match="no training forward"):
        bnp.step()
    with pytest.raises(ValueError, match="no Linear or Conv2d"):
        BNP(nn.Tanh())


def test_bnp_with_momentum_sgd_trains_a_tiny_mlp_differently_from_sgd():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(DT)
    x = shifted((16, 4), 1)
    target = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(2))

    def train(use_bnp):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        bnp = BNP(model) if use_bnp else None
        losses = []
        for _ in range(20):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), target)
            loss.backward()
            if bnp is not None:
                bnp.step()
            opt.step()
            losses.append(loss.item())
        return model, losses

    plain, plain_losses = train(False)
    pre, pre_losses = train(True)
    assert all(math.isfinite(v) for v in pre_losses)
    assert pre_losses[-1] < pre_losses[0]
    diff = max((a - b).abs().max().item() for a, b in zip(plain.parameters(), pre.parameters()))
    assert diff > 1e-3
    assert pre_losses != plain_losses
