"""fo-tune's tensor-parallel styles for torch's ``parallelize_module``, and ``parallelize_linears``.

``ColwiseParallel`` and ``RowwiseParallel`` are torch's styles (``torch.distributed.tensor.parallel``,
subclassed: same constructor, same ``isinstance``), with the GEMM and its collective run by fo-tune's
ops. A plan switches by import:

    from fo_kernels.parallel import ColwiseParallel, RowwiseParallel
    parallelize_module(model, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})

The parameters become what torch's styles make them (DTensors on the mesh: colwise weight and bias
``Shard(0)``, rowwise weight ``Shard(1)``, bias ``Replicate()``; torch's own partition functions
make them), so a distributed checkpoint or FSDP2 sees the same model. The forward
(``fo_kernels.parallel_forward``) runs:

    ColwiseParallel   input Replicate()         local GEMM; its input gradient by gemm_all_reduce
                      input Shard(d), d leading all_gather_gemm (sequence parallelism)
    RowwiseParallel   output Replicate()        gemm_all_reduce
                      output Shard(d), d leading gemm_reduce_scatter (sequence parallelism)

with autograd and under ``torch.compile`` (the ops are custom ops). A style fo-tune cannot run
(a module other than a plain ``nn.Linear``, such as ``nn.Embedding`` or a subclass with its own
forward; a mesh of more than one dim; weights other than bfloat16, float16 or float32; a colwise
input sharded on its features, a rowwise input not sharded on its features (``Shard(-1)``, or the
last dim counted from the front, seen at run time) or output other than ``Replicate()`` / a leading
``Shard``) is torch's style for that module, with one ``NotOverlappedWarning``; a colwise output
layout other than its features (``Shard(-1)``, or the last dim counted from the front, seen at run
time) is redistributed as torch's style does, with one warning from its first eager call.

fp8 for inference: ``ColwiseParallel(fp8="tensorwise" | "rowwise")`` (and ``RowwiseParallel``)
stores each weight shard once as float8_e4m3fn codes with the full weight's scale in its
``weight_scale`` buffer (a DTensor, so a distributed checkpoint holds it) and quantizes each call's
input the same way, as ``ColumnParallelLinear(fp8=...)`` does (``fo_kernels.parallel_fp8``).
torch's style has no fp8 GEMM, so an fp8 style that fo-tune cannot run is a ``PlanError`` when
applied (a ``ShapeError`` at run time), not torch's style; a backward raises ``Fp8TrainingError``. A
cast of the model's dtype (``model.to(torch.bfloat16)``, ``.half()``) leaves each fp8 weight and its
float32 scale as they are; a device move moves them.

``parallelize_linears(model, {pattern: "column" | "row"})`` is a thin convenience over the styles.

``fused_all_gather_matmul`` and ``fused_matmul_reduce_scatter`` (torch's fused-op signatures,
``fo_kernels.symm_mem``) are importable from here too, beside the styles a caller of torch's
async-TP switches with them.
"""

from __future__ import annotations

import fnmatch
import inspect
import warnings
from collections.abc import Mapping

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwiseParallel
from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwiseParallel
from torch.distributed.tensor.parallel import parallelize_module
from torch.distributed.tensor.placement_types import Placement

from fo_kernels.errors import AlreadyParallelizedError, NotOverlappedWarning, PlanError
from fo_kernels.fields import check_bool
from fo_kernels.groups import check_group, require_initialized
from fo_kernels.parallel_forward import install_forward
from fo_kernels.parallel_plan import COLWISE, PLAN_ATTR, ROWWISE, LinearPlan
from fo_kernels.quantize import check_scaling
from fo_kernels.scaling import is_fp8
from fo_kernels.schedule import TORCH_DTYPES
from fo_kernels.symm_mem import fused_all_gather_matmul, fused_matmul_reduce_scatter

__all__ = [
    "ColwiseParallel",
    "LinearPlan",
    "RowwiseParallel",
    "fused_all_gather_matmul",
    "fused_matmul_reduce_scatter",
    "install",
    "parallelize_linears",
    "plan_of",
]

# parallelize_linears' plan values.
KINDS = ("column", "row")


