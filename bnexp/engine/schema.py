"""The typed schema of a composed ``bnexp train`` config: the type and range of every key.

pydantic checks it in strict mode (:func:`check_schema`, called by
:func:`bnexp.engine.config.validate`): a string is never read as a bool or a number (``"no"`` is
not ``false``), NaN and infinity are no numbers, and every bound is part of the type. One
schema per config group covers the keys of all its options (a key means the same in every
option that has it); a key may be absent, and keys the schema does not name pass unchecked
(the command line cannot add any: see :mod:`bnexp.app.cmdline`). docs/experiments.md
("Checked values") says why. The schema only checks: the config a run trains with, and so
its fingerprint, is the one Hydra composed.
"""

import types
from typing import Annotated, Any, Literal, Mapping, Optional, Union, get_args, get_origin, get_type_hints

from annotated_types import Ge, Gt, Le, Lt
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, with_config
from typing_extensions import TypedDict

from bnexp.data.imagenet import DECODES
from bnexp.data.loaders import LOADERS
from bnexp.data.sampling import SAMPLINGS
from bnexp.engine.amp_compile import AMP_DTYPES
from bnexp.engine.optim import OPTIMIZERS, SCHEDULES, UNITS, WARMUPS
from bnexp.models.bnp_nets import PADDINGS
from bnexp.nn.create_norm import JOINS, PLACEMENTS
from bnexp.nn.family import ADAPTIVE, AMAT_UPDATES
from bnexp.nn.packed import AUTO_CONV, PACK_CONVS
from bnexp.support.errors import ConfigError, unknown_choice

# numpy seeds its generator with 32 bits (trainer.seed, and each rank's or pack member's
# seed after it; data.split_seed through scikit-learn); torch.Generator takes 64 (data.seed).
MAX_SEED = 2**32 - 1
DEVICES = ("auto", "cpu", "cuda")
CHECKPOINT_UNITS = (*UNITS, "minute")  # minutes of wall time: bnexp/engine/trainer.py CheckpointClock
RESUME_MODES = ("auto", "never")  # or the path of a checkpoint file
MAX_DATA_SEED = 2**64 - 1
# Upper bounds: what one machine can do, each with its reason, which the error message gives.
MAX_WIDTH = 2**16
WIDTH_WHY = ("no bnexp model trains wider on one GPU: an MLP's hidden layer then holds 2**32 weights (16 GiB in "
             "float32)")
MAX_STEPS = 10**9
STEPS_WHY = ("10**9 steps (or epochs, or minutes) is over 11 days at 1 ms a step, faster than any bnexp model steps "
             "on an H100; the longest protocol trains 600,000 steps")
MAX_IMAGE_SIZE = 1024
IMAGE_WHY = ("ImageNet's protocols crop 224 pixels; beyond 1024 one batch of a ResNet's activations outgrows a GPU, "
             "and padding beyond it leaves a crop of padding only")
MAX_CHANNELS = 64
CHANNELS_WHY = "images have 1 or 3 channels; 64 leaves room for multispectral stacks"
MAX_IMAGES = 2**24
IMAGES_WHY = "2**24 images is 13 times ImageNet's training set"
MAX_CLASSES = 2**17
CLASSES_WHY = "ImageNet-21k has 21,841 classes; a 2048-wide classifier of 2**17 classes holds 1 GiB of weights"
MAX_BATCH = 2**20
BATCH_WHY = "2**20 images is 32 times the largest batches of large-batch ImageNet training"
MAX_MULT = 8.0
MULT_WHY = "EfficientNet-B7, the largest of the family, scales width by 2.0 and depth by 3.1"
MAX_PROCESSES = 1024
PROCESSES_WHY = "processes (or packed models) on one machine: 1024 is more than any node's GPUs or cores"
MAX_TIMEOUT = 7 * 24 * 3600
TIMEOUT_WHY = "a week outlasts any job's time limit"
MAX_KEPT = 1000
KEPT_WHY = "each periodic checkpoint holds the run's whole state (a ResNet-50's is 300 MB)"
MAX_SAMPLES = 2**16
SAMPLES_WHY = "each of a probe's samples is a full backward pass"


def choice(options: Any) -> Any:
    """The type of a key whose value is one of ``options``."""
    return Literal[tuple(options)]


