"""The training step's fast paths: mixed precision, channels_last and torch.compile.

``trainer.amp`` (``off`` | ``bf16`` | ``fp16``) runs the forward under torch.autocast;
fp16 also scales the loss with a GradScaler, whose state goes into checkpoints.
``trainer.channels_last`` stores the model's conv weights and image inputs in NHWC order.
``trainer.compile`` compiles the forward (autocast included; AOTAutograd compiles its
backward with it) and the optimizer step with torch.compile. Under torchrun the model is
wrapped in DistributedDataParallel before compilation.
:class:`AmpCompileWrapper` wraps the model with these settings and does the backward and the
optimizer step they need; the model itself stays an ordinary module, so its state_dict, the
callbacks and the checkpoints never see the wrapper.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from bnexp.support.errors import ConfigError, unknown_choice

AMP_DTYPES: dict[str, Optional[torch.dtype]] = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def amp_mode(value: Any) -> str:
    """``trainer.amp`` as one of :data:`AMP_DTYPES` (YAML reads a bare ``off`` as false)."""
    mode = "off" if value is False or value is None else str(value)
    if mode not in AMP_DTYPES:
        raise unknown_choice("trainer.amp", value, AMP_DTYPES)
    return mode


class AmpCompileWrapper(nn.Module):
    """``model`` called under the run's memory format (channels_last), autocast (amp) and
    compiler (and DDP under torchrun), logits in float32 at least; with the backward (loss
    scaled under fp16) and the optimizer step (compiled under ``compile``) these need.

    Converts ``model`` to channels_last in place when asked (before the optimizer is built,
    so it sees the converted parameters). Owns the GradScaler (a no-op unless ``fp16``).
    """

    def __init__(self, model: nn.Module, device: torch.device, amp: str = "off", channels_last: bool = False,
                 compile: bool = False, distributed: bool = False) -> None:
        super().__init__()
        self.amp = amp_mode(amp)
        self.dtype = AMP_DTYPES[self.amp]
        self.device_type = device.type
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.model = model.to(memory_format=self.memory_format)
        if distributed:  # gradients all-reduced in backward; buffers are averaged by the trainer instead
            self.model = DistributedDataParallel(
                self.model, device_ids=[device] if device.type == "cuda" else None, broadcast_buffers=False
            )
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.amp == "fp16")
        self.compiled = compile
        self._step: Optional[tuple[Optimizer, Any]] = None  # (optimizer, its compiled step)
        if compile:
            # torch.compile by default does not guard on module hooks, so a graph traced for
            # one model would run for another of the same code with other hooks (or none),
            # silently skipping BNP's and the probes' forward hooks (lrsearch and bench build
            # several models in one process). Guarding on them costs little.
            torch._dynamo.config.skip_nnmodule_hook_guards = False
            # Fixed shapes: a partial last batch or the eval batch size gets its own graph
            # instead of turning every graph dynamic.
            self.compile(dynamic=False)

    @classmethod
    def from_config(cls, model: nn.Module, device: torch.device, cfg: Mapping[str, Any],
                    distributed: bool = False) -> AmpCompileWrapper:
        """From the ``trainer`` config group (missing keys mean off); ``distributed`` wraps DDP."""
        compile_ = cfg.get("compile", False)
        if not isinstance(compile_, bool):
            raise ConfigError(f"trainer.compile={compile_!r} is not valid: use true or false")
        return cls(model, device, cfg.get("amp", "off"), bool(cfg.get("channels_last", False)), compile_, distributed)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 4:
            x = x.contiguous(memory_format=self.memory_format)
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype is not None):
            out = self.model(x)
            return out.to(torch.promote_types(out.dtype, torch.float32))  # a float64 model keeps float64

    def backward(self, loss: Tensor, optimizer: Optimizer) -> None:
        """Backward through the (scaled) loss, then unscale: hooks see the true gradients."""
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: Optimizer) -> None:
        """The optimizer step (skipped by fp16 when a gradient overflowed) and scale update.

        Compiled with ``compile`` (except under fp16, whose scaler decides per step whether
        to step): each group's learning rate is then a 0-d tensor that the schedule updates
        in place, so a new rate is a new input value, not a new graph.
        """
        if not self.compiled or self.scaler.is_enabled():
            self.scaler.step(optimizer)
            self.scaler.update()
            return
        for group in optimizer.param_groups:  # again after a checkpoint restored float rates
            if not isinstance(group["lr"], Tensor):
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float64)
        if self._step is None or self._step[0] is not optimizer:
            if self._creates_state(optimizer):  # checked until the step is compiled, not every step
                optimizer.step()
                return
            self._step = (optimizer, torch.compile(optimizer.step))
        self._step[1]()

    @staticmethod
    def _creates_state(optimizer: Optimizer) -> bool:
        """Whether this step is the one that creates the optimizer's state (SGD's momentum
        buffers): some parameter with a gradient has none yet.

        That step runs eagerly. Traced, it breaks dynamo as soon as a second optimizer's step
        is compiled in the same process (a sweep's next job, a benchmark's next case): the
        recompiled state-creating branch fails with "speculation log divergence" (torch 2.11
        and 2.14; tests/test_speed_paths.py). Every later step, and every step of a resumed
        run (its state comes from the checkpoint), is compiled, so an interrupted run and an
        uninterrupted one run the same code at every step. An optimizer that keeps no state
        (SGD without momentum) steps eagerly throughout.
        """
        return any(p.grad is not None and not optimizer.state.get(p)
                   for group in optimizer.param_groups for p in group["params"])
