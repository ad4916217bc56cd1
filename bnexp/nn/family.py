"""The normalization family of METHODS.md section 2: one module, flags, and its presets.

Every forward is written as a per-channel affine map ``y = a * x + b`` whose ``a`` and ``b``
come from a handful of per-channel tensors, so the only full-size work is one statistics
pass (training) and one per-channel multiply-add.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from bnexp.nn._base import FEATURES, IMAGES, ChannelNorm, affine, check_fraction, widen
from bnexp.nn._fused import scaled_norm
from bnexp.nn.create_norm import Builder, register_norm
from bnexp.support.distributed import world_size

AMAT_OMEGA = 10.0  # CBN's omega: eta_k = max(1 - omega * lr_k, 0)
ETA_BUFFER = "amat_eta_now"  # adaptive AMAT's eta of the coming step: set by the run's hook, not a layer's value
AMAT_MEAN_GUARD = 1e-6  # |mu_B| below this: r_mu = 1 (no ratio through a vanishing mean)
BEFORE_FORWARD = "before_forward"  # update mu_A, sigma_A^2 with the current batch, then normalize
AFTER_FORWARD = "after_forward"  # normalize with the averages of earlier batches, then update them
AMAT_UPDATES = (BEFORE_FORWARD, AFTER_FORWARD)
ADAPTIVE = "adaptive"  # amat_eta = max(1 - omega * lr, 0), the paper's; a float fixes eta
# bnexp's default bound on r_mu = mu_A / mu_B (the paper leaves it unclipped: amat_r_max=None);
# batch renormalization's usual limit. docs/methods/cbn.md has the measurements behind it.
AMAT_R_MAX = 3.0


class NormFamily(ChannelNorm):
    """Flag-driven normalization (METHODS.md section 2); use the 1d/2d subclasses.

    Training, coupled: ``y = gamma * (x + t) / sigma / rho + beta``; decoupled:
    ``y = (gamma / rho) * (x + t) / sigma``. Here ``t = -mu_B`` when centering (else 0), plus
    ``beta`` when decoupled, and ``sigma = sqrt(mean_B((x + t)^2) + eps)``, the batch l2 norm
    of exactly what gets divided, computed as ``var_B + (mu_B + t)^2``. ``scale=False`` drops
    ``sigma``. Eval mode plugs the running mean and (unbiased) variance, tracked as
    torch.nn.BatchNorm does, into the same expressions, with the current ``beta``.
    ``gamma=False`` has no learnable ``gamma`` (POP-Norm's eq. (11) alone is ``x - mu_B +
    beta``): ``weight`` is then a constant 1 per channel, a buffer outside the state_dict
    that no optimizer sees, and the expressions above hold with ``gamma = 1``.

    ``amat=True`` replaces the running statistics by CBN's adaptive moving averages
    (``amat_mean`` = mu_A, ``amat_var`` = sigma_A^2, ``amat_steps``), used by the training
    forward through stop-gradient ratios and by eval directly. ``amat_eta=None`` is the
    adaptive ``eta_k = max(1 - 10 lr_k, 0)``, which needs :func:`set_learning_rate` before
    every training step but the first (``"adaptive"`` says the same); a float fixes eta.
    ``momentum`` is unused with AMAT.
    ``amat_update="before_forward"`` (the default, METHODS.md's revised order) adds the
    current batch to the averages before normalizing with them, so ``eta = 0`` is plain
    batch statistics; ``"after_forward"`` is Algorithm 1 as printed (earlier batches only).
    ``amat_r_max`` clips ``r_mu = mu_A / mu_B`` into ``[-r_max, r_max]``: 3 by default, bnexp's
    departure from the paper's unclipped ratio (``None``); ignored without AMAT.

    The forward divides by ``rho_channels``, a per-channel buffer (not state: it is not in
    the state_dict) filled with ``rho`` in float64, so that any rho is exact in a float64
    model. A pack of runs with other rho (:mod:`bnexp.models.packing`) holds each run's rho in
    its run's channels, and a compiled graph reads rho as an input instead of a constant.
    The attributes of :data:`PER_RUN` may differ between the runs of a pack for that reason.
    """

    PER_RUN = ("rho",)  # plain attributes a pack may hold per run (the forward reads rho_channels)

    def __init__(
        self,
        num_features: int,
        center: bool = True,
        scale: bool = True,
        decouple: bool = False,
        rho: float = 1.0,
        amat: bool = False,
        eps: float = 1e-5,
        momentum: float = 0.1,
        amat_eta: Union[float, str, None] = None,
        amat_update: str = BEFORE_FORWARD,
        amat_r_max: Optional[float] = AMAT_R_MAX,
        sync: bool = False,
        gamma: bool = True,
    ) -> None:
        super().__init__(num_features, eps, sync)
        if not isinstance(gamma, bool):
            raise ValueError(f"gamma must be true or false, got {gamma!r}")
        self.gamma = gamma
        if not gamma:  # no learnable scale: the forward multiplies by a constant 1
            del self.weight
            self.register_buffer("weight", torch.ones(num_features), persistent=False)
        if amat_eta == ADAPTIVE:
            amat_eta = None
        if amat_eta is not None and (isinstance(amat_eta, (bool, str)) or not isinstance(amat_eta, (int, float))):
            raise ValueError(f"amat_eta must be 'adaptive' or a number in [0, 1], got {amat_eta!r}")
        if rho <= 0:
            raise ValueError(f"rho must be positive, got {rho}")
        check_fraction("momentum", momentum)
        if amat and not (center and scale):
            raise ValueError("amat=True needs center=True and scale=True: AMAT averages both statistics")
        if amat_eta is not None:
            if not amat:
                raise ValueError("amat_eta is only meaningful with amat=True")
            check_fraction("amat_eta", amat_eta)
        if amat_update not in AMAT_UPDATES:
            raise ValueError(f"amat_update must be one of {', '.join(AMAT_UPDATES)}, got {amat_update!r}")
        if amat_r_max is not None and not amat_r_max > 0:
            raise ValueError(f"amat_r_max must be positive (or None: unclipped), got {amat_r_max!r}")
        self.center = center
        self.scale = scale
        self.decouple = decouple
        self.rho = float(rho)  # as given (a pack's first run's); the forward reads rho_channels
        self.register_buffer("rho_channels", torch.full((num_features,), float(rho), dtype=torch.float64),
                             persistent=False)
        self.amat = amat
        self.momentum = momentum
        self.amat_eta = amat_eta
        self.amat_update = amat_update
        self.amat_r_max = amat_r_max
        if amat:
            self.register_buffer("amat_mean", torch.zeros(num_features))
            self.register_buffer("amat_var", torch.ones(num_features))
            self.register_buffer("amat_steps", torch.tensor(0, dtype=torch.long))
            if amat_eta is None:
                # eta of the coming step, from the lr that set_learning_rate hands in before each
                # step (a buffer, so a changing lr costs no recompilation); not state.
                self.register_buffer(ETA_BUFFER, torch.tensor(float("nan")), persistent=False)
                self._lr_known = False
        else:
            self.register_buffer("running_mean", torch.zeros(num_features))
            self.register_buffer("running_var", torch.ones(num_features))
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def extra_repr(self) -> str:
        text = (
            f"{self.num_features}, center={self.center}, scale={self.scale}, decouple={self.decouple}, "
            f"rho={self.rho}, amat={self.amat}, eps={self.eps}"
        )
        if self.amat:
            eta = "adaptive" if self.amat_eta is None else self.amat_eta
            text += f", amat_eta={eta}, amat_update={self.amat_update}, amat_r_max={self.amat_r_max}"
        else:
            text += f", momentum={self.momentum}"
        return text if self.gamma else text + ", gamma=False"

    def set_learning_rate(self, lr: float) -> None:
        """Take the coming step's learning rate: adaptive AMAT sets ``eta_k = max(1 - 10 lr, 0)``.

        eta is computed here in double precision, so ``lr >= 0.1`` gives exactly 0 whatever the
        buffer's dtype. A fixed ``amat_eta`` ignores the learning rate.
        """
        if not self.amat:
            raise RuntimeError(f"{type(self).__name__} without AMAT does not use a learning rate")
        if self.amat_eta is None:
            self.amat_eta_now.fill_(max(1.0 - AMAT_OMEGA * lr, 0.0))
            self._lr_known = True

    def read_eta_from(self, eta: Tensor) -> None:
        """Adaptive AMAT: take eta from ``eta`` (this layer's dtype and device), which its owner
        updates in place (:func:`set_adaptive_eta`) before each training step, so that one
        tensor at a fixed address serves every layer (what a CUDA graph needs). In a packed
        model whose K runs differ in their learning rate, ``eta`` holds K values, run ``k``'s
        for its block of channels."""
        if self.amat and self.amat_eta is None:
            self.amat_eta_now = eta
            self._lr_known = True

    def forward(self, x: Tensor) -> Tensor:
        self.check_input(x)
        if self.amat:
            return self._amat_train(x) if self.training else self._amat_eval(x)
        if not self.training:
            return self._from_stats(x, self.running_mean, self.running_var)
        n = x.numel() // self.num_features
        if n < 2:
            raise ValueError(f"{type(self).__name__} needs more than 1 value per channel in training, got {n}")
        if self._fused():
            with torch.no_grad():
                var, mean = self.batch_var_mean(x)
            self._track(mean, var, n)
            k = 1.0 if self.center else 0.0
            return scaled_norm(x, self.weight, self.bias, mean, var, k, 1.0, self._rho(), self.eps, self.decouple)
        wide = widen(x)
        var, mean = self.batch_var_mean(wide)
        self._track(mean, var, n)
        return self._from_stats(wide, mean, var).to(x.dtype)

    def _fused(self) -> bool:
        """Whether the training forward can use the closed-form backward of
        :func:`bnexp.nn._fused.scaled_norm`: it divides, its statistics are this process's,
        and its eps is a constant (``bn_si`` and ``norm.sync`` keep autograd's backward)."""
        return self.scale and not self.sync and isinstance(self._variance_eps(), float)

    # -- the formula, shared by every mode --------------------------------------------------

    def _with_beta(self, v: Optional[Tensor]) -> Optional[Tensor]:
        """``v + beta`` in the decoupled form (``None`` stands for zero), ``v`` otherwise."""
        if not self.decouple:
            return v
        return self.bias if v is None else v + self.bias

    def _variance_eps(self) -> Union[float, Tensor]:
        """What is added to the second moment under the square root."""
        return self.eps

    def _sigma(self, var: Tensor, resid: Optional[Tensor]) -> Tensor:
        """``sqrt(mean((x + t)^2) + eps)`` from ``var`` and ``resid = mean(x + t)`` (None: 0)."""
        second = var if resid is None else var + resid.square()
        return (second + self._variance_eps()).sqrt()

    def _rho(self) -> Tensor:
        """rho per channel in the parameters' dtype (what a Python number would be rounded to)."""
        return self.rho_channels.to(self.weight.dtype)

    def _output(self, x: Tensor, t: Optional[Tensor], sigma: Optional[Tensor]) -> Tensor:
        """``gamma / rho * (x + t) / sigma`` plus ``beta`` after the division when coupled."""
        a = self.weight / self._rho() if sigma is None else self.weight / (sigma * self._rho())
        b = None if t is None else a * t
        if not self.decouple:
            b = self.bias if b is None else b + self.bias
        return affine(x, a, b)

    def _from_stats(self, x: Tensor, mean: Tensor, var: Tensor) -> Tensor:
        """The plain (non-AMAT) forward from per-channel statistics, batch or running."""
        t = self._with_beta(-mean if self.center else None)
        if not self.scale:
            return self._output(x, t, None)
        resid = self._with_beta(None if self.center else mean)
        return self._output(x, t, self._sigma(var, resid))

    def _track(self, mean: Tensor, var: Tensor, n: int) -> None:
        """torch.nn.BatchNorm's running-statistics update (unbiased variance)."""
        if self.sync:  # the statistics cover every process's batch (equal batch sizes)
            n *= world_size()
        with torch.no_grad():
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * (n / (n - 1)), self.momentum)
            self.num_batches_tracked.add_(1)

    # -- AMAT (CBN Algorithm 1) -------------------------------------------------------------

    def _amat_train(self, x: Tensor) -> Tensor:
        if self.amat_eta is None and not self._lr_known and bool(self.amat_steps > 0):
            raise RuntimeError(
                f"{type(self).__name__} uses adaptive AMAT (eta = max(1 - 10 lr, 0)) but no learning "
                "rate was given: call bnexp.nn.set_learning_rate(model, lr) before each training step"
            )
        if self._fused():  # the closed-form backward accounts for the statistics itself
            with torch.no_grad():
                var, mean = self.batch_var_mean(x)
                r_mu, _, r_sigma = self._amat_step(mean, var)
            return scaled_norm(x, self.weight, self.bias, mean, var, r_mu, r_sigma, self._rho(), self.eps,
                               self.decouple)
        wide = widen(x)
        var, mean = self.batch_var_mean(wide)
        r_mu, sigma, r_sigma = self._amat_step(mean, var)
        # r_mu * mean has the value mu_A and the gradient of mu_B
        return self._output(wide, self._with_beta(-r_mu * mean), r_sigma * sigma).to(x.dtype)

    def _amat_new_weight(self) -> Tensor:
        """``1 - eta_k``, the weight of the current batch in eqs. (8)-(9); 1 on the first step."""
        eta = self.amat_eta_now if self.amat_eta is None else torch.full_like(self.amat_mean[0], self.amat_eta)
        if eta.dim():  # one eta per run of a pack whose runs differ in their lr: each over its channels
            eta = eta.repeat_interleave(self.num_features // len(eta))
        return 1.0 - torch.where(self.amat_steps == 0, 0.0, eta)

    def _amat_in_use(self, average: Tensor, updated: Tensor, batch: Tensor) -> Tensor:
        """The average a training forward uses: the one updated with this batch
        (``before_forward``), or the stored one (``after_forward``; the batch's own value on
        the first step)."""
        if self.amat_update == BEFORE_FORWARD:
            return updated
        return torch.where(self.amat_steps == 0, batch, average)

    def amat_mean_ratio(self, mean: Tensor, updated: Optional[Tensor] = None) -> Tensor:
        """``r_mu`` of the coming training forward, given its batch mean ``mu_B``: ``mu_A / mu_B``
        with ``mu_A`` as that forward uses it (this batch averaged in first under
        ``before_forward``; ``updated``, that average, when the caller has it), 1 on the first
        step and where ``|mu_B|`` is below :data:`AMAT_MEAN_GUARD`, clipped into
        ``[-amat_r_max, amat_r_max]``. Changes nothing; the forward centres with ``r_mu * mu_B``
        (the ``amat`` and ``eta_tau`` probes read it)."""
        with torch.no_grad():
            if updated is None:
                updated = torch.lerp(self.amat_mean, mean, self._amat_new_weight())
            mu_a = self._amat_in_use(self.amat_mean, updated, mean)
            r_mu = torch.where((self.amat_steps == 0) | (mean.abs() < AMAT_MEAN_GUARD), 1.0, mu_a / mean)
            return r_mu if self.amat_r_max is None else r_mu.clamp(-self.amat_r_max, self.amat_r_max)

    def _amat_step(self, mean: Tensor, var: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """One training step of AMAT: ``r_mu = mu_A / mu_B``, ``sigma_B`` and ``r_sigma = sigma_A /
        sigma_B`` (the ratios constants for autograd, ``sigma_B`` differentiable with the inputs),
        with the averages updated by eqs. (8)-(9) before or after use, as ``amat_update`` says.

        ``r_mu`` is :meth:`amat_mean_ratio`. The buffers are replaced, not written in place: the
        backward may still need the tensors the ratios were made from, and under torch.compile
        an in-place write lets it recompute them from the new values (silently wrong gradients).
        """
        with torch.no_grad():
            first = self.amat_steps == 0
            new = self._amat_new_weight()
            mean_a = torch.lerp(self.amat_mean, mean, new)
            r_mu = self.amat_mean_ratio(mean, mean_a)
        sigma = self._sigma(var, self._with_beta(mean - r_mu * mean))
        with torch.no_grad():
            second = sigma.square()
            var_a = torch.lerp(self.amat_var, second, new)
            r_sigma = torch.where(first, 1.0, self._amat_in_use(self.amat_var, var_a, second).sqrt() / sigma)
            self.amat_mean, self.amat_var, self.amat_steps = mean_a, var_a, self.amat_steps + 1
        return r_mu, sigma, r_sigma

    def _amat_eval(self, x: Tensor) -> Tensor:
        return self._output(x, self._with_beta(-self.amat_mean), self.amat_var.sqrt())


class NormFamily1d(NormFamily):
    """The normalization family over features: (N, C) or (N, C, L) inputs."""

    input_dims = FEATURES


class NormFamily2d(NormFamily):
    """The normalization family over images: (N, C, H, W), statistics over N*H*W per channel."""

    input_dims = IMAGES


class _Preset:
    """A member of the family defined by its own defaults (``PRESET``); every flag of
    :class:`NormFamily` can still be passed (the CBN ablation rows change some)."""

    PRESET: dict[str, Any] = {}
    ALIASES: dict[str, str] = {}  # a paper's name for a flag -> the flag

    def __init__(self, num_features: int, **kw: Any) -> None:
        kw = {self.ALIASES.get(key, key): value for key, value in kw.items()}
        super().__init__(num_features, **{**self.PRESET, **kw})  # type: ignore[call-arg]


class CBN1d(_Preset, NormFamily1d):
    """Complete BN over features: centered, scaled, decoupled, rho (default 1), AMAT with
    ``r_mu`` clipped to ``[-3, 3]`` (``norm=cbn``; ``amat_r_max=None``: the paper's form)."""

    PRESET = {"decouple": True, "amat": True}


class CBN2d(_Preset, NormFamily2d):
    """Complete BN over images: centered, scaled, decoupled, rho (default 1), AMAT with
    ``r_mu`` clipped to ``[-3, 3]`` (``norm=cbn``; ``amat_r_max=None``: the paper's form)."""

    PRESET = {"decouple": True, "amat": True}


class POPNorm1d(_Preset, NormFamily1d):
    """POP-Norm over features: centered, scaled, decoupled, output divided by ``rho``, the
    paper's kappa (default 4; ``kappa=`` works too; ``norm=popnorm``)."""

    PRESET = {"decouple": True, "rho": 4.0}
    ALIASES = {"kappa": "rho"}


class POPNorm2d(_Preset, NormFamily2d):
    """POP-Norm over images: centered, scaled, decoupled, output divided by ``rho``, the
    paper's kappa (default 4; ``kappa=`` works too; ``norm=popnorm``)."""

    PRESET = {"decouple": True, "rho": 4.0}
    ALIASES = {"kappa": "rho"}


def set_learning_rate(model: nn.Module, lr: float) -> int:
    """Hand ``lr`` to every AMAT normalization in ``model``; returns how many there are."""
    layers = [m for m in model.modules() if isinstance(m, NormFamily) and m.amat]
    for m in layers:
        m.set_learning_rate(lr)
    return len(layers)


def set_adaptive_eta(eta: Tensor, lr: Tensor) -> None:
    """``eta = max(1 - omega * lr, 0)`` from a float64 learning rate on the device, in place:
    the float64 operations :meth:`NormFamily.set_learning_rate` does on a Python float, then
    one rounding to ``eta``'s dtype, so the same value."""
    eta.copy_((1.0 - AMAT_OMEGA * lr).clamp_min(0.0))


# The flags of bnexp.nn.NormFamily (METHODS.md section 2), shared by its presets.
FAMILY_KEYS = ("center", "scale", "decouple", "rho", "amat", "eps", "momentum", "amat_eta", "amat_update",
               "amat_r_max", "sync", "gamma")
BN_FLAGS = {"center": True, "scale": True, "decouple": False, "rho": 1.0, "amat": False, "sync": False,
            "gamma": True}


def batch_norm(family: type[nn.Module], torch_bn: type[nn.modules.batchnorm._BatchNorm]) -> Builder:
    """torch's own BatchNorm where the family's flags are BN's (faster kernels), the family
    member with those flags otherwise (the CBN ablation rows, ``norm.sync``)."""

    def make(num_features: int, **options: Any) -> nn.Module:
        if all(options.get(key, default) == default for key, default in BN_FLAGS.items()):
            return torch_bn(num_features, eps=options.get("eps", 1e-5), momentum=options.get("momentum", 0.1))
        return family(num_features, **options)

    return make


def as_norm_family(bn: nn.modules.batchnorm._BatchNorm) -> NormFamily:
    """The family member with BN's flags that computes what torch's BatchNorm ``bn`` computes,
    holding its weights and statistics (in its dtype, on its device, in its mode): the form a
    pack gives a BN layer whose other runs have another rho (:mod:`bnexp.models.packing`)."""
    family = NormFamily2d if isinstance(bn, nn.BatchNorm2d) else NormFamily1d
    out = family(bn.num_features, eps=bn.eps, momentum=bn.momentum)
    out.to(device=bn.weight.device, dtype=bn.weight.dtype).train(bn.training)
    out.load_state_dict(bn.state_dict())
    return out


register_norm("batchnorm", batch_norm(NormFamily1d, nn.BatchNorm1d), batch_norm(NormFamily2d, nn.BatchNorm2d),
              FAMILY_KEYS, short="bn")
register_norm("norm_family", NormFamily1d, NormFamily2d, FAMILY_KEYS, short="family")  # bnexp's code always
register_norm("cbn", CBN1d, CBN2d, FAMILY_KEYS)
register_norm("popnorm", POPNorm1d, POPNorm2d, FAMILY_KEYS)