# Strings are not bools or numbers, NaN and infinity are not numbers; keys the schema does not
# name pass (its TypedDicts ignore them).
STRICT = ConfigDict(strict=True, allow_inf_nan=False)

Positive = Annotated[float, Field(gt=0)]
NonNegative = Annotated[float, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0, le=1)]
Probability = Annotated[float, Field(ge=0, lt=1)]


def at_most(kind: type, low: float, high: float, why: str, above_low: bool = False) -> Any:
    """``kind`` from ``low`` (or above it) to ``high``; ``why`` says why not higher (in the error)."""
    return Annotated[kind, Field(**{"gt" if above_low else "ge": low}, le=high, description=why)]


Duration = at_most(float, 0, MAX_STEPS, STEPS_WHY)  # epochs, steps or minutes
Interval = at_most(float, 0, MAX_STEPS, STEPS_WHY, above_low=True)
Steps = at_most(int, 0, MAX_STEPS, STEPS_WHY)
ImageSize = at_most(int, 1, MAX_IMAGE_SIZE, IMAGE_WHY)
Images = at_most(int, 1, MAX_IMAGES, IMAGES_WHY)
Classes = at_most(int, 1, MAX_CLASSES, CLASSES_WHY)
Batch = at_most(int, 1, MAX_BATCH, BATCH_WHY)
Processes = at_most(int, 1, MAX_PROCESSES, PROCESSES_WHY)
Multiplier = at_most(float, 0, MAX_MULT, MULT_WHY, above_low=True)


@with_config(STRICT)
class ModelKeys(TypedDict, total=False):
    name: str
    width: Optional[at_most(int, 1, MAX_WIDTH, WIDTH_WHY)]
    width_mult: Optional[Multiplier]
    depth_mult: Optional[Multiplier]
    dropout: Optional[Probability]
    stochastic_depth: Optional[Probability]
    init_scale: Optional[Positive]
    padding: choice(PADDINGS)


@with_config(STRICT)
class BnpKeys(TypedDict, total=False):
    rho: Fraction
    eps1: NonNegative
    eps2: NonNegative


@with_config(STRICT)
class NormKeys(TypedDict, total=False):
    name: str
    layer: Optional[str]
    placement: choice(PLACEMENTS)
    join: choice(JOINS)
    classifier: bool
    input: bool
    center: bool
    scale: bool
    gamma: bool  # false: no learnable gamma (POP-Norm's eq. 11 alone)
    decouple: bool
    rho: Positive
    amat: bool
    amat_eta: Optional[Union[Literal[ADAPTIVE], Fraction]]  # null: adaptive
    amat_update: choice(AMAT_UPDATES)
    amat_r_max: Optional[Positive]
    eps: Positive
    momentum: Fraction
    r_max: Optional[Annotated[float, Field(ge=1)]]  # null: never clipped
    d_max: Optional[NonNegative]
    relax_start: Optional[Steps]  # null: no schedule (a limit that is never applied)
    r_max_step: Optional[Steps]
    d_max_step: Optional[Steps]
    groups: Optional[at_most(int, 1, MAX_WIDTH, WIDTH_WHY)]  # null: bn_4things's one channel per group
    ghost_batch: Optional[Batch]
    affine_decay: NonNegative
    alpha: Fraction
    sync: bool
    op_bias: Optional[bool]
    bnp: Optional[BnpKeys]


@with_config(STRICT)
class ActKeys(TypedDict, total=False):
    name: str


@with_config(STRICT)
class DataKeys(TypedDict, total=False):
    name: str
    root: str
    path: Optional[str]
    download: bool
    verify: bool
    num_classes: Optional[Classes]
    image_size: ImageSize
    resize_size: ImageSize
    channels: at_most(int, 1, MAX_CHANNELS, CHANNELS_WHY)
    train_size: Images
    test_size: Images
    noise: NonNegative
    seed: Annotated[int, Field(ge=0, le=MAX_DATA_SEED)]
    split_seed: Annotated[int, Field(ge=0, le=MAX_SEED)]
    test_fraction: Annotated[float, Field(gt=0, lt=1)]
    sampling: choice(SAMPLINGS)
    standardize: bool  # false: images / 255 in [0, 1] (BNP's TensorFlow nets); true: minus the mean, over the std
    drop_last: Optional[bool]
    augment: bool
    aug: str
    padding: at_most(int, 0, MAX_IMAGE_SIZE, IMAGE_WHY)
    loader: choice(LOADERS)
    num_workers: at_most(int, 0, MAX_PROCESSES, PROCESSES_WHY)
    pin_memory: Optional[bool]
    eval_batch_size: Batch
    format: str
    bad_images: str
    check_images: bool
    decode: choice(DECODES)


