"""``ExpertParallelExperts``: a Hugging Face experts block (Mixtral, Qwen3-MoE and their kin)
sharded over an expert-parallel group, its forward one ``expert_parallel_ffn``.

It takes the experts block's place in the model: ``forward(hidden_states, top_k_index,
top_k_weights)`` as transformers (>= 5) calls ``MixtralExperts`` / ``Qwen3MoeExperts`` from the
sparse MoE block, after the router, which stays replicated. Every rank keeps the experts
[rank x E_local, (rank + 1) x E_local), E_local = E / world, and routes its own tokens, as data
parallelism gives them. Where every rank of the group holds the same tokens (a tensor-parallel
group: transformers' ``tp_plan`` or ``parallelize_module`` over the same ranks), ``shared_tokens=True``
makes each rank send only its slice of them (``_shared_rows``) and gather the others' outputs, so
each token runs through its experts once and counts once in their gradients; without it each token
would run once per rank and its experts' gradients would be the world size times the model's.

``from_experts`` reads the two layouts transformers has used:

    fused (transformers >= 5)   gate_up_proj (E, 2I, H) [gate; up], down_proj (E, H, I)
                                (``is_transposed``: (E, H, 2I) and (E, I, H); ``is_concatenated``
                                False: gate and up interleaved column by column)
    per expert (transformers 4) a ModuleList of MLPs with w1 / w3 / w2 (Mixtral) or gate_proj /
                                up_proj / down_proj (Qwen3-MoE) ``nn.Linear`` layers

and loads a state_dict of such a block (a Hugging Face checkpoint of the whole model, every expert)
as this rank's experts: ``model.load_state_dict(full_state_dict)`` after ``parallelize_experts``.
Its own state_dict holds this rank's ``w13`` and ``w2``. It refuses (``PlanError``) what the op does
not compute: an activation other than SiLU (the fused block's ``_apply_gate`` is probed, so a
clamped SwiGLU such as DeepSeek-V4's or gpt-oss's is refused; a block that names no ``act_fn`` has
its forward probed), biases, a norm after each expert,
experts without a gate (NemotronH's and Ergo's up_proj / down_proj), weights in neither layout
(Llama 4's experts, which take pre-weighted rows and no routing), E not divisible by the world size,
expert MLPs of different shapes; a block or model sharded already raises ``AlreadyParallelizedError``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from fo_kernels.collectives import all_gather_tensor
from fo_kernels.errors import AlreadyParallelizedError, PlanError, ScheduleError, ShapeError
from fo_kernels.fields import check_bool, check_int
from fo_kernels.groups import SharesGroupWhenCopied, check_group, require_initialized
from fo_kernels.moe.ffn import expert_parallel_ffn
from fo_kernels.moe.routing import FFN_DTYPES, check_call
from fo_kernels.moe.schedule import MoeSchedule
from fo_kernels.moe.source import Source, fused_block, other_layout, per_expert_block
from fo_kernels.refusal import refusal, refused, shape_of, shape_text

# What ``from_experts`` and ``parallelize_experts`` say of a block that is a shard already.
_SHARDED = (
    "experts: already an ExpertParallelExperts (sharded by from_experts or parallelize_experts); build "
    "one from the unsharded experts block, or use this one as it is"
)


def _rank_experts(local: int, group: dist.ProcessGroup | None) -> slice:
    """This rank's ``local`` experts among all of them: [rank x E_local, (rank + 1) x E_local)."""
    rank = dist.get_rank(group)
    return slice(rank * local, (rank + 1) * local)