def _blocker(module: nn.Module, mesh: DeviceMesh) -> str:
    """Why fo-tune cannot run ``module`` on ``mesh`` at all ("" when it can)."""
    if type(module).forward is not nn.Linear.forward:
        return f"{type(module).__name__} is not an nn.Linear with nn.Linear's forward"
    if mesh.ndim != 1:
        return f"the mesh has {mesh.ndim} dims, fo-tune's ops take one process group"
    dtype = module.weight.dtype
    if dtype not in TORCH_DTYPES.values() or is_fp8(dtype):  # (fp8 codes: no scale to run them by)
        return (
            f"its weight is {dtype}; the ops take bfloat16, float16 or float32 weights (the fp8 option "
            "quantizes one of those itself)"
        )
    return ""


def _is_last(placement: Placement) -> bool:
    return isinstance(placement, Shard) and placement.dim == -1


def _plan(style: ColwiseParallel | RowwiseParallel, mesh: DeviceMesh) -> LinearPlan:
    group = mesh.get_group()
    return LinearPlan(
        kind=style.kind,
        mesh=mesh,
        group=group,
        group_name=group.group_name,
        world_size=dist.get_world_size(group),
        input_layouts=tuple(style.input_layouts),
        output_layouts=tuple(style.output_layouts),
        use_local_output=style.use_local_output,
        fp8=style.fp8,
    )


def _warn(style: object, module: nn.Module, what: str) -> None:
    warnings.warn(
        f"fo_kernels.parallel: {style!r} on {type(module).__name__}: {what}",
        NotOverlappedWarning,
        stacklevel=4,
    )


class _Fp8Option:
    """What both styles share: the ``fp8`` keyword (None, ``"tensorwise"`` or ``"rowwise"``) beside
    torch's arguments, and ``_apply``, which asks each style's ``_layout_blocker``."""

    fp8: str | None

    def __init__(self, *, fp8: str | None = None, **torch_args) -> None:
        super().__init__(**torch_args)
        self.fp8 = None if fp8 is None else check_scaling(fp8)

    def __repr__(self) -> str:
        text = super().__repr__()
        return text if self.fp8 is None else f"{text[:-1]}, fp8={self.fp8!r})"

    def _refuse_distributed(self, module: nn.Module) -> None:
        """Raise ``AlreadyParallelizedError`` where a style (fo-tune's or torch's) already made
        ``module``'s parameters DTensors: ``distribute_module`` runs once per module."""
        if getattr(module, "_distribute_module_applied", False) or getattr(module, PLAN_ATTR, None):
            raise AlreadyParallelizedError(
                f"{self!r} on {type(module).__name__}: its parameters are already distributed by a "
                "tensor-parallel style (parallelize_module ran on it before); apply one style to a fresh "
                "module, or keep the one it has"
            )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        """The style on ``module``: fo-tune's forward where fo-tune runs the module and the style's
        layouts (``_layout_blocker``, each style's), else torch's style (``_torch_or_refuse``)."""
        self._refuse_distributed(module)
        reason = _blocker(module, device_mesh) or self._layout_blocker()
        if reason:
            return self._torch_or_refuse(module, device_mesh, reason)
        self._before_distribute()
        distribute_module(module, device_mesh, self._partition_linear_fn)
        install_forward(module, _plan(self, device_mesh))
        return module

    def _before_distribute(self) -> None:
        """What a style sets before its parameters are distributed (nothing, unless it says)."""

    def _torch_or_refuse(self, module: nn.Module, device_mesh: DeviceMesh, reason: str) -> nn.Module:
        """torch's style for a module fo-tune cannot run, with a warning once torch's style took it
        (a module torch's styles refuse, neither an ``nn.Linear`` nor an ``nn.Embedding``, raises
        torch's ``NotImplementedError`` alone); an fp8 style raises ``PlanError`` instead (torch's
        style has no fp8 GEMM: it would run unquantized)."""
        if self.fp8 is not None:
            raise PlanError(f"{self!r} cannot run on {type(module).__name__}: {reason}")
        module = super()._apply(module, device_mesh)
        _warn(self, module, f"{reason}; it runs as torch's style")
        return module


def _signature(torch_style: type) -> inspect.Signature:
    """``torch_style.__init__``'s signature (this torch's: its keyword arguments, their defaults and
    annotations) with the ``fp8`` keyword added, for a style's ``__init__``: ``inspect.signature``,
    ``help()`` and editors show torch's arguments rather than ``**torch_args``."""
    sig = inspect.signature(torch_style.__init__)
    params = list(sig.parameters.values())
    fp8 = inspect.Parameter("fp8", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="str | None")
    at = next((i for i, q in enumerate(params) if q.kind is inspect.Parameter.VAR_KEYWORD), len(params))
    return sig.replace(parameters=[*params[:at], fp8, *params[at:]])