@with_config(STRICT)
class OptimKeys(TypedDict, total=False):
    name: choice(OPTIMIZERS)
    lr: Positive
    momentum: Probability
    beta1: Probability
    beta2: Probability
    eps: Positive
    weight_decay: NonNegative
    nesterov: bool
    lr_w: Optional[Positive]
    lr_g: Optional[Positive]
    wd_w: Optional[NonNegative]
    wd_g: Optional[NonNegative]


@with_config(STRICT)
class ScheduleKeys(TypedDict, total=False):
    name: choice(SCHEDULES)
    unit: choice(UNITS)
    milestones: Optional[list[Duration]]
    gamma: Optional[Positive]
    warmup: Duration
    warmup_unit: Optional[choice(UNITS)]  # null: unit
    warmup_mode: choice(WARMUPS)
    warmup_factor: Fraction


@with_config(STRICT)
class TrainerKeys(TypedDict, total=False):
    epochs: Duration
    max_steps: Optional[at_most(int, 1, MAX_STEPS, STEPS_WHY)]
    batch_size: Batch
    nproc: Processes
    dist_timeout: at_most(float, 0, MAX_TIMEOUT, TIMEOUT_WHY, above_low=True)
    pack: Union[Processes, Literal["auto"]]
    pack_conv: choice((*PACK_CONVS, AUTO_CONV))
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)]
    device: choice(DEVICES)
    eval_every: Interval
    eval_unit: choice(UNITS)
    log_every: at_most(int, 1, MAX_STEPS, STEPS_WHY)
    deterministic: bool
    tf32: bool
    checkpoint_every: Duration
    checkpoint_unit: choice(CHECKPOINT_UNITS)
    keep_checkpoints: at_most(int, 1, MAX_KEPT, KEPT_WHY)
    keep_best: bool
    resume: str
    init_from: Optional[str]
    amp: Optional[choice((*AMP_DTYPES, False))]  # YAML reads a bare off as false (bnexp.engine.amp_compile.amp_mode)
    channels_last: bool
    compile: bool
    cuda_graph: bool


@with_config(STRICT)
class LoggerKeys(TypedDict, total=False):
    name: str
    tracking_uri: Optional[str]
    experiment: Optional[str]
    dir: Optional[str]
    project: str
    entity: Optional[str]


@with_config(STRICT)
class ProbeKeys(TypedDict, total=False):
    every: Steps
    k: at_most(int, 1, MAX_SAMPLES, SAMPLES_WHY)
    batch_size: Optional[Batch]
    neuron: at_most(int, 0, MAX_CLASSES, CLASSES_WHY)
    rtol: Optional[Positive]
    stats: BnpKeys


@with_config(STRICT)
class TrainKeys(TypedDict, total=False):
    model: ModelKeys
    norm: NormKeys
    act: ActKeys
    data: DataKeys
    optim: OptimKeys
    schedule: ScheduleKeys
    trainer: TrainerKeys
    logger: LoggerKeys
    probe: dict[str, ProbeKeys]
    probes: list[str]
    tags: dict[str, Any]
    weight_decay_by_norm: dict[str, NonNegative]  # the BNP presets' settings per norm
    norm_defaults: dict[str, Any]  # configs/norm_defaults/: its options hold no keys (they choose files)
    lookup: dict[str, Any]  # tables preset keys read (bnexp.engine.identity.LOOKUP_KEYS); the keys they set are checked


SCHEMA = TypeAdapter(TrainKeys)


def check_schema(values: Mapping[str, Any]) -> None:
    """Raise a ConfigError naming the first key of ``values`` (a resolved config as plain
    dicts and lists) whose value does not fit the schema."""
    try:
        SCHEMA.validate_python(values)
    except ValidationError as err:
        first = err.errors()[0]
        raise schema_error(first["loc"], values, first["type"] == "less_than_equal") from None


