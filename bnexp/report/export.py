"""``bnexp export RUN [format=torchvision|safetensors] [out=FILE]``: a finished run's final
weights in a form other tools load.

- ``torchvision``: for ResNet-18/50 and EfficientNet-B0 trained with ``norm=bn`` after each
  op (and torchvision's activation: ReLU, SiLU for EfficientNet), a ``state_dict`` that
  ``torchvision.models.<model>(num_classes=K)`` loads with ``strict=True`` and that gives
  the same logits. bnexp's modules hold the same tensors in the same order as
  torchvision's, so the mapping is positional, checked shape by shape. Default file:
  ``<run>/torchvision_<model>.pt``.
- ``safetensors`` (any run; the default where torchvision has no counterpart): the weights as a safetensors file plus a JSON sidecar
  (``<file>.json``) with what :func:`rebuild` needs to build the model again (model, norm
  and activation settings, classes, channels, image size). Default: ``<run>/model.safetensors``.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Mapping

import torch
import torchvision
from omegaconf import DictConfig, OmegaConf
from torch import nn

from bnexp.engine import checkpoint
from bnexp.models import DataSpec, build_model
from bnexp.support.errors import ConfigError, unknown_choice
from bnexp.support.options import exit_on_error, output_errors, run_dir_argument, split_options
from bnexp.support.runinfo import atomic_write, read_run_json, version_stamp
from bnexp.support.untrusted import CHECKPOINT_FILE, RECORD_FILE, read_regular, read_regular_text

FORMATS = ("torchvision", "safetensors")
TORCHVISION_ACT = {"resnet18": "relu", "resnet50": "relu", "efficientnet_b0": "swish"}  # torchvision's activation


def run_parts(run_dir: Path) -> tuple[DictConfig, dict[str, torch.Tensor], DataSpec]:
    """A finished run's config, final weights and data shape (classes from its summary)."""
    cfg, payload = checkpoint.finished_run(run_dir, "export")
    path = run_dir / "summary.json"
    summary = read_run_json(path) if path.is_file() else {}
    weights = payload["model"]
    classes = summary.get("num_classes") or cfg.data.num_classes
    if isinstance(classes, bool) or not isinstance(classes, int) or classes < 1:
        raise ConfigError(f"damaged summary.json {path}: num_classes {classes!r} is not a number of classes")
    spec = DataSpec(classes, int(cfg.data.get("channels", 3)), int(cfg.data.get("image_size", 32)))
    return cfg, weights, spec


def torchvision_state(cfg: DictConfig, weights: Mapping[str, torch.Tensor], classes: int) -> dict[str, torch.Tensor]:
    """``weights`` under torchvision's names for ``cfg``'s model, or a ConfigError saying why not."""
    model, norm, act = str(cfg.model.name), str(cfg.norm.name), str(cfg.act.name)
    placement = cfg.norm.get("placement", "after_op")
    if model not in TORCHVISION_ACT or norm != "bn" or placement != "after_op" or act != TORCHVISION_ACT[model]:
        wanted = ", ".join(f"model={m} act={a}" for m, a in TORCHVISION_ACT.items())
        raise ConfigError(f"format=torchvision needs a torchvision architecture trained as torchvision builds it "
                          f"({wanted}, each with norm=bn after_op); this run is model={model} norm={norm} "
                          f"({placement}) act={act}: use format=safetensors")
    theirs = getattr(torchvision.models, model)(num_classes=classes).state_dict()
    ours = list(weights.items())
    if len(ours) != len(theirs) or any(v.shape != t.shape for (_, v), t in zip(ours, theirs.values())):
        raise ConfigError(f"format=torchvision: the run's {len(ours)} tensors do not line up with torchvision's "
                          f"{model} ({len(theirs)}; model.width other than the default?): use format=safetensors")
    return {name: value for name, (_, value) in zip(theirs, ours)}


def sidecar(cfg: DictConfig, spec: DataSpec) -> dict[str, Any]:
    """What :func:`rebuild` needs besides the weights."""
    return {"model": OmegaConf.to_container(cfg.model, resolve=True), "norm": OmegaConf.to_container(cfg.norm,
            resolve=True), "act": str(cfg.act.name), "data_spec": {"num_classes": spec.num_classes,
            "in_channels": spec.in_channels, "image_size": spec.image_size}, **version_stamp()}