class ColwiseParallel(_Fp8Option, TorchColwiseParallel):
    """torch's ``ColwiseParallel`` (same arguments, same parameters) on fo-tune's ops, with an
    ``fp8`` option for inference; see the module docstring for what runs where."""

    kind = COLWISE

    def __init__(self, *, fp8: str | None = None, **torch_args: object) -> None:
        super().__init__(fp8=fp8, **torch_args)

    __init__.__signature__ = _signature(TorchColwiseParallel)

    def _layout_blocker(self) -> str:
        """Why fo-tune cannot run this style's layouts ("" when it can)."""
        # (an output layout other than the features is redistributed by DTensor: the forward warns,
        # since whether Shard(2) is the features depends on the output's dims)
        (layout,) = self.input_layouts
        if isinstance(layout, Partial) or _is_last(layout):
            return f"input_layouts={layout!r} is gathered on its features by DTensor"
        return ""


class RowwiseParallel(_Fp8Option, TorchRowwiseParallel):
    """torch's ``RowwiseParallel`` (same arguments, same parameters) on fo-tune's ops, with an
    ``fp8`` option for inference; see the module docstring for what runs where."""

    kind = ROWWISE

    def __init__(self, *, fp8: str | None = None, **torch_args: object) -> None:
        super().__init__(fp8=fp8, **torch_args)

    __init__.__signature__ = _signature(TorchRowwiseParallel)

    def _layout_blocker(self) -> str:
        """Why fo-tune cannot run this style's layouts ("" when it can)."""
        (layout,), (out,) = self.input_layouts, self.output_layouts
        # (a Shard of a dim counted from the front, Shard(1) of a (tokens, features) input, is the
        # features or not by the input's dims: the forward decides when it sees them)
        if not isinstance(layout, Shard):
            return f"input_layouts={layout!r} is resharded to Shard(-1) by DTensor"
        if not (isinstance(out, Replicate) or (isinstance(out, Shard) and not _is_last(out))):
            return f"output_layouts={out!r} is neither an all-reduce nor a reduce-scatter of a leading dim"
        return ""

    def _before_distribute(self) -> None:
        self.desired_input_layouts = (Shard(-1),)  # what torch's _apply sets for a linear


# The dim of its weight each style shards (torch's placements: colwise Shard(0), rowwise Shard(1)).
WEIGHT_DIM = {COLWISE: 0, ROWWISE: 1}


def install(
    module: nn.Module, device_mesh: DeviceMesh, style: ColwiseParallel | RowwiseParallel
) -> nn.Module:
    """Give ``module``, an ``nn.Linear`` whose parameters a framework has already made DTensors
    with torch's placements (transformers' ``tp_plan`` loading does), the forward ``style`` runs
    with fo-tune's ops; returns ``module``. Raises ``PlanError`` where fo-tune cannot run it (the
    framework's own forward is the one to keep there)."""
    if not isinstance(style, ColwiseParallel | RowwiseParallel):
        raise PlanError(
            f"style: expected fo_kernels.parallel's ColwiseParallel or RowwiseParallel, got {style!r}"
        )
    reason = _blocker(module, device_mesh) or style._layout_blocker()
    weight = getattr(module, "weight", None)
    if not reason and not (
        isinstance(weight, DTensor)
        and len(weight.placements) == 1
        and isinstance(weight.placements[0], Shard)
        and weight.placements[0].dim % weight.dim() == WEIGHT_DIM[style.kind]
    ):
        dim = WEIGHT_DIM[style.kind]
        reason = f"its weight is not a DTensor sharded on dim {dim}, as a {style.kind} weight is"
    if reason:
        raise PlanError(f"{style!r} cannot run on {type(module).__name__}: {reason}")
    install_forward(module, _plan(style, device_mesh))
    return module


def plan_of(module: nn.Module) -> LinearPlan | None:
    """How fo-tune runs ``module`` (its kind, mesh, group and layouts), or None where it does not
    (a module no fo-tune style was applied to, or one its style left to torch's)."""
    return getattr(module, PLAN_ATTR, None)


