"""Batch renormalization, scale-invariant BN and the scale-invariance tags, torch.compile."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from torch import nn

from bnexp.nn import (
    BatchRenorm1d,
    BatchRenorm2d,
    CBN2d,
    FourThingsBN2d,
    NormFamily2d,
    POPNorm2d,
    ScaleInvariantBN1d,
    ScaleInvariantBN2d,
    is_scale_invariant,
    set_learning_rate,
)
from tests.nn_helpers import assert_same_training_steps

DT = torch.float64
EPS = 1e-5
TINY = 1e-30
VIEW = {1: (1, 3), 2: (1, 3, 1, 1)}


def batch(dim: int, seed: int, dtype=DT) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((6, 3) if dim == 1 else (3, 3, 2, 3), generator=g, dtype=dtype)
    scale = torch.tensor([0.5, 2.0, 1.0], dtype=dtype).view(VIEW[dim])
    return x * scale + torch.tensor([1.0, -2.0, 0.5], dtype=dtype).view(VIEW[dim])


def randomize(norm: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial gamma (positive) and beta."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(0.5 + torch.rand(norm.weight.shape, generator=g, dtype=norm.weight.dtype))
        norm.bias.copy_(torch.randn(norm.bias.shape, generator=g, dtype=norm.bias.dtype))
    return norm


def gradcheck_module(module: nn.Module, inputs: dict, x: torch.Tensor) -> bool:
    """gradcheck over ``x`` and the named parameters, with buffers restored before every call."""
    saved = copy.deepcopy(module.state_dict())
    names = list(inputs)

    def f(x, *values):
        module.load_state_dict(saved)
        return torch.func.functional_call(module, dict(zip(names, values)), (x,))

    values = [v.detach().clone().requires_grad_() for v in inputs.values()]
    return torch.autograd.gradcheck(f, (x.detach().clone().requires_grad_(), *values))


# -- batch renormalization -------------------------------------------------------------------


NO_SCHEDULE = {"relax_start": 0, "r_max_step": 0, "d_max_step": 0}  # the given limits from the first step


def brn_reference(batches, gamma, beta, limits, momentum):
    """Ioffe's batch renormalization written out channel by channel; ``limits(k) = (r_max, d_max)``."""
    mu_run, std_run = [0.0] * 3, [1.0] * 3
    outs = []
    for k, x in enumerate(batches):
        r_max, d_max = limits(k)
        y = torch.empty_like(x)
        for c in range(3):
            xc = x[:, c]
            mu = float(xc.mean())
            sigma = math.sqrt(float(((xc - mu) ** 2).mean()) + EPS)
            r = min(max(sigma / std_run[c], 1 / r_max), r_max)
            d = min(max((mu - mu_run[c]) / std_run[c], -d_max), d_max)
            y[:, c] = gamma[c] * ((xc - mu) / sigma * r + d) + beta[c]
            mu_run[c] += momentum * (mu - mu_run[c])
            std_run[c] += momentum * (sigma - std_run[c])
        outs.append(y)
    return outs, torch.tensor(mu_run, dtype=DT), torch.tensor(std_run, dtype=DT)


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("r_max,d_max,momentum", [(3.0, 5.0, 0.01), (1.5, 0.5, 0.3)])
def test_brn_forward_running_averages_and_eval(dim, r_max, d_max, momentum):
    cls = BatchRenorm1d if dim == 1 else BatchRenorm2d
    m = randomize(cls(3, r_max=r_max, d_max=d_max, momentum=momentum, eps=EPS, **NO_SCHEDULE).to(DT))
    batches = [batch(dim, s) for s in range(4)]
    outs = [m(x) for x in batches]
    gamma, beta = m.weight.detach().tolist(), m.bias.detach().tolist()
    ref, mu, std = brn_reference(batches, gamma, beta, lambda k: (r_max, d_max), momentum)
    for got, want in zip(outs, ref):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.running_mean, mu, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.running_std, std, rtol=1e-12, atol=1e-12)
    m.eval()
    x = batch(dim, 9)
    v = VIEW[dim]
    want = m.weight.detach().view(v) * (x - mu.view(v)) / std.view(v) + m.bias.detach().view(v)
    torch.testing.assert_close(m(x), want, rtol=1e-12, atol=1e-12)


