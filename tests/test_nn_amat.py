"""AMAT (CBN Algorithm 1, METHODS.md section 2) against an explicit per-channel reference."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from bnexp.nn import CBN1d, CBN2d, NormFamily1d, NormFamily2d, set_learning_rate
from bnexp.nn.family import AFTER_FORWARD as AFTER
from bnexp.nn.family import AMAT_UPDATES as UPDATES
from bnexp.nn.family import BEFORE_FORWARD as BEFORE

DT = torch.float64
EPS = 1e-5
RHO = 1.7
VIEW = {1: (1, 3), 2: (1, 3, 1, 1)}


def make(dim: int, decouple: bool = True, **kw) -> nn.Module:
    """An AMAT layer in the paper's unclipped form unless ``amat_r_max`` is given."""
    cls = NormFamily1d if dim == 1 else NormFamily2d
    kw.setdefault("amat_r_max", None)
    m = cls(3, decouple=decouple, rho=RHO, amat=True, eps=EPS, **kw).to(DT)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([0.8, 1.3, 1.1]))
        m.bias.copy_(torch.tensor([0.4, -0.9, 0.2]))
    return m


def batch(dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((6, 3) if dim == 1 else (3, 3, 2, 2), generator=g, dtype=DT)
    return x * torch.tensor([0.5, 2.0, 1.0], dtype=DT).view(VIEW[dim]) + torch.tensor([1.0, -2.0, 0.5], dtype=DT).view(VIEW[dim])


def reference(batches, gamma, beta, etas, decouple=True, update=BEFORE, r_max=None):
    """Algorithm 1 in METHODS.md's revised order (or as printed), written out channel by
    channel in Python floats: outputs and (mu_A, sigma_A^2) after each step.

    ``etas[k]`` is the eta of step k; step 0 always has eta = 0 (it copies the batch).
    ``update=BEFORE`` averages the batch in before normalizing, ``AFTER`` afterwards.
    """
    mu_a, s2_a = [0.0] * 3, [1.0] * 3
    outs, states = [], []
    for k, x in enumerate(batches):
        y = torch.empty_like(x)
        eta = 0.0 if k == 0 else etas[k]
        for c in range(3):
            xc = x[:, c]
            mu_b = float(xc.mean())
            if update == BEFORE:
                mu_a[c] = eta * mu_a[c] + (1 - eta) * mu_b
            mu_used = mu_b if k == 0 and update == AFTER else mu_a[c]
            r_mu = 1.0 if k == 0 or abs(mu_b) < 1e-6 else mu_used / mu_b
            if r_max is not None:
                r_mu = min(max(r_mu, -r_max), r_max)
            x1 = xc - r_mu * mu_b + (beta[c] if decouple else 0.0)
            s2_b = float((x1**2).mean()) + EPS
            if update == BEFORE:
                s2_a[c] = eta * s2_a[c] + (1 - eta) * s2_b
            s2_used = s2_b if k == 0 and update == AFTER else s2_a[c]
            y[:, c] = gamma[c] / RHO * x1 / math.sqrt(s2_used) + (0.0 if decouple else beta[c])
            if update == AFTER:
                mu_a[c] = eta * mu_a[c] + (1 - eta) * mu_b
                s2_a[c] = eta * s2_a[c] + (1 - eta) * s2_b
        outs.append(y)
        states.append((torch.tensor(mu_a, dtype=DT), torch.tensor(s2_a, dtype=DT)))
    return outs, states


def params(m):
    return m.weight.detach().tolist(), m.bias.detach().tolist()


@pytest.mark.parametrize("update", UPDATES)
@pytest.mark.parametrize("lr,eta", [(0.0, 1.0), (0.02, 0.8), (0.05, 0.5), (0.1, 0.0), (0.3, 0.0)])
def test_adaptive_eta_is_max_one_minus_ten_lr(lr, eta, update):
    m = make(2, amat_update=update)
    set_learning_rate(m, lr)
    batches = [batch(2, s) for s in range(3)]
    outs = [m(x) for x in batches]
    ref_outs, states = reference(batches, *params(m), etas=[None, eta, eta], update=update)
    for got, want in zip(outs, ref_outs):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.amat_mean, states[-1][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.amat_var, states[-1][1], rtol=1e-12, atol=1e-12)
    assert int(m.amat_steps) == 3


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("decouple", [True, False])
def test_eta_zero_is_exactly_batch_statistics_by_default(dim, decouple):
    """At lr >= 0.1 (eta = 0) the revised order makes AMAT the plain batch-statistics norm:
    the same outputs and gradients on every step, not only the first."""
    m = make(dim, decouple=decouple)
    plain = (NormFamily1d if dim == 1 else NormFamily2d)(3, decouple=decouple, rho=RHO, eps=EPS).to(DT)
    plain.load_state_dict({**plain.state_dict(), "weight": m.weight, "bias": m.bias})
    for seed in range(3):
        set_learning_rate(m, 0.1)
        up = torch.randn(batch(dim, seed).shape, generator=torch.Generator().manual_seed(10 + seed), dtype=DT)
        grads = []
        for module in (m, plain):
            x = batch(dim, seed).requires_grad_()
            module.zero_grad()
            y = module(x)
            (y * up).sum().backward()
            grads.append((y, x.grad, module.weight.grad, module.bias.grad))
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dim", [1, 2])
def test_printed_order_at_lr_one_tenth_runs_on_the_previous_batch_statistics(dim):
    m = make(dim, amat_update=AFTER)
    set_learning_rate(m, 0.1)
    prev, cur = batch(dim, 0), batch(dim, 1)
    m(prev)
    dims = [0] if dim == 1 else [0, 2, 3]
    gamma, beta = m.weight.detach().view(VIEW[dim]), m.bias.detach().view(VIEW[dim])
    mu_prev = prev.mean(dims, keepdim=True)
    sigma_prev = torch.sqrt(((prev - mu_prev + beta) ** 2).mean(dims, keepdim=True) + EPS)
    expected = gamma / RHO * (cur - mu_prev + beta) / sigma_prev
    torch.testing.assert_close(m(cur), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("update", UPDATES)
@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("decouple", [True, False])
def test_fixed_eta_follows_eqs_8_and_9(dim, decouple, update):
    m = make(dim, decouple=decouple, amat_eta=0.9, amat_update=update)  # no learning rate needed
    batches = [batch(dim, s) for s in range(4)]
    outs = [m(x) for x in batches]
    ref_outs, states = reference(batches, *params(m), etas=[0.9] * 4, decouple=decouple, update=update)
    for got, want in zip(outs, ref_outs):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.amat_mean, states[-1][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.amat_var, states[-1][1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("update", UPDATES)
@pytest.mark.parametrize("decouple", [True, False])
def test_first_step_uses_and_copies_batch_statistics(decouple, update):
    m = make(2, decouple=decouple, amat_update=update)
    plain = NormFamily2d(3, decouple=decouple, rho=RHO, eps=EPS).to(DT)
    plain.load_state_dict({**plain.state_dict(), "weight": m.weight, "bias": m.bias})
    x = batch(2, 0)
    torch.testing.assert_close(m(x), plain(x), rtol=1e-12, atol=1e-12)
    mu = x.mean([0, 2, 3])
    var = x.var([0, 2, 3], unbiased=False)
    extra = m.bias.detach() ** 2 if decouple else 0.0
    torch.testing.assert_close(m.amat_mean, mu, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.amat_var, var + extra + EPS, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("decouple", [True, False])
def test_eval_uses_amat_statistics(decouple):
    m = make(2, decouple=decouple, amat_eta=0.5)
    for s in range(3):
        m(batch(2, s))
    m.eval()
    before = copy.deepcopy(m.state_dict())
    x = batch(2, 8)
    v = VIEW[2]
    gamma, beta = m.weight.detach().view(v), m.bias.detach().view(v)
    x1 = x - m.amat_mean.view(v) + (beta if decouple else 0.0)
    expected = gamma / RHO * x1 / m.amat_var.sqrt().view(v) + (0.0 if decouple else beta)
    torch.testing.assert_close(m(x), expected, rtol=1e-12, atol=1e-12)
    for name, value in m.state_dict().items():
        assert torch.equal(value, before[name]), name


def hand_gradients(x, up, gamma, beta, mu_a, s2_a, decouple, eta, update=BEFORE, r_max=None):
    """dL/dx, dL/dgamma, dL/dbeta of L = sum(up * y) with the stop-gradient ratios as constants,
    for a step after the first with averages ``mu_a``, ``s2_a`` stored before it.

    Per channel (n values): z = x - r_mu mu_B + beta, s = sqrt(mean(z^2) + eps), y = a z / s
    with a = gamma / (rho r_s). Then dz_i/dx_j = delta_ij - r_mu / n and
    ds/dx_j = (z_j - r_mu mean(z)) / (n s), so
    dL/dx_j = a [(u_j - r_mu mean(u)) / s - sum(u z) (z_j - r_mu mean(z)) / (n s^3)].
    Under ``update=BEFORE`` the averages the ratios use include this batch (weight 1 - eta).
    """
    gx = torch.empty_like(x)
    ggamma, gbeta = torch.empty(3, dtype=DT), torch.empty(3, dtype=DT)
    for c in range(3):
        xc, u = x[:, c].flatten(), up[:, c].flatten()
        n = xc.numel()
        mu_b = xc.mean()
        mu_used = eta * mu_a[c] + (1 - eta) * float(mu_b) if update == BEFORE else mu_a[c]
        r_mu = 1.0 if abs(mu_b) < 1e-6 else mu_used / mu_b
        if r_max is not None:
            r_mu = r_mu.clamp(-r_max, r_max)
        z = xc - r_mu * mu_b + (beta[c] if decouple else 0.0)
        s = torch.sqrt((z**2).mean() + EPS)
        s2_used = eta * s2_a[c] + (1 - eta) * float(s**2) if update == BEFORE else s2_a[c]
        r_s = math.sqrt(s2_used) / s
        a = gamma[c] / (RHO * r_s)
        uz = (u * z).sum()
        gx[:, c] = (a * ((u - r_mu * u.mean()) / s - uz * (z - r_mu * z.mean()) / (n * s**3))).view(x[:, c].shape)
        ggamma[c] = uz / (RHO * r_s * s)
        gbeta[c] = a * (u.sum() / s - uz * z.mean() / s**3) if decouple else u.sum()
    return gx, ggamma, gbeta


@pytest.mark.parametrize("update", UPDATES)
@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("decouple", [True, False])
def test_gradients_equal_the_hand_derived_stop_gradient_formula(dim, decouple, update):
    m = make(dim, decouple=decouple, amat_update=update)
    set_learning_rate(m, 0.03)
    m(batch(dim, 0))
    m(batch(dim, 1))  # two steps: mu_A, sigma_A differ from the coming batch's
    mu_a, s2_a = m.amat_mean.tolist(), m.amat_var.tolist()
    x = batch(dim, 2).requires_grad_()
    up = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=DT)
    (m(x) * up).sum().backward()
    gx, ggamma, gbeta = hand_gradients(x.detach(), up, *params(m), mu_a, s2_a, decouple, 0.7, update)
    torch.testing.assert_close(x.grad, gx, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(m.weight.grad, ggamma, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(m.bias.grad, gbeta, rtol=1e-10, atol=1e-12)
    # The ratios really are in play: the gradient is not the plain batch-statistics one.
    plain = NormFamily1d(3, decouple=decouple, rho=RHO, eps=EPS) if dim == 1 else NormFamily2d(3, decouple=decouple, rho=RHO, eps=EPS)
    plain = plain.to(DT)
    plain.load_state_dict({**plain.state_dict(), "weight": m.weight, "bias": m.bias})
    x2 = x.detach().clone().requires_grad_()
    (plain(x2) * up).sum().backward()
    assert not torch.allclose(x.grad, x2.grad, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("offset", [0.0, 5e-7])
def test_mean_guard_uses_the_batch_mean(offset):
    m = make(1, amat_eta=0.5)
    m(batch(1, 0))  # mu_A of channel 0 is about 1
    half = torch.tensor([0.3, -1.2, 0.7], dtype=DT)
    col0 = torch.cat([half, -half]) + offset  # batch mean of channel 0: |mu_B| < 1e-6
    x = batch(1, 1)
    x[:, 0] = col0
    x.requires_grad_()
    mu_a, s2_a = m.amat_mean.tolist(), m.amat_var.tolist()
    y = m(x)
    gamma, beta = params(m)
    mu_b = col0.mean()
    x1 = col0 - mu_b + beta[0]
    s2_used = 0.5 * s2_a[0] + 0.5 * float((x1**2).mean() + EPS)  # eta 0.5, this batch averaged in
    expected0 = gamma[0] / RHO * x1 / math.sqrt(s2_used)
    torch.testing.assert_close(y[:, 0], expected0, rtol=1e-12, atol=1e-12)
    up = torch.randn(x.shape, generator=torch.Generator().manual_seed(4), dtype=DT)
    (y * up).sum().backward()
    gx, _, _ = hand_gradients(x.detach(), up, gamma, beta, mu_a, s2_a, True, 0.5)
    assert torch.isfinite(x.grad).all()
    torch.testing.assert_close(x.grad, gx, rtol=1e-10, atol=1e-12)


def test_adaptive_amat_without_learning_rate_raises_after_the_first_step():
    m = make(2)
    m(batch(2, 0))  # step 0 needs no learning rate
    with pytest.raises(RuntimeError, match="set_learning_rate"):
        m(batch(2, 1))
    m.eval()
    m(batch(2, 1))  # eval needs none either
    m.train()
    set_learning_rate(m, 0.05)
    m(batch(2, 1))


def test_set_learning_rate_reaches_every_amat_layer():
    model = nn.Sequential(CBN2d(3), NormFamily2d(3), nn.Conv2d(3, 3, 1), CBN1d(2, amat_eta=0.9))
    assert set_learning_rate(model, 0.025) == 2
    assert float(model[0].amat_eta_now) == 0.75
    assert not hasattr(model[3], "amat_eta_now")  # a fixed eta ignores the lr


def test_lr_of_one_tenth_gives_exactly_zero_eta_in_low_precision():
    m = CBN2d(3).half()
    set_learning_rate(m, 0.1)
    assert float(m.amat_eta_now) == 0.0


def test_state_dict_holds_amat_buffers_but_not_the_learning_rate():
    m = CBN2d(3)
    assert set(m.state_dict()) == {"weight", "bias", "amat_mean", "amat_var", "amat_steps"}


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("decouple", [True, False])
def test_gradcheck(dim, decouple):
    m = make(dim, decouple=decouple)
    set_learning_rate(m, 0.03)
    x0 = batch(dim, 0).requires_grad_()
    gamma = m.weight.detach().clone().requires_grad_()
    beta = m.bias.detach().clone().requires_grad_()

    def run(saved):
        def f(x, w, b):
            m.load_state_dict(saved)  # gradcheck calls f many times; restore the AMAT buffers
            return torch.func.functional_call(m, {"weight": w, "bias": b}, (x,))

        return f

    # Step 0 runs on batch statistics: the full gradient is the true derivative.
    assert torch.autograd.gradcheck(run(copy.deepcopy(m.state_dict())), (x0, gamma, beta))
    # Later steps: the stop-gradient ratios make autograd differ from the derivative of the
    # forward value on purpose (checked by hand above); gamma stays outside the ratios.
    m(batch(dim, 1))
    f = run(copy.deepcopy(m.state_dict()))
    x1 = batch(dim, 2)
    assert torch.autograd.gradcheck(lambda w: f(x1, w, beta.detach()), (gamma,))
    m.eval()
    assert torch.autograd.gradcheck(run(copy.deepcopy(m.state_dict())), (x0, gamma, beta))


def small_mean_batch(dim: int, seed: int) -> torch.Tensor:
    """A batch whose channel 2 has batch mean 0.05 while mu_A of that channel is near 0.5."""
    x = batch(dim, seed)
    dims = [0] if dim == 1 else [0, 2, 3]
    x[:, 2] -= x[:, 2].mean() - 0.05
    assert torch.allclose(x.mean(dims)[2], torch.tensor(0.05, dtype=DT))
    return x


@pytest.mark.parametrize("update", UPDATES)
@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("decouple", [True, False])
def test_r_max_clips_the_mean_ratio(dim, decouple, update):
    m = make(dim, decouple=decouple, amat_eta=0.9, amat_update=update, amat_r_max=3.0)
    batches = [batch(dim, 0), batch(dim, 1), small_mean_batch(dim, 2), batch(dim, 3)]
    outs = [m(x) for x in batches]
    ref_outs, states = reference(batches, *params(m), etas=[0.9] * 4, decouple=decouple, update=update, r_max=3.0)
    unclipped, _ = reference(batches, *params(m), etas=[0.9] * 4, decouple=decouple, update=update)
    assert not torch.allclose(ref_outs[2], unclipped[2])  # the bound is active on the third step
    for got, want in zip(outs, ref_outs):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.amat_mean, states[-1][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.amat_var, states[-1][1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("update", UPDATES)
def test_r_max_gradients_use_the_clipped_ratio(update):
    m = make(2, amat_eta=0.9, amat_update=update, amat_r_max=3.0)
    m(batch(2, 0))
    m(batch(2, 1))
    mu_a, s2_a = m.amat_mean.tolist(), m.amat_var.tolist()
    x = small_mean_batch(2, 2).requires_grad_()
    up = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=DT)
    (m(x) * up).sum().backward()
    gx, ggamma, gbeta = hand_gradients(x.detach(), up, *params(m), mu_a, s2_a, True, 0.9, update, r_max=3.0)
    free, _, _ = hand_gradients(x.detach(), up, *params(m), mu_a, s2_a, True, 0.9, update)
    assert not torch.allclose(gx, free)
    torch.testing.assert_close(x.grad, gx, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(m.weight.grad, ggamma, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(m.bias.grad, gbeta, rtol=1e-10, atol=1e-12)


def test_amat_settings_are_checked():
    with pytest.raises(ValueError, match="amat_update"):
        CBN2d(3, amat_update="later")
    with pytest.raises(ValueError, match="amat_r_max must be positive"):
        CBN2d(3, amat_r_max=0.0)
    assert CBN2d(3).amat_r_max == NormFamily2d(3, amat=True).amat_r_max == 3.0  # bnexp's default bound
    assert CBN2d(3, amat_r_max=None).amat_r_max is None  # the paper's unclipped ratio


@pytest.mark.parametrize("overrides,expected", [
    ([], (3.0, "before_forward")),
    (["norm.amat_r_max=null"], (None, "before_forward")),
    (["norm.amat_update=after_forward", "norm.amat_r_max=1.5"], (1.5, "after_forward")),
])
def test_cbn_preset_builds_amat_layers_with_its_settings(overrides, expected):
    from bnexp.models import DataSpec, build_model
    from tests.conftest import TINY, compose_cfg

    cfg = compose_cfg([*TINY, "norm=cbn", *overrides])
    model = build_model(cfg.model, cfg.norm, "tanh", DataSpec(10, 3, 8))
    layers = [m for m in model.modules() if isinstance(m, (NormFamily1d, NormFamily2d))]
    assert len(layers) == 20 and all(m.amat for m in layers)
    assert {(m.amat_r_max, m.amat_update) for m in layers} == {expected}


@pytest.mark.parametrize("override,message", [
    ("norm.amat_r_max=0", r"norm=cbn \(layer cbn\): norm.amat_r_max must be positive .*got 0"),
    ("norm.amat_update=later", "norm.amat_update must be one of before_forward, after_forward, got 'later'"),
    ("norm.amat_eta=often", "norm.amat_eta must be 'adaptive' or a number in \\[0, 1\\], got 'often'"),
])
def test_bad_amat_settings_are_config_errors(override, message):
    from bnexp.models import DataSpec, build_model
    from bnexp.support.errors import ConfigError
    from tests.conftest import TINY, compose_cfg

    cfg = compose_cfg([*TINY, "norm=cbn", override])
    with pytest.raises(ConfigError, match=message):
        build_model(cfg.model, cfg.norm, "tanh", DataSpec(10, 3, 8))
