"""The normalization family (METHODS.md section 2) without AMAT, against explicit formulas."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

from bnexp.nn import CBN1d, CBN2d, NormFamily1d, NormFamily2d, POPNorm1d, POPNorm2d
from tests.nn_helpers import assert_same_training_steps

DT = torch.float64
EPS = 1e-5
RHO = 2.5
FLAGS = list(itertools.product([True, False], repeat=3))  # (center, scale, decouple)


def make(dim: int, seed: int = 0, **kw) -> nn.Module:
    """A double-precision family module with random, non-trivial gamma and beta."""
    cls = NormFamily1d if dim == 1 else NormFamily2d
    m = cls(3, eps=EPS, **kw).to(DT)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m.weight.copy_(0.5 + torch.rand(3, generator=g, dtype=DT))
        m.bias.copy_(torch.randn(3, generator=g, dtype=DT))
    return m


def batch(dim: int, seed: int) -> torch.Tensor:
    """Per-channel shifted and scaled random input: (6, 3) or (4, 3, 2, 3)."""
    g = torch.Generator().manual_seed(seed)
    shape = (6, 3) if dim == 1 else (4, 3, 2, 3)
    view = (1, 3) if dim == 1 else (1, 3, 1, 1)
    x = torch.randn(shape, generator=g, dtype=DT)
    return x * torch.tensor([0.5, 2.0, 1.0], dtype=DT).view(view) + torch.tensor([1.0, -2.0, 0.3], dtype=DT).view(view)


def reference(x, gamma, beta, *, center, scale, decouple, rho, eps, stats=None):
    """The family's formula, one channel at a time; ``stats = (mean, var)`` replaces the batch's."""
    y = torch.empty_like(x)
    for c in range(x.shape[1]):
        xc = x[:, c]
        shift = beta[c] if decouple else 0.0
        if stats is None:
            x1 = xc - (xc.mean() if center else 0.0) + shift
            sigma = torch.sqrt((x1**2).mean() + eps)  # batch l2 norm of what gets divided
        else:
            mu, var = stats[0][c], stats[1][c]
            x1 = xc - (mu if center else 0.0) + shift
            sigma = torch.sqrt(var + ((0.0 if center else mu) + shift) ** 2 + eps)
        if not scale:
            sigma = 1.0
        y[:, c] = gamma[c] / rho * x1 / sigma + (0.0 if decouple else beta[c])
    return y


def reference_running(batches, momentum=0.1):
    """torch's running mean / unbiased variance update, channel by channel."""
    mean, var = torch.zeros(3, dtype=DT), torch.ones(3, dtype=DT)
    for x in batches:
        for c in range(3):
            xc = x[:, c].flatten()
            mu = xc.sum() / xc.numel()
            unbiased = ((xc - mu) ** 2).sum() / (xc.numel() - 1)
            mean[c] = (1 - momentum) * mean[c] + momentum * mu
            var[c] = (1 - momentum) * var[c] + momentum * unbiased
    return mean, var


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("center,scale,decouple", FLAGS)
def test_training_forward_matches_formula(dim, center, scale, decouple):
    m = make(dim, center=center, scale=scale, decouple=decouple, rho=RHO)
    x = batch(dim, 1)
    expected = reference(x, m.weight.detach(), m.bias.detach(), center=center, scale=scale, decouple=decouple, rho=RHO, eps=EPS)
    torch.testing.assert_close(m(x), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("center,scale,decouple", FLAGS)
def test_eval_uses_running_statistics(dim, center, scale, decouple):
    m = make(dim, center=center, scale=scale, decouple=decouple, rho=RHO)
    batches = [batch(dim, s) for s in range(3)]
    for x in batches:
        m(x)
    mean, var = reference_running(batches)
    torch.testing.assert_close(m.running_mean, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.running_var, var, rtol=1e-12, atol=1e-12)
    assert int(m.num_batches_tracked) == 3
    m.eval()
    before = copy.deepcopy(m.state_dict())
    x = batch(dim, 7)
    expected = reference(
        x, m.weight.detach(), m.bias.detach(), center=center, scale=scale, decouple=decouple, rho=RHO, eps=EPS, stats=(mean, var)
    )
    torch.testing.assert_close(m(x), expected, rtol=1e-12, atol=1e-12)
    for name, value in m.state_dict().items():  # eval leaves the statistics alone
        assert torch.equal(value, before[name]), name


@pytest.mark.parametrize("dim", [1, 2])
def test_bn_flags_equal_torch_batchnorm(dim):
    ours = make(dim)
    theirs = (nn.BatchNorm1d(3) if dim == 1 else nn.BatchNorm2d(3)).to(DT)
    theirs.load_state_dict(ours.state_dict())  # same gamma/beta and buffer names
    assert_same_training_steps(ours, theirs, lambda step: batch(dim, step), seed=10, rtol=1e-6, atol=1e-6)
    for name, value in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], value, rtol=1e-6, atol=1e-6)
    ours.eval()
    theirs.eval()
    x = batch(dim, 9)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-6)


