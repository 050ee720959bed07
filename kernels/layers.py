"""Tensor-parallel linear layers, forward and backward, on fo-tune's overlapped ops.

A column-parallel layer then a row-parallel one split an MLP (or an attention block's projections)
over the w ranks of a group, as in Megatron-LM. Both keep ``weight`` and ``bias`` as this rank's
shard in ``nn.Linear`` layout (``weight`` is (out, in) of the shard).

    ColumnParallelLinear   rank r owns output features [r*out/w, (r+1)*out/w): weight rows, bias.
                           Input: the full activation (the same on every rank), or with
                           ``sequence_parallel=True`` this rank's dim-0 shard, gathered by
                           ``all_gather_gemm``. Output: this rank's features of every row.
    RowParallelLinear      rank r owns input features [r*in/w, (r+1)*in/w): weight columns. Input:
                           this rank's features (a column-parallel output). Output: the sum over
                           ranks (``gemm_all_reduce``), or with ``sequence_parallel=True`` this rank's
                           dim-0 shard of it (``gemm_reduce_scatter``); the full bias is added once,
                           after the reduction.

Gradients are the unsharded model's (dy: the output's gradient, x: the input, W_r: the shard):

    column:  dx = all_reduce(dy @ W_r) (gemm_all_reduce)          SP: dx_r = reduce_scatter(dy @ W_r)
             dW_r = dy.T @ x (x gathered with SP)                 db_r = dy summed over rows
    row:     dx_r = dy @ W_r (local)                              SP: dy gathered first (all_gather_gemm)
             dW_r = dy.T @ x_r                                    db = dy summed over rows (SP: and
                                                                  over the group, so it is the full one)

fp8 for inference (``fp8="tensorwise"`` or ``"rowwise"``, or ``quantize_fp8`` on a built layer):
the shard's weight is stored once as float8_e4m3fn codes with its ``weight_scale`` (0-dim, or one
per output feature), and each call quantizes its activation the same way (``fo_kernels.quantize``;
tensorwise before an AllGather with one scale over the group) and runs the scaled ops
(``fo_kernels.scaling``), the output in the input's dtype; a cast of the module's dtype
(``.to(torch.bfloat16)``, ``.half()``) leaves the fp8 weight and its float32 scale as they are.
``load_state_dict`` quantizes a high-precision weight into an fp8 layer with a fresh scale and
dequantizes an fp8 one into another layer (``fo_kernels.fp8_state``). Training in fp8 is out of
scope: a backward through an fp8 layer raises ``Fp8TrainingError``.

A leading-dimension input (batch, seq, features) is flattened to rows; with sequence parallelism
dim 0 is the sharded one (rank r's rows come r-th), and a row-parallel output whose dim 0 does not
divide by w comes back as the flat (M/w, out) shard of the rows. An input with no rows gives
``nn.Linear``'s empty output, with no collective. Inside ``torch.autocast`` the input, weight and
bias are cast to its dtype, as ``F.linear``'s are. An input a layer refuses raises ``ShapeError``;
in a compiled call, when the graph runs (``fo_kernels.refusal``).

These layers hold plain tensors; ``fo_kernels.parallel`` has the same split as torch's
``parallelize_module`` styles on the same ops, with DTensor parameters, and ``parallelize_linears``
over them.
"""

from __future__ import annotations

import math
from typing import ClassVar, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from fo_kernels.autocast import autocast_operands
from fo_kernels.errors import PlanError, ScaleError, ScheduleError, ShapeError
from fo_kernels.execute import check_local
from fo_kernels.fields import check_bool, check_int
from fo_kernels.fp8_state import prepare_weight_state
from fo_kernels.groups import SharesGroupWhenCopied, check_group, require_initialized
from fo_kernels.linear_autograd import (
    ReplicatedInputMatmul,
    add_bias,
    add_bias_to_shard,
    needs_grad,
)
from fo_kernels.overlap import all_gather_gemm, gemm_all_reduce, gemm_reduce_scatter
from fo_kernels.quantize import (
    Fp8Refused,
    check_scaling,
    dequantize_weight,
    fp8_operands,
    keeping_dtypes,
    local_fp8_matmul,
    quantize_weight,
)
from fo_kernels.refusal import refusal, refused, shape_of
from fo_kernels.scaling import OUT_DTYPES, is_fp8
from fo_kernels.schedule import Schedule