def fitted_model(info: Mapping[str, Any], weights: Mapping[str, torch.Tensor], source: str) -> nn.Module:
    """The model ``info`` (a :func:`sidecar`) describes with ``weights`` loaded (eval mode); a
    ConfigError naming ``source`` if they do not fit it."""
    model = build_model(info["model"], info["norm"], info["act"], DataSpec(**info["data_spec"]))
    try:
        model.load_state_dict(weights)
    except RuntimeError as err:
        raise ConfigError(f"{source}: the weights do not fit the model its settings describe "
                          f"({str(err).splitlines()[1].strip()})") from None
    return model.eval()


def rebuild(path: Path) -> nn.Module:
    """The model a ``format=safetensors`` export holds, weights loaded (eval mode)."""
    from safetensors.torch import load

    return fitted_model(json.loads(read_regular_text(f"{path}.json", RECORD_FILE)), load(read_regular(path, CHECKPOINT_FILE)),
                        str(path))


def same_logits(ours: nn.Module, cfg: DictConfig, state: Mapping[str, torch.Tensor], spec: DataSpec) -> None:
    """A ConfigError unless torchvision's model with ``state`` computes the logits of ``ours``,
    the run's model (settings torchvision does not have, such as another ``norm.eps``, would
    change them)."""
    theirs = getattr(torchvision.models, str(cfg.model.name))(num_classes=spec.num_classes)
    theirs.load_state_dict(state)
    x = torch.randn(2, spec.in_channels, max(spec.image_size, 32), max(spec.image_size, 32),
                    generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(x), theirs.eval()(x)
    gap = (a - b).abs().max().item()
    if not gap <= 1e-4 * max(1.0, a.abs().max().item()):
        raise ConfigError(f"format=torchvision: torchvision's {cfg.model.name} with these weights computes other logits "
                          f"(largest difference {gap:.3g}; a setting torchvision lacks, such as norm.eps?): "
                          "use format=safetensors")


def write_files(files: Mapping[Path, bytes]) -> None:
    """Each file through :func:`atomic_write` (its folder made first); a ConfigError naming
    the folder that cannot be written (read-only, full) instead of an OSError."""
    for path, data in files.items():
        with output_errors(f"bnexp export: cannot write {path.name} in {path.parent}", "choose another file with "
                           "out=PATH"):
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, lambda f, data=data: f.write(data))


def export(run_dir: Path, fmt: str = "", out: str = "") -> Path:
    """Write a run's final weights in ``fmt`` (default: torchvision where the run has a
    torchvision counterpart, else safetensors); the file written. The weights must fit the
    model the run's config describes, as :func:`rebuild` will build it, before anything is
    written."""
    if fmt not in ("", *FORMATS):
        raise unknown_choice("format", fmt, FORMATS)
    cfg, weights, spec = run_parts(run_dir)
    info = sidecar(cfg, spec)
    ours = fitted_model(info, weights, f"bnexp export: {run_dir / checkpoint.FINAL} with {run_dir / 'config.yaml'}")
    if fmt in ("", "torchvision"):
        try:
            state = torchvision_state(cfg, weights, spec.num_classes)
            same_logits(ours, cfg, state, spec)
        except ConfigError:
            if fmt:
                raise
            state = None
        if state is not None:
            path = Path(out or run_dir / f"torchvision_{cfg.model.name}.pt")
            buffer = io.BytesIO()
            torch.save(state, buffer)
            write_files({path: buffer.getvalue()})
            return path
    try:
        from safetensors.torch import save
    except ImportError as err:
        raise ConfigError("format=safetensors needs the safetensors package: pip install 'bnexp[export]'") from err
    path = Path(out or run_dir / "model.safetensors")
    tensors = save({k: v.contiguous() for k, v in weights.items()}, metadata={"format": "bnexp"})
    # the sidecar first: no weights are written without what rebuilds them
    write_files({Path(f"{path}.json"): json.dumps(info, indent=2, default=str).encode(), path: tensors})
    return path


def command(args: list[str]) -> None:
    """``bnexp export RUN [format=torchvision|safetensors] [out=FILE]``."""
    def body() -> None:
        run_dir = run_dir_argument(args, "bnexp export RUN_DIR [format=torchvision|safetensors] [out=FILE]")
        options, extra = split_options(args[1:], {"format": "", "out": ""})
        if extra:
            raise ConfigError(f"unknown option {extra[0].partition('=')[0]!r}; options: format, out")
        print(export(run_dir, options.get("format", ""), options.get("out", "")))

    exit_on_error(body)