def test_bn_flags_match_torch_on_3d_features():
    ours, theirs = make(1), nn.BatchNorm1d(3).to(DT)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(4, 3, 5, dtype=DT)
    torch.testing.assert_close(ours(x), theirs(x))
    torch.testing.assert_close(ours.running_var, theirs.running_var)


@pytest.mark.parametrize("dim", [1, 2])
def test_decoupled_sigma_is_var_plus_beta_squared(dim):
    m = make(dim, decouple=True, rho=RHO)
    x = batch(dim, 3)
    dims = [0] if dim == 1 else [0, 2, 3]
    view = (1, 3) if dim == 1 else (1, 3, 1, 1)
    mu = x.mean(dims, keepdim=True)
    var = ((x - mu) ** 2).mean(dims, keepdim=True)
    gamma, beta = m.weight.detach().view(view), m.bias.detach().view(view)
    expected = gamma / RHO * (x - mu + beta) / torch.sqrt(var + beta**2 + EPS)
    torch.testing.assert_close(m(x), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dim", [1, 2])
def test_decoupled_eval_uses_current_beta(dim):
    m = make(dim, decouple=True, rho=RHO)
    m(batch(dim, 0))
    m.eval()
    with torch.no_grad():
        m.bias.add_(0.7)  # after the statistics were taken
    x = batch(dim, 4)
    view = (1, 3) if dim == 1 else (1, 3, 1, 1)
    mu, var = m.running_mean.view(view), m.running_var.view(view)
    gamma, beta = m.weight.detach().view(view), m.bias.detach().view(view)
    expected = gamma / RHO * (x - mu + beta) / torch.sqrt(var + beta**2 + EPS)
    torch.testing.assert_close(m(x), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("center,scale,decouple", FLAGS)
def test_gradcheck(dim, center, scale, decouple):
    m = make(dim, center=center, scale=scale, decouple=decouple, rho=RHO)
    x = batch(dim, 5)[:3].requires_grad_()
    saved = copy.deepcopy(m.state_dict())

    def f(x, w, b):
        m.load_state_dict(saved)  # gradcheck calls f many times; the running update must not pile up
        return torch.func.functional_call(m, {"weight": w, "bias": b}, (x,))

    params = (m.weight.detach().clone().requires_grad_(), m.bias.detach().clone().requires_grad_())
    assert torch.autograd.gradcheck(f, (x, *params))
    m.eval()
    assert torch.autograd.gradcheck(f, (x, *params))


@pytest.mark.parametrize(
    "cls,dim", [(CBN1d, 1), (CBN2d, 2), (POPNorm1d, 1), (POPNorm2d, 2)],
)
def test_presets_set_the_table_flags(cls, dim):
    m = cls(3)
    assert (m.center, m.scale, m.decouple) == (True, True, True)
    assert m.input_dims == ((2, 3) if dim == 1 else (4,))
    if cls in (CBN1d, CBN2d):
        assert m.amat and m.amat_eta is None and m.rho == 1.0
        assert cls(3, rho=0.5, amat=False).rho == 0.5
    else:
        assert not m.amat and m.rho == 4.0
        assert cls(3, rho=2.0).rho == cls(3, kappa=2.0).rho == 2.0  # kappa: the POP-Norm paper's name
        assert not cls(3, scale=False).scale  # the ablations pass flags through


def test_popnorm_forward_is_decoupled_division_by_kappa():
    m = POPNorm2d(3, rho=4.0).to(DT)
    with torch.no_grad():
        m.bias.copy_(torch.tensor([0.3, -1.0, 2.0]))
    x = batch(2, 2)
    expected = reference(x, m.weight.detach(), m.bias.detach(), center=True, scale=True, decouple=True, rho=4.0, eps=EPS)
    torch.testing.assert_close(m(x), expected, rtol=1e-12, atol=1e-12)


def test_invalid_configurations_raise():
    with pytest.raises(ValueError, match="rho"):
        NormFamily2d(3, rho=0.0)
    with pytest.raises(ValueError, match="amat"):
        NormFamily2d(3, amat=True, center=False)
    with pytest.raises(ValueError, match="amat_eta"):
        NormFamily2d(3, amat_eta=0.9)
    with pytest.raises(ValueError, match="4D"):
        NormFamily2d(3)(torch.randn(4, 3))
    with pytest.raises(ValueError, match="channels"):
        NormFamily1d(3)(torch.randn(4, 5))
    with pytest.raises(ValueError, match="more than 1 value"):
        NormFamily1d(3)(torch.randn(1, 3))
    with pytest.raises(RuntimeError, match="without AMAT"):
        NormFamily1d(3).set_learning_rate(0.1)


def mean_removal(x, beta, mean=None):
    """POP-Norm's eq. (11), ``x - mu + beta`` per channel, with no gamma: ``mu`` the batch
    mean (a sum over the channel's values divided by their count) or the given ``mean``."""
    y = torch.empty_like(x)
    for c in range(x.shape[1]):
        xc = x[:, c]
        mu = xc.sum() / xc.numel() if mean is None else mean[c]
        y[:, c] = xc - mu + beta[c]
    return y


@pytest.mark.parametrize("cls,dim", [(POPNorm1d, 1), (POPNorm2d, 2)])
def test_mean_removal_alone_is_eq_11_without_gamma(cls, dim):
    """``gamma=False``: no learnable gamma (nothing to train or save but beta and the running
    statistics); training and eval forwards are ``x - mu + beta``, mu the batch's or the running mean."""
    m = cls(3, scale=False, rho=1.0, gamma=False).to(DT)
    assert [name for name, _ in m.named_parameters()] == ["bias"]
    assert "weight" not in m.state_dict() and m.weight.dtype == DT and torch.equal(m.weight, torch.ones(3, dtype=DT))
    with torch.no_grad():
        m.bias.copy_(torch.tensor([0.3, -1.0, 2.0]))
    batches = [batch(dim, s) for s in range(3)]
    for x in batches:
        torch.testing.assert_close(m(x), mean_removal(x, m.bias.detach()), rtol=1e-12, atol=1e-12)
    mean, _ = reference_running(batches)
    m.eval()
    x = batch(dim, 7)
    torch.testing.assert_close(m(x), mean_removal(x, m.bias.detach(), mean), rtol=1e-12, atol=1e-12)
    assert "gamma=False" in repr(m) and "gamma" not in repr(cls(3))


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("center,scale,decouple", FLAGS)
def test_without_gamma_every_form_is_gamma_one(dim, center, scale, decouple):
    """Every form without gamma computes the family's formula at gamma = 1 (the divided forms
    through the closed-form backward), and its float64 gradients in x and beta pass gradcheck."""
    cls = NormFamily1d if dim == 1 else NormFamily2d
    m = cls(3, eps=EPS, center=center, scale=scale, decouple=decouple, rho=RHO, gamma=False).to(DT)
    with torch.no_grad():
        m.bias.copy_(torch.tensor([0.3, -1.0, 2.0]))
    x = batch(dim, 5)[:3]
    ones = torch.ones(3, dtype=DT)
    expected = reference(x, ones, m.bias.detach(), center=center, scale=scale, decouple=decouple, rho=RHO, eps=EPS)
    torch.testing.assert_close(m(x), expected, rtol=1e-12, atol=1e-12)
    saved = copy.deepcopy(m.state_dict())

    def f(x, b):
        m.load_state_dict(saved)
        return torch.func.functional_call(m, {"bias": b}, (x,))

    assert torch.autograd.gradcheck(f, (x.clone().requires_grad_(), m.bias.detach().clone().requires_grad_()))


def test_gamma_must_be_a_bool():
    with pytest.raises(ValueError, match="gamma must be true or false"):
        NormFamily2d(3, gamma=0)