def _check_experts(w13: object, w2: object, num_experts: object, schedule: object, world: int) -> None:
    """Refuse on construction what ``expert_parallel_ffn`` would refuse at the first call (the
    weights' shapes and dtypes, ``routing.check_call``'s rules), and a ``num_experts`` that is not
    this rank's experts times the group's size (``ShapeError``), a schedule that is not a
    ``MoeSchedule`` (``ScheduleError``)."""
    for name, t in (("w13", w13), ("w2", w2)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.dtype not in FFN_DTYPES:
            raise ShapeError(
                f"{name}: expected a 3-dim tensor ({'E_local, H, 2I' if name == 'w13' else 'E_local, I, H'}) "
                f"of bfloat16, float16, float32 or float64, got {_described(t)}"
            )
    if w13.dtype != w2.dtype:
        raise ShapeError(
            f"w13 is {w13.dtype} but w2 is {w2.dtype}: the experts' weights must share one dtype (cast "
            "one of them)"
        )
    # a call of no token checks the weights against each other as every call does
    none = w13.new_empty(0, w13.shape[1])
    # (no ids to read: a module made on the meta device, to be loaded later, is taken)
    ids = torch.empty(0, 1, dtype=torch.int64, device=w13.device)
    check_call(none, ids, none[:, :1], w13, w2, world, check_ids=False)
    check_int("num_experts", num_experts, minimum=1, error=ShapeError)
    if num_experts != w13.shape[0] * world:
        raise ShapeError(
            f"num_experts: {num_experts} is not this rank's {w13.shape[0]} experts (w13.shape[0]) x the "
            f"group's {world} ranks = {w13.shape[0] * world}"
        )
    if schedule is not None and not isinstance(schedule, MoeSchedule):
        raise ScheduleError(
            f"schedule: expected a fo_kernels.MoeSchedule or None, got {type(schedule).__name__}"
        )


def _token_rows(
    hidden_states: object, top_k_index: object, top_k_weights: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward's arguments as the op's (T, H), (T, k) and (T, k) rows; ``ShapeError`` (before
    any collective) for a routing of another number of tokens than ``hidden_states`` holds."""
    named = {"hidden_states": hidden_states, "top_k_index": top_k_index, "top_k_weights": top_k_weights}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            raise ShapeError(f"{name}: expected a tensor of at least 1 dim, got {_described(t)}")
    tokens, k = math.prod(hidden_states.shape[:-1]), top_k_index.shape[-1]
    if top_k_weights.shape != top_k_index.shape or math.prod(top_k_index.shape[:-1]) != tokens:
        raise ShapeError(
            f"top_k_index and top_k_weights must both be (..., k) over the {int(tokens)} tokens of "
            f"hidden_states {shape_text(hidden_states)}; got {_described(top_k_index)} and "
            f"{_described(top_k_weights)}"
        )
    x = hidden_states.reshape(tokens, hidden_states.shape[-1])
    return x, top_k_index.reshape(tokens, k), top_k_weights.reshape(tokens, k)


def _shared_rows(tokens: int, group: dist.ProcessGroup | None) -> tuple[slice, int]:
    """This rank's slice of ``tokens`` rows that every rank of ``group`` holds, and the rows of a
    rank's slice (ceil(T / world): the last ranks hold fewer, none where T < world; an all-gather
    moves slices of one size, so the short ones are padded to it)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    per = -(-tokens // world)
    return slice(min(rank * per, tokens), min((rank + 1) * per, tokens)), per


def _gather_rows(part: torch.Tensor, tokens: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's slice ``part`` of the ``tokens`` shared rows, concatenated in rank order."""
    _, per = _shared_rows(tokens, group)
    padded = part.new_zeros(per, *part.shape[1:])
    padded[: part.shape[0]] = part
    out = part.new_empty(dist.get_world_size(group) * per, *part.shape[1:])
    all_gather_tensor(out, padded, group=group)
    return out[:tokens]


class _RankRows(torch.autograd.Function):
    """This rank's slice of rows every rank holds; the backward gathers every rank's slice of the
    gradient (each rank's gradient covers its own rows only)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group, ctx.tokens = group, x.shape[0]
        return x[_shared_rows(x.shape[0], group)[0]].clone()

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_rows(dy.contiguous(), ctx.tokens, ctx.group), None


class _AllRankRows(torch.autograd.Function):
    """Every rank's slice of the rows, gathered; the backward takes this rank's slice of the
    gradient, which every rank of a tensor-parallel group holds whole and alike."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, tokens: int, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.rows = _shared_rows(tokens, group)[0]
        return _gather_rows(y.contiguous(), tokens, group)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return dy[ctx.rows].contiguous(), None, None


def _described(t: object) -> str:
    return f"{shape_text(t)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__


class ExpertParallelExperts(SharesGroupWhenCopied, nn.Module):
    """This rank's experts (``w13`` (E_local, H, 2I), ``w2`` (E_local, I, H)) of ``num_experts``,
    run by ``expert_parallel_ffn`` over ``group`` (see the module docstring); ``shared_tokens``:
    every rank of ``group`` holds the same tokens (a tensor-parallel group), each sends its slice."""

    def __init__(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        *,
        num_experts: int,
        group: dist.ProcessGroup | None = None,
        schedule: MoeSchedule | None = None,
        shared_tokens: bool = False,
    ) -> None:
        super().__init__()
        require_initialized()
        check_group(group)
        _check_experts(w13, w2, num_experts, schedule, dist.get_world_size(group))
        self.w13 = nn.Parameter(w13.contiguous())
        self.w2 = nn.Parameter(w2.contiguous())
        self.num_experts, self.group, self.schedule = num_experts, group, schedule
        self.shared_tokens = check_bool("shared_tokens", shared_tokens)
        # the layout of the block ``from_experts`` read, whose state_dicts load too (see
        # ``_load_from_state_dict``); None for a module built from w13 and w2
        self.source: Source | None = None

    @classmethod
    def from_experts(
        cls,
        experts: nn.Module,
        *,
        group: dist.ProcessGroup | None = None,
        schedule: MoeSchedule | None = None,
        shared_tokens: bool = False,
    ) -> ExpertParallelExperts:
        """This rank's share of a Hugging Face experts block (either layout of the module
        docstring), its weights trained where the block's are (frozen experts stay frozen); the
        block itself is left as it is."""
        require_initialized()
        check_group(group)
        if isinstance(experts, ExpertParallelExperts):
            raise AlreadyParallelizedError(_SHARDED)
        if not isinstance(experts, nn.Module):
            raise PlanError(
                f"experts: expected an experts block (an nn.Module), got {type(experts).__name__}"
            )
        if isinstance(experts, nn.ModuleList):
            w13, w2, trains, source = per_expert_block(experts)
        elif hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj"):
            w13, w2, trains, source = fused_block(experts)
        else:
            raise PlanError(f"experts: {other_layout(experts)}")
        world = dist.get_world_size(group)
        total = w13.shape[0]
        if total % world:
            raise PlanError(
                f"experts: {total} experts do not split over {world} ranks (E % world != 0); use an "
                f"expert-parallel group whose size divides {total}"
            )
        part = _rank_experts(total // world, group)
        module = cls(
            w13[part].clone(),
            w2[part].clone(),
            num_experts=total,
            group=group,
            schedule=schedule,
            shared_tokens=shared_tokens,
        )
        module.w13.requires_grad_(trains[0])
        module.w2.requires_grad_(trains[1])
        module.source = source
        return module

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        """A state_dict of the block ``from_experts`` read (a Hugging Face checkpoint: fused
        ``gate_up_proj`` / ``down_proj``, or each expert's Linear weights) loads as this rank's
        experts, taken from the block's ``num_experts``; one of this module (``w13``, ``w2``) loads
        as it is."""
        source = self.source
        if source is not None and prefix + "w13" not in state_dict:
            keys = [prefix + k for k in source.keys(self.num_experts)]
            if any(k in state_dict for k in keys):
                entries = {k[len(prefix) :]: state_dict.pop(k) for k in keys if k in state_dict}
                state_dict[prefix + "w13"], state_dict[prefix + "w2"] = self._shard(entries, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _shard(self, entries: dict[str, torch.Tensor], prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (w13, w2) from the whole block's state_dict ``entries`` (``PlanError`` for
        a block of another size or layout)."""
        missing = sorted(set(self.source.keys(self.num_experts)) - set(entries))
        if missing:
            raise PlanError(
                f"{prefix or 'state_dict'}: the checkpoint's experts block lacks {prefix}{missing[0]} "
                f"(and {len(missing) - 1} more): this module loads the whole block of "
                f"{self.num_experts} experts it was built from"
            )
        try:
            w13, w2 = self.source.weights(entries, self.num_experts)
        except (PlanError, RuntimeError) as exc:  # (RuntimeError: experts' Linears that differ)
            raise PlanError(f"{prefix or 'state_dict'}: the checkpoint's {exc}") from None
        if w13.shape[0] != self.num_experts or w13.shape[1:] != self.w13.shape[1:]:
            raise PlanError(
                f"{prefix or 'state_dict'}: the checkpoint's experts are {tuple(w13.shape)} as (E, H, 2I); "
                f"this module holds {self.num_experts} experts of {tuple(self.w13.shape[1:])}"
            )
        part = _rank_experts(self.w13.shape[0], self.group)
        # copies of this rank's part alone (``load_state_dict(..., assign=True)`` keeps what it is
        # given: a view would keep every expert of the checkpoint alive)
        return tuple(t[part].clone(memory_format=torch.contiguous_format) for t in (w13, w2))

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The experts' weighted sum for this rank's tokens ``hidden_states`` (..., H), routed by
        ``top_k_index`` and ``top_k_weights`` (..., k); the same shape as ``hidden_states``."""
        rows, why = refusal(lambda: _token_rows(hidden_states, top_k_index, top_k_weights))
        if why is not None:  # (traced: raised when the graph runs)
            return refused(why, (hidden_states, self.w13), shape_of(hidden_states))
        x, ids, weights = rows
        tokens = x.shape[0]
        if self.shared_tokens:
            x, weights = _RankRows.apply(x, self.group), _RankRows.apply(weights, self.group)
            ids = ids[_shared_rows(tokens, self.group)[0]]
        y = expert_parallel_ffn(
            x,
            ids,
            weights,
            self.w13,
            self.w2,
            group=self.group,
            schedule=self.schedule,
        )
        if self.shared_tokens:
            y = _AllRankRows.apply(y, tokens, self.group)
        return y.reshape(hidden_states.shape)

    def extra_repr(self) -> str:
        e, h, i2 = self.w13.shape
        text = f"experts={e} of {self.num_experts}, hidden={h}, intermediate={i2 // 2}"
        return f"{text}, shared_tokens=True" if self.shared_tokens else text


def parallelize_experts(
    model: nn.Module,
    *,
    group: dist.ProcessGroup | None = None,
    schedule: MoeSchedule | None = None,
    shared_tokens: bool = False,
) -> list[str]:
    """Replace every fused experts block (a module named ``experts`` with ``gate_up_proj`` and
    ``down_proj``, as transformers >= 5 builds them) by its ``ExpertParallelExperts``; the names
    replaced. A ModuleList of experts is left alone: its MoE block calls each expert itself. Every
    block is built before any is replaced, so a block it refuses (``PlanError``, naming the block)
    leaves the model as it was; a model whose ``experts`` modules are all in another layout (an
    ungated block, DBRX's, Switch Transformers') is refused naming the first and what it holds.
    ``shared_tokens=True`` where every rank of ``group`` holds the same tokens, as the ranks of a
    tensor-parallel group do (the model's attention sharded by transformers' ``tp_plan`` over them):
    each rank sends its slice of the tokens, so the experts' gradients are the unsharded model's."""
    if not isinstance(model, nn.Module):
        raise PlanError(f"parallelize_experts: expected a model (an nn.Module), got {type(model).__name__}")
    require_initialized()
    check_group(group)  # (a GroupError whatever the model holds, as from_experts gives)
    built, others, sharded_before = [], [], []
    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] != "experts":
            continue
        if isinstance(module, ExpertParallelExperts):
            sharded_before.append(name)
            continue
        if not (hasattr(module, "gate_up_proj") and hasattr(module, "down_proj")):
            others.append((name, module))
            continue
        try:
            sharded = ExpertParallelExperts.from_experts(
                module, group=group, schedule=schedule, shared_tokens=shared_tokens
            )
        except PlanError as exc:
            raise PlanError(f"{name}: {exc}") from None
        built.append((name, sharded))
    for name, sharded in built:
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        parent.experts = sharded
    done = [name for name, _ in built]
    if not done and sharded_before:
        raise AlreadyParallelizedError(f"{sharded_before[0]}: {_SHARDED}")
    if not done and hasattr(model, "gate_up_proj") and hasattr(model, "down_proj"):
        # (the root cannot be replaced in place: there is no parent to hold its replacement)
        raise PlanError(
            f"parallelize_experts: the model is itself an experts block ({type(model).__name__}); "
            "pass the module that holds it, or build its replacement with "
            "ExpertParallelExperts.from_experts"
        )
    if not done and others:
        # a model whose experts blocks are all in another layout: name the first and what differs
        name, module = others[0]
        if isinstance(module, nn.ModuleList):
            raise PlanError(
                f"{name}: a ModuleList of expert MLPs, which its MoE block calls one by one: "
                "parallelize_experts replaces fused blocks (gate_up_proj, down_proj); build "
                "ExpertParallelExperts.from_experts(...) and call it from the MoE block"
            )
        raise PlanError(f"{name}: experts: {other_layout(module)}")
    if not done:
        raise PlanError("parallelize_experts: the model has no fused experts block (a module named experts)")
    return done