def schema_error(loc: tuple, values: Mapping[str, Any], too_large: bool = False) -> ConfigError:
    """The one-line error for pydantic's error location ``loc``: the key, its value, the rule
    (and, for a value above its upper bound, the bound's reason)."""
    key, kind = key_type(loc)
    value: Any = values
    for part in key.split("."):
        value = value[part]
    options = choices(kind)
    if options:
        return unknown_choice(key, value, options)
    why = bound_reason(kind) if too_large else ""
    text = f"{key}={value!r} is not valid: {key} must be {rule(kind)}" + (f" ({why})" if why else "")
    if without_null(kind) is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        text += f"; quote a number meant as a name or path: {key}='{value}'"  # Hydra reads 2024 as an integer
    return ConfigError(text)


def bound_reason(kind: Any) -> str:
    """Why a type's upper bound is where it is (its ``description``); empty if none says."""
    origin, args = get_origin(kind), get_args(kind)
    if origin is Annotated:
        return next((info.description for info in args[1:] if getattr(info, "description", None)), "")
    return next((why for why in map(bound_reason, args) if why), "")


def choices(kind: Any) -> tuple[str, ...]:
    """The names a key of one of several named values takes (``None`` and ``False`` aside:
    YAML reads a bare ``off`` as false); none for any other key."""
    members = get_args(kind) if get_origin(kind) in (Union, types.UnionType) else (kind,)
    if not all(get_origin(m) is Literal or m is type(None) for m in members):
        return ()
    return tuple(a for m in members for a in get_args(m) if isinstance(a, str))


def key_type(loc: tuple) -> tuple[str, Any]:
    """The dotted config key at the start of ``loc`` that the schema types, and its type."""
    kind: Any = TrainKeys
    parts: list[str] = []
    for part in loc:
        node = without_null(kind)
        if isinstance(node, type) and issubclass(node, dict) and hasattr(node, "__total__"):  # a TypedDict
            kind = get_type_hints(node, include_extras=True)[part]
        elif get_origin(node) is dict:
            kind = get_args(node)[1]
        else:  # inside a value: a list's item, a union's member
            break
        parts.append(str(part))
    return ".".join(parts), kind


def without_null(kind: Any) -> Any:
    """``X`` for ``Optional[X]``; any other type as it is."""
    args = get_args(kind)
    if get_origin(kind) in (Union, types.UnionType) and len(args) == 2 and type(None) in args:
        return next(a for a in args if a is not type(None))
    return kind


KINDS = {bool: ("true or false", "true or false"), int: ("an integer", "integers"), float: ("a number", "numbers"),
         str: ("a string", "strings")}


def rule(kind: Any, plural: bool = False) -> str:
    """A schema type in words: ``an integer in [1, 65536]``, ``a number > 0 (or null)``."""
    origin, args = get_origin(kind), get_args(kind)
    if origin in (Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        words = " or ".join(rule(a, plural) for a in options)
        return words + (" (or null)" if len(options) < len(args) else "")
    if origin is Annotated:
        return rule(args[0], plural) + bounds([m for info in args[1:] for m in info.metadata])
    if origin is Literal:
        return ", ".join(map(str, args))
    if origin is list:
        return f"a list of {rule(args[0], plural=True)}"
    if origin is dict:
        return "a mapping"
    return KINDS[kind][plural]


def bounds(metadata: list) -> str:
    """``>= 0``, ``in [0, 1)``: the bounds of an annotated number, as words."""
    low = next((("[", m.ge) if isinstance(m, Ge) else ("(", m.gt) for m in metadata if isinstance(m, (Ge, Gt))), None)
    high = next(((m.le, "]") if isinstance(m, Le) else (m.lt, ")") for m in metadata if isinstance(m, (Le, Lt))), None)
    if low and high:
        return f" in {low[0]}{low[1]}, {high[0]}{high[1]}"
    if low:
        return f" {'>=' if low[0] == '[' else '>'} {low[1]}"
    if high:
        return f" {'<=' if high[1] == ']' else '<'} {high[0]}"
    return ""