def ioffe_limits(step: int, start: int = 5000, r_end: int = 40000, d_end: int = 25000) -> tuple[float, float]:
    """Ioffe (2017)'s clipping limits at ``step``: (1, 0) until ``start``, then linear to
    r_max 3 at ``r_end`` and d_max 5 at ``d_end``."""
    def done(end: int) -> float:
        return min(max((step - start) / (end - start), 0.0), 1.0)

    return 1.0 + 2.0 * done(r_end), 5.0 * done(d_end)


@pytest.mark.parametrize("step", [0, 4999, 5000, 12500, 25000, 32500, 40000, 166000])
def test_brn_default_limits_follow_ioffes_schedule_in_steps(step):
    m = BatchRenorm2d(3).to(DT)
    m.num_batches_tracked.fill_(step)
    r_max, d_max = m.limits()
    assert (float(r_max), float(d_max)) == pytest.approx(ioffe_limits(step), rel=1e-12)
    if step == 25000:  # the example: a 166k-step run clipped at (1.30, 0.75) here with a ramp over the run
        assert (float(r_max), float(d_max)) == pytest.approx((1 + 2 * 20 / 35, 5.0), rel=1e-12)


def test_brn_schedule_numbers_are_settings_and_the_forward_uses_them():
    m = randomize(BatchRenorm2d(3, r_max=3.0, d_max=5.0, momentum=0.2, relax_start=1, r_max_step=5,
                                d_max_step=3).to(DT))
    expected = [ioffe_limits(k, start=1, r_end=5, d_end=3) for k in range(7)]
    assert expected[:4] == [(1.0, 0.0), (1.0, 0.0), (1.5, 2.5), (2.0, 5.0)]
    batches = [batch(2, s) for s in range(7)]
    outs = []
    for k, x in enumerate(batches):
        r_max, d_max = m.limits()
        assert (float(r_max), float(d_max)) == pytest.approx(expected[k])
        outs.append(m(x))
    ref, _, _ = brn_reference(batches, m.weight.detach().tolist(), m.bias.detach().tolist(), lambda k: expected[k], 0.2)
    for got, want in zip(outs, ref):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert BatchRenorm2d(3, **NO_SCHEDULE).limits() == (3.0, 5.0)  # no schedule
    unclipped = BatchRenorm2d(3, r_max=None, d_max=None, relax_start=None, r_max_step=None, d_max_step=None)
    assert unclipped.limits() == (math.inf, math.inf)  # TensorFlow: no clipping, so no schedule