# The dtypes of a layer's parameters: the ops' operands other than fp8 (whose weight ``fp8=`` makes).
PARAM_DTYPES = OUT_DTYPES


_Layer = TypeVar("_Layer", bound="_ParallelLinear")


class _ParallelLinear(SharesGroupWhenCopied, nn.Module):
    """What both layers share: the shard's parameters, the group (shared by a deep copy, kept by
    name in a pickle), the schedule."""

    # The dim of the (out, in) weight split over the ranks: 0 (output features, and the bias with
    # them) for a column-parallel layer, 1 (input features; the bias stays whole) for a row-parallel one.
    split_dim: ClassVar[int]
    # The forward's collective without and with sequence parallelism (None: none, a local GEMM).
    collectives: ClassVar[tuple[str | None, str]]

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        sequence_parallel: bool = False,
        group: dist.ProcessGroup | None = None,
        schedule: Schedule | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        fp8: str | None = None,
    ) -> None:
        _check_layer_args(in_features, out_features, schedule, dtype, sequence_parallel)
        require_initialized()
        check_group(group)
        self._check_schedule(schedule, sequence_parallel, dist.get_world_size(group))
        d, shape = self.split_dim, [out_features, in_features]
        if shape[d] % dist.get_world_size(group):
            raise ShapeError(
                f"{('out_features', 'in_features')[d]} {shape[d]} is not divisible by the world "
                f"size {dist.get_world_size(group)}"
            )
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel, self.group, self.schedule = bool(sequence_parallel), group, schedule
        self.world_size = dist.get_world_size(group)
        shape[d] //= self.world_size
        # the group's name for the collectives the backward calls by name (the default group's own)
        self.group_name = (group if group is not None else dist.group.WORLD).group_name
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(shape[0], device=device, dtype=dtype)) if bias else None
        self.fp8: str | None = None  # the scaling of an fp8 layer (``quantize_fp8``)
        self.register_buffer("weight_scale", None)  # an fp8 weight's scale_b
        self.reset_parameters()
        if fp8 is not None:
            self.quantize_fp8(fp8)

    @classmethod
    def from_linear(
        cls: type[_Layer],
        linear: nn.Linear,
        *,
        sequence_parallel: bool = False,
        group: dist.ProcessGroup | None = None,
        schedule: Schedule | None = None,
        fp8: str | None = None,
    ) -> _Layer:
        """This rank's shard of a full ``nn.Linear`` (the same weights on every rank beforehand):
        its output features (column) or input features (row), and the bias with output features;
        ``fp8``: the shard then quantized for inference (``quantize_fp8``)."""
        if not isinstance(linear, nn.Linear):
            raise PlanError(f"from_linear takes an nn.Linear, got {type(linear).__name__}")
        w = linear.weight
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            sequence_parallel=sequence_parallel,
            group=group,
            schedule=schedule,
            device=w.device,
            dtype=w.dtype,
        )
        d, rank = layer.split_dim, dist.get_rank(group)
        part = layer.weight.shape[d]
        with torch.no_grad():
            layer.weight.copy_(w.narrow(d, rank * part, part))
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.narrow(0, rank * part, part) if d == 0 else linear.bias)
        if fp8 is not None:
            layer.quantize_fp8(fp8)
        return layer

    def quantize_fp8(self: _Layer, scaling: str) -> _Layer:
        """Store the shard's weight as float8_e4m3fn codes and ``weight_scale`` (``scaling``:
        ``"tensorwise"`` or ``"rowwise"``, also how each call quantizes its activation), for
        inference: the weight takes no gradient. Returns the layer."""
        scaling = check_scaling(scaling)
        if is_fp8(self.weight.dtype):
            raise ScaleError(f"{type(self).__name__}: the weight is fp8 already ({self.fp8})")
        codes, scale = quantize_weight(self.weight, scaling, type(self).__name__)
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.weight_scale = scale
        self.fp8 = scaling
        return self

    def _apply(self, fn, recurse: bool = True):
        """``nn.Module._apply`` (``to``, ``half``, ``cuda``...), but an fp8 layer's weight codes
        and float32 ``weight_scale`` keep their dtypes through a cast of the module's dtype
        (``keeping_dtypes``)."""
        if self.fp8 is None:
            return super()._apply(fn, recurse)
        return super()._apply(keeping_dtypes(fn, (self.weight, self.weight_scale)), recurse)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        """``nn.Module``'s, after ``prepare_weight_state``: a high-precision weight loaded into an
        fp8 layer is quantized with a fresh scale, an fp8 one into another layer dequantized, an
        fp8 weight without its scale (or a high-precision one with a scale) a ``ScaleError``."""
        owner = type(self).__name__
        prepare_weight_state(
            state_dict,
            prefix,
            self.weight,
            lambda w: quantize_weight(w, self.fp8, owner),
            dequantize_weight,
            self.weight_scale,
        )
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _fp8_rows(self, rows: torch.Tensor, shared: bool = False) -> tuple[torch.Tensor, dict]:
        """(codes, the op's fp8 keyword arguments) of a call's activation rows (``fp8_operands``)."""
        assert self.fp8 is not None
        return fp8_operands(rows, self.fp8, self.weight_scale, shared=shared, group=self.group)

    def _empty_forward(
        self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """The output of an input with no rows, as ``nn.Linear`` gives it: the ops refuse empty
        operands, and an input with no rows has none on any rank (the rows are the same on every
        rank, or with sequence parallelism an equal shard of them), so every rank skips the
        collectives alike. A local GEMM keeps autograd's zero weight and bias gradients; an fp8
        layer takes the dequantized weight (its backward raises as on any other input)."""
        if self.fp8:
            out_dtype = rows.dtype
            scale = self.weight_scale if self.weight_scale.dim() == 0 else self.weight_scale.reshape(-1, 1)
            dequantized = weight.to(out_dtype) * scale.to(out_dtype)
            y = Fp8Refused.apply(rows.to(out_dtype), dequantized.t(), False)
        else:
            y = rows @ weight.t()
        return add_bias(y, bias, self.fp8 is not None).reshape(shape)

    def _check_schedule(self, schedule: Schedule | None, sequence_parallel: bool, world: int) -> None:
        """Refuse (``ScheduleError``) a schedule the forward would not run: one for a layer whose
        forward has no collective, or for another collective or world size."""
        want, name = self.collectives[sequence_parallel], type(self).__name__
        if schedule is None or (schedule.collective, schedule.world_size) == (want, world):
            return
        if want is None:
            raise ScheduleError(
                f"schedule: a {name} without sequence_parallel runs no collective in its forward "
                "(its input is the same on every rank), so a schedule goes unused; leave it None, "
                "or give an all_gather schedule with sequence_parallel=True"
            )
        sp = " with sequence_parallel" if sequence_parallel else ""
        ranks = "1 rank" if world == 1 else f"{world} ranks"
        raise ScheduleError(
            f"schedule: a {name}{sp} on {ranks} runs {want} on {ranks}, the schedule "
            f"is for {schedule.collective} on {schedule.world_size}"
        )

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def _check_dtype(self, rows: torch.Tensor, weight: torch.Tensor) -> None:
        """Refuse an input of another dtype than the weight's (``ShapeError``), as the ops refuse
        mixed operands; a column-parallel layer's local GEMM would raise torch's RuntimeError
        instead. An fp8 layer quantizes its input per call and gives its output in the input's
        dtype: bfloat16, float16 or float32 (the scaled GEMM's output dtypes); another it refuses."""
        if self.fp8 is not None and rows.dtype not in OUT_DTYPES:
            raise ShapeError(
                f"input is {rows.dtype}; an fp8 {type(self).__name__} quantizes an input of "
                "torch.bfloat16, torch.float16 or torch.float32 and gives its output in that dtype"
            )
        if self.fp8 is None and rows.dtype != weight.dtype:
            raise ShapeError(
                f"input is {rows.dtype} but {type(self).__name__}'s weight is {weight.dtype}; cast "
                "the input or the layer, or run it inside torch.autocast"
            )

    def _operands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(rows, weight, bias) of a call on ``x``, checked (``ShapeError``; a traced call's through
        ``fo_kernels.refusal``); inside torch.autocast in its dtype, as ``F.linear`` takes them."""
        rows, weight, bias = autocast_operands(self._rows(x, self.weight.shape[1]), self.weight, self.bias)
        self._check_dtype(rows, weight)
        if self.split_dim == 1 and self.sequence_parallel and rows.shape[0] % self.world_size:
            raise ShapeError(
                f"sequence parallelism splits the input's {int(rows.shape[0])} rows over the world size "
                f"{self.world_size}: they must divide by it"
            )
        return rows, weight, bias

    def _rows(self, x: torch.Tensor, features: int) -> torch.Tensor:
        if type(x) is not torch.Tensor:  # (a plain tensor skips the type checks)
            if not isinstance(x, torch.Tensor):
                raise ShapeError(f"input must be a torch.Tensor, got a {type(x).__name__}")
            check_local(input=x)  # (a DTensor: the layers hold this rank's plain shards)
        if x.dim() < 1 or x.shape[-1] != features:
            raise ShapeError(
                f"input has {int(x.shape[-1]) if x.dim() else 0} features, this rank's shard of "
                f"{type(self).__name__} takes {features}"
            )
        return x.reshape(-1, features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}, "
            f"world_size={self.world_size}" + (f", fp8={self.fp8}" if self.fp8 else "")
        )


def _check_layer_args(
    in_features: object, out_features: object, schedule: object, dtype: object, sequence_parallel: object
) -> None:
    """Refuse (``ShapeError``, ``ScheduleError``, ``ArgumentError``) what the ops would refuse at the
    first call: feature counts that are not positive integers, a schedule that is not a
    ``Schedule``, parameters in a dtype the ops do not take (``dtype``, else torch's default
    dtype); and a ``sequence_parallel`` that is not a bool (``"no"`` would read as true)."""
    check_bool("sequence_parallel", sequence_parallel)
    check_int("in_features", in_features, minimum=1, error=ShapeError)
    check_int("out_features", out_features, minimum=1, error=ShapeError)
    if schedule is not None and not isinstance(schedule, Schedule):
        raise ScheduleError(
            f"schedule: expected a fo_kernels.Schedule or None, got {type(schedule).__name__}"
        )
    got = torch.get_default_dtype() if dtype is None else dtype
    if got not in PARAM_DTYPES:
        raise ShapeError(
            f"dtype: {got!r}{' (torch.get_default_dtype())' if dtype is None else ''} is not one of "
            "torch.bfloat16, torch.float16, torch.float32 (the ops' operands); for fp8 weights pass "
            "fp8='tensorwise' or 'rowwise'"
        )


class ColumnParallelLinear(_ParallelLinear):
    """Column-parallel ``nn.Linear`` (see the module docstring); the schedule is looked up per shape."""

    split_dim: ClassVar[int] = 0
    collectives: ClassVar[tuple[str | None, str]] = (None, "all_gather")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias`` for this rank's output columns; with sequence parallelism ``x``
        is this rank's rows, all-gathered first (``all_gather_gemm``)."""
        checked, why_refused = refusal(lambda: self._operands(x))
        if why_refused is not None:  # (traced: raised when the graph runs)
            shape = self._out_shape(shape_of(x)) if shape_of(x) else (self.weight.shape[0],)
            return refused(why_refused, x, shape)
        rows, weight, bias = checked
        w = weight.t()
        shape = self._out_shape(x.shape)
        if rows.shape[0] == 0:
            return self._empty_forward(rows, weight, bias, shape)
        if self.sequence_parallel:
            if self.fp8:  # (tensorwise: the gathered shards share one scale)
                codes, fp8 = self._fp8_rows(rows, shared=True)
                y = all_gather_gemm(codes, w, group=self.group, schedule=self.schedule, **fp8)
            else:
                y = all_gather_gemm(rows, w, group=self.group, schedule=self.schedule)
        else:
            if self.fp8:
                codes, fp8 = self._fp8_rows(rows)
                y = local_fp8_matmul(codes, w, fp8, self.fp8)
            elif needs_grad(rows, w):
                y = ReplicatedInputMatmul.apply(rows, w, self.group_name)
            else:
                y = rows @ w
        return add_bias(y, bias, self.fp8 is not None).reshape(shape)

    def _out_shape(self, x_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The output's shape for an input of shape ``x_shape`` (at least 1-D): its leading dims
        and this rank's columns, with sequence parallelism the gathered rows (dim 0 times the world
        size)."""
        n = self.weight.shape[0]
        if not self.sequence_parallel:
            return (*x_shape[:-1], n)
        if len(x_shape) > 1:
            return (x_shape[0] * self.world_size, *x_shape[1:-1], n)
        return (self.world_size, n)


class RowParallelLinear(_ParallelLinear):
    """Row-parallel ``nn.Linear`` (see the module docstring); the schedule is looked up per shape."""

    split_dim: ClassVar[int] = 1
    collectives: ClassVar[tuple[str | None, str]] = ("all_reduce", "reduce_scatter")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``x @ weight.T`` (``x`` this rank's input columns) plus the bias
        (``gemm_all_reduce``); with sequence parallelism this rank's rows of it
        (``gemm_reduce_scatter``)."""
        checked, why_refused = refusal(lambda: self._operands(x))
        if why_refused is not None:  # (traced: raised when the graph runs)
            return refused(why_refused, x, self._refused_shape(shape_of(x)[:-1]))
        rows, weight, bias = checked
        lead = x.shape[:-1]
        if rows.shape[0] == 0:
            return self._empty_forward(rows, weight, bias, self._out_shape(lead))
        fp8: dict = {}
        if self.fp8:  # (each rank's partial is scaled by its own scales before the sum)
            rows, fp8 = self._fp8_rows(rows)
        if not self.sequence_parallel:
            y = gemm_all_reduce(rows, weight.t(), schedule=self.schedule, group=self.group, **fp8)
            return add_bias(y, bias, self.fp8 is not None).reshape(self._out_shape(lead))
        y = gemm_reduce_scatter(rows, weight.t(), schedule=self.schedule, group=self.group, **fp8)
        return add_bias_to_shard(y, bias, self.fp8 is not None, self.group_name).reshape(
            self._out_shape(lead)
        )

    def _out_shape(self, lead: torch.Size) -> tuple[int, ...]:
        """The output's shape for an input of leading dims ``lead``: those dims, or with sequence
        parallelism this rank's dim-0 shard of them, the flat (M/w, out) shard of the rows where
        dim 0 does not divide by w."""
        world = self.world_size
        if not self.sequence_parallel:
            return (*lead, self.out_features)
        if len(lead) == 0 or lead[0] % world:
            return (-1, self.out_features)  # the shard of the flattened rows
        return (lead[0] // world, *lead[1:], self.out_features)

    def _refused_shape(self, lead: tuple[int, ...]) -> tuple[int, ...]:
        """A refused call's output for an input of leading dims ``lead``: ``_out_shape``'s, with the
        flat shard's rows counted; the unsharded shape where they do not divide by the world size
        (which the call refuses) or the input is no tensor."""
        shape = self._out_shape(torch.Size(lead))
        if shape[0] != -1:
            return shape
        rows = math.prod(lead)
        if len(lead) == 0 or rows % self.world_size:
            return (*lead, self.out_features)
        return (rows // self.world_size, self.out_features)