def _device_type(module: nn.Module, group: dist.ProcessGroup) -> str:
    """The mesh's device type: the weights' where the group's backend serves that device, else
    (weights on the meta device, built there to be materialized by ``to_empty``, or on the cpu
    beside an nccl-only group) the device of the group's backend: the first of its
    ``device:backend`` pairs not served by gloo (cuda of nccl, beside gloo's cpu too), else cpu.
    The weights then move to that device as they are sharded, as torch's styles move them to
    their mesh's device. A mesh of "meta" gives DTensors whose gradients cannot be made."""
    device = module.weight.device.type
    pairs = [pair.split(":", 1) for pair in dist.get_backend_config(group).split(",") if ":" in pair]
    if device != "meta" and (not pairs or device in {d for d, _ in pairs}):
        return device
    return next((d for d, backend in pairs if backend != "gloo"), "cpu")


def parallelize_linears(
    model: nn.Module,
    plan: Mapping[str, str],
    *,
    sequence_parallel: bool = False,
    group: dist.ProcessGroup | None = None,
    fp8: str | None = None,
) -> nn.Module:
    """Shard ``model``'s ``nn.Linear`` submodules named in ``plan`` over ``group``, in place, with
    fo-tune's styles, and return ``model``.

    ``plan`` maps a submodule's dotted name, or an ``fnmatch`` pattern of it (``layers.*.mlp.up_proj``),
    to ``"column"`` (``ColwiseParallel``) or ``"row"`` (``RowwiseParallel``); with
    ``sequence_parallel=True`` a column layer takes and a row layer returns dim-0 shards
    (``Shard(0)``), else the full activation (``Replicate()``). The parameters become DTensors on a
    one-dim mesh of ``group`` (rank 0's weights are the ones scattered). A pattern that matches no
    ``nn.Linear``, a name that is not one, or a module that two patterns give other kinds raises
    ``PlanError`` before any module is sharded. A model on the meta device (to be materialized by
    ``to_empty`` once sharded) gets a mesh of its group's device: cpu for gloo, cuda for nccl.
    ``fp8``: every chosen module in fp8 for inference (the styles' ``fp8`` option). An empty
    ``plan`` shards nothing and returns ``model`` as it is, as ``parallelize_module`` does.
    """
    check_bool("sequence_parallel", sequence_parallel)
    wanted = f"a mapping of submodule names (or patterns) to {' or '.join(map(repr, KINDS))}"
    if not isinstance(plan, Mapping):
        raise PlanError(f"plan: expected {wanted}, got {type(plan).__name__}")
    for name in plan:
        if not isinstance(name, str):
            raise PlanError(f"plan: expected {wanted}; key {name!r} ({type(name).__name__}) is not a name")
    for kind in plan.values():
        if kind not in KINDS:
            raise PlanError(f"plan: {kind!r} is not one of {', '.join(KINDS)}")
    check_group(group)
    chosen: dict[str, str] = {}
    matched_by: dict[str, str] = {}  # each chosen module's first pattern
    for pattern, kind in plan.items():
        names = [name for name, _ in model.named_modules() if name and fnmatch.fnmatchcase(name, pattern)]
        if not names:
            raise PlanError(f"plan: {pattern!r} names no submodule of {type(model).__name__}")
        for name in names:
            if not isinstance(model.get_submodule(name), nn.Linear):
                found = type(model.get_submodule(name)).__name__
                raise PlanError(f"plan: {name} is a {found}, not an nn.Linear")
            if chosen.get(name, kind) != kind:
                first = matched_by[name]
                raise PlanError(
                    f"plan: {name} is matched by {first!r} ({chosen[name]}) and by {pattern!r} ({kind}); "
                    "give each module one kind (narrow a pattern)"
                )
            chosen[name] = kind
            matched_by.setdefault(name, pattern)
    if not chosen:  # (an empty plan: no module to take the mesh's device type from)
        return model
    require_initialized()
    group = group if group is not None else dist.group.WORLD
    mesh = DeviceMesh.from_group(group, _device_type(model.get_submodule(next(iter(chosen))), group))
    activation = Shard(0) if sequence_parallel else Replicate()
    styles = {
        name: ColwiseParallel(input_layouts=activation, fp8=fp8)
        if kind == "column"
        else RowwiseParallel(output_layouts=activation, fp8=fp8)
        for name, kind in chosen.items()
    }
    # exact names: parallelize_module's own matching is fnmatch on each dotted part, and a name
    # holds no pattern characters here
    return parallelize_module(model, mesh, styles)