@pytest.mark.parametrize("options,message", [
    ({"r_max_step": 100}, "must not come before relax_start=5000"),
    ({"relax_start": -1}, "relax_start must be a step count >= 0, got -1"),
    ({"r_max": 0.5}, "need r_max >= 1 and d_max >= 0"),
    ({"r_max": None, "d_max": None}, "relax_start=5000 does nothing when r_max=None and d_max=None"),
    ({"r_max": None, "r_max_step": None, "d_max_step": None}, "d_max_step must be a step count >= 0, got None"),
    ({"r_max": None, "relax_start": None, "r_max_step": None}, "relax_start must be a step count >= 0, got None"),
    ({"d_max": None, "d_max_step": 9}, "d_max_step=9 does nothing when r_max=3.0 and d_max=None"),
])
def test_brn_schedule_rejects_impossible_numbers(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        BatchRenorm2d(3, **options)


@pytest.mark.parametrize("dim", [1, 2])
def test_brn_equals_bn_when_r_max_is_1_and_d_max_is_0(dim):
    ours = randomize((BatchRenorm1d if dim == 1 else BatchRenorm2d)(3, r_max=1.0, d_max=0.0).to(DT))
    theirs = (nn.BatchNorm1d(3) if dim == 1 else nn.BatchNorm2d(3)).to(DT)
    theirs.load_state_dict({**theirs.state_dict(), "weight": ours.weight, "bias": ours.bias})
    assert_same_training_steps(ours, theirs, lambda step: batch(dim, step), seed=100, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dim", [1, 2])
def test_brn_gradcheck(dim):
    cls = BatchRenorm1d if dim == 1 else BatchRenorm2d
    x = batch(dim, 3)
    plain = randomize(cls(3, r_max=1.0, d_max=0.0).to(DT))
    assert gradcheck_module(plain, {"weight": plain.weight, "bias": plain.bias}, x)
    # Far-off moving averages pin r at r_max and d at -d_max: both locally constant, so the
    # stop-gradient is the true derivative and gradcheck applies with the real limits.
    pinned = randomize(cls(3, **NO_SCHEDULE).to(DT))
    with torch.no_grad():
        pinned.running_std.fill_(0.01)
        pinned.running_mean.fill_(10.0)
    assert gradcheck_module(pinned, {"weight": pinned.weight, "bias": pinned.bias}, x)
    pinned.eval()
    assert gradcheck_module(pinned, {"weight": pinned.weight, "bias": pinned.bias}, x)


# -- scale-invariant BN (bn_si) --------------------------------------------------------------


def si_reference(z, weight_rows, gamma, beta, eps, stats=None):
    """BN with eps * ||w_k||^2 under the square root, channel by channel."""
    y = torch.empty_like(z)
    for c in range(z.shape[1]):
        zc = z[:, c]
        smooth = eps * float((weight_rows[c] ** 2).sum())
        mu, var = (zc.mean(), ((zc - zc.mean()) ** 2).mean()) if stats is None else (stats[0][c], stats[1][c])
        y[:, c] = gamma[c] * (zc - mu) / torch.sqrt(var + smooth) + beta[c]
    return y


@pytest.mark.parametrize("dim", [1, 2])
def test_bn_si_forward_and_eval(dim):
    torch.manual_seed(0)
    op = nn.Linear(4, 3).to(DT) if dim == 1 else nn.Conv2d(2, 3, 3, padding=1).to(DT)
    norm = randomize((ScaleInvariantBN1d if dim == 1 else ScaleInvariantBN2d)(3, op, eps=0.1).to(DT))
    x = torch.randn((6, 4) if dim == 1 else (2, 2, 3, 3), dtype=DT)
    z = op(x).detach()
    gamma, beta = norm.weight.detach(), norm.bias.detach()
    torch.testing.assert_close(norm(z), si_reference(z, op.weight.detach(), gamma, beta, 0.1), rtol=1e-12, atol=1e-12)
    norm.eval()
    stats = (norm.running_mean, norm.running_var)
    want = si_reference(z, op.weight.detach(), gamma, beta, 0.1, stats)
    torch.testing.assert_close(norm(z), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dim", [1, 2])
def test_bn_si_gradcheck_through_the_op_weight(dim):
    torch.manual_seed(1)
    op = nn.Linear(4, 3).to(DT) if dim == 1 else nn.Conv2d(2, 3, 2).to(DT)
    norm = randomize((ScaleInvariantBN1d if dim == 1 else ScaleInvariantBN2d)(3, op, eps=0.1).to(DT))
    model = nn.Sequential(op, norm)
    x = torch.randn((5, 4) if dim == 1 else (2, 2, 3, 3), dtype=DT)
    inputs = {"0.weight": op.weight, "1.weight": norm.weight, "1.bias": norm.bias}
    assert gradcheck_module(model, inputs, x)
    model.eval()
    assert gradcheck_module(model, inputs, x)


def test_bn_si_binding_errors_and_state():
    norm = ScaleInvariantBN2d(3)
    with pytest.raises(RuntimeError, match="bind"):
        norm(torch.randn(2, 3, 2, 2))
    with pytest.raises(ValueError, match="3 rows"):
        norm.bind(nn.Conv2d(3, 4, 1))
    conv = nn.Conv2d(2, 3, 1)
    norm.bind(conv)
    assert set(norm.state_dict()) == {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}
    assert len(list(norm.parameters())) == 2  # the op's weight is not adopted


# -- scale-invariance tags ---------------------------------------------------------------------

TAG_CASES = [
    (nn.BatchNorm2d(3), False, True),
    (nn.BatchNorm1d(3), True, True),
    (NormFamily2d(3), True, True),
    (NormFamily2d(3, center=False), False, True),
    (NormFamily2d(3, center=False), True, False),
    (NormFamily2d(3, rho=4.0), False, True),
    (NormFamily2d(3, scale=False), False, False),
    (NormFamily2d(3, decouple=True), False, False),
    (POPNorm2d(3), False, False),
    (CBN2d(3), False, False),
    (NormFamily2d(3, amat=True), False, False),
    (ScaleInvariantBN2d(3), True, True),
    (BatchRenorm2d(3), False, False),
    (nn.GroupNorm(1, 3), False, True),
    (nn.GroupNorm(1, 3), True, False),
    (nn.LayerNorm(3), False, True),
    (nn.Identity(), False, False),
]


@pytest.mark.parametrize("norm,op_bias,expected", TAG_CASES, ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else str(v))
def test_is_scale_invariant_rules(norm, op_bias, expected):
    assert is_scale_invariant(norm, op_bias=op_bias) is expected


def small_net(make_norm, op_bias: bool) -> tuple[nn.Module, list[tuple[nn.Module, nn.Module]]]:
    """after_op: conv -> N -> softplus -> conv -> N -> linear, in float64."""
    torch.manual_seed(0)
    conv1, conv2 = nn.Conv2d(2, 4, 3, padding=1, bias=op_bias), nn.Conv2d(4, 3, 3, padding=1, bias=op_bias)
    n1, n2 = randomize(make_norm(4, conv1), 1), randomize(make_norm(3, conv2), 2)
    model = nn.Sequential(conv1, n1, nn.Softplus(), conv2, n2, nn.Flatten(), nn.Linear(3 * 4 * 4, 5)).to(DT)
    return model, [(conv1, n1), (conv2, n2)]


def loss_after_scaling(model, pairs, x, target, factor, op_bias):
    """Training-mode loss of a copy whose tagged weights are multiplied by ``factor``."""
    index = {id(m): i for i, m in enumerate(model)}
    scaled = copy.deepcopy(model)
    tagged = 0
    for op, norm in pairs:
        if is_scale_invariant(norm, op_bias=op_bias):
            with torch.no_grad():
                scaled[index[id(op)]].weight.mul_(factor)
            tagged += 1
    return nn.functional.cross_entropy(scaled(x), target).item(), tagged


NORMS = {
    # eps = 1e-30 (torch's BN refuses 0): the plain norms are exactly invariant only without eps.
    "torch_bn": lambda c, op: nn.BatchNorm2d(c, eps=TINY),
    "family_coupled": lambda c, op: NormFamily2d(c, rho=2.0, eps=TINY),
    "family_division_only": lambda c, op: NormFamily2d(c, center=False, rho=2.0, eps=TINY),
    "group_norm": lambda c, op: nn.GroupNorm(1, c, eps=TINY),
    "bn_si": lambda c, op: ScaleInvariantBN2d(c, op),
}


@pytest.mark.parametrize("name,op_bias", [(n, b) for n in NORMS for b in (False, True)])
def test_scaling_tagged_weights_leaves_the_loss_unchanged(name, op_bias):
    model, pairs = small_net(NORMS[name], op_bias)
    x = torch.randn(4, 2, 4, 4, generator=torch.Generator().manual_seed(5), dtype=DT)
    target = torch.tensor([0, 3, 1, 4])
    base, _ = loss_after_scaling(model, pairs, x, target, 1.0, op_bias)
    scaled, tagged = loss_after_scaling(model, pairs, x, target, 3.0, op_bias)
    assert tagged == (0 if name in ("family_division_only", "group_norm") and op_bias else 2)
    assert abs(scaled - base) < 1e-10


def test_untagged_decoupled_weights_are_not_scale_invariant():
    model, pairs = small_net(lambda c, op: NormFamily2d(c, decouple=True, eps=TINY), False)
    assert not any(is_scale_invariant(norm) for _, norm in pairs)
    x = torch.randn(4, 2, 4, 4, generator=torch.Generator().manual_seed(5), dtype=DT)
    target = torch.tensor([0, 3, 1, 4])
    before = nn.functional.cross_entropy(copy.deepcopy(model)(x), target).item()
    for op, _ in pairs:
        with torch.no_grad():
            op.weight.mul_(3.0)
    after = nn.functional.cross_entropy(model(x), target).item()
    assert abs(after - before) > 1e-4


def test_bn_si_stays_invariant_where_plain_bn_breaks_on_a_tiny_variance_channel():
    x = torch.randn(4, 2, 4, 4, generator=torch.Generator().manual_seed(5), dtype=DT)
    target = torch.tensor([0, 3, 1, 4])
    changes = {}
    for name in ("torch_bn_eps", "bn_si"):
        make = (lambda c, op: nn.BatchNorm2d(c)) if name == "torch_bn_eps" else NORMS["bn_si"]
        model, pairs = small_net(make, False)
        with torch.no_grad():
            model[0].weight[0].mul_(1e-4)  # channel 0's pre-norm activations are nearly constant
        z = model[0](x)[:, 0]
        assert z.var(unbiased=False) < 1e-3 * EPS
        base, _ = loss_after_scaling(model, pairs, x, target, 1.0, False)
        scaled, tagged = loss_after_scaling(model, pairs, x, target, 3.0, False)
        assert tagged == 2
        changes[name] = abs(scaled - base)
    assert changes["bn_si"] < 1e-10
    assert changes["torch_bn_eps"] > 1e-4


# -- torch.compile ------------------------------------------------------------------------------


def conv_bn_si():
    conv = nn.Conv2d(3, 3, 1)
    return nn.Sequential(conv, ScaleInvariantBN2d(3, conv))


COMPILED = {
    "family_decoupled": (lambda: NormFamily2d(3, decouple=True, rho=2.0), True),
    "cbn_amat": (lambda: CBN2d(3), True),
    "cbn_amat_printed_order_clipped": (lambda: CBN2d(3, amat_update="after_forward", amat_r_max=0.95), True),
    "popnorm": (lambda: POPNorm2d(3), True),
    "brn_schedule": (lambda: BatchRenorm2d(3, relax_start=1, r_max_step=3, d_max_step=2), False),
    "bn_si": (conv_bn_si, False),
    "bn_4things": (lambda: FourThingsBN2d(3, ghost_batch=2, groups=3, alpha=0.2), True),  # a short last ghost batch
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPILED))
def test_torch_compile_matches_eager(name):
    make, check_eval = COMPILED[name]
    torch.manual_seed(0)
    eager = make()
    for m in eager.modules():
        if isinstance(m, (NormFamily2d, BatchRenorm2d)):
            randomize(m, 3)
    compiled_module = copy.deepcopy(eager)
    compiled = torch.compile(compiled_module, dynamic=False)
    set_learning_rate(eager, 0.05)
    set_learning_rate(compiled_module, 0.05)
    for step in range(3):
        x1 = batch(2, step, torch.float32).requires_grad_()
        x2 = x1.detach().clone().requires_grad_()
        up = torch.randn(x1.shape, generator=torch.Generator().manual_seed(100 + step))
        y1, y2 = eager(x1), compiled(x2)
        (y1 * up).sum().backward()
        (y2 * up).sum().backward()
        torch.testing.assert_close(y2, y1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-5)
    for (name1, p1), (_, p2) in zip(eager.named_parameters(), compiled_module.named_parameters()):
        torch.testing.assert_close(p2.grad, p1.grad, rtol=1e-5, atol=1e-5, msg=name1)
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(compiled_module.state_dict()[key], value, rtol=1e-5, atol=1e-5, msg=key)
    if check_eval:
        eager.eval()
        compiled_module.eval()
        x = batch(2, 7, torch.float32)
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-5)
