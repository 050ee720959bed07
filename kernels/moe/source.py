"""How ``ExpertParallelExperts.from_experts`` reads a transformers experts block: its weights as the
op's (w13, w2) from either layout (fused: ``fused_block``; a ModuleList of expert MLPs:
``per_expert_block``), the checks that it computes what ``expert_parallel_ffn`` does (SiLU, a gate,
no bias, no norm after each expert), the refusal of a block in neither layout (``other_layout``),
and ``Source``: how the block named and laid out its weights, so that a checkpoint of such blocks
loads into the sharded module (``fo_kernels.moe.module``).

The activation is checked where the block names it (its ``_apply_gate``, else its ``act_fn``); a
block or expert MLP that names none (its forward calls ``F.silu`` itself) has its own forward
probed instead: rows through each expert against ``silu(x @ gate) * (x @ up) @ down`` of the
weights read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fo_kernels.errors import PlanError

# Points where a SiLU is told apart from the other activations transformers' MoE models use
# (gelu, relu, the clamped SwiGLUs): the largest lie far past every clamp limit transformers'
# models set (gpt-oss 7, DeepSeek-V4 10); checked to float32 rounding, on the CPU (a model built
# under ``torch.device("meta")`` would otherwise probe meta tensors, which hold no values).
_PROBE = (-1e3, -3.0, -0.5, 0.25, 2.0, 9.0, 1e3)
_PROBE_TOL = 1e-6
# The probe rows of a block that names no activation (its forward probed, ``_check_forward``): each
# row scaled so its largest gate pre-activation is one of these, where a SiLU is told from ReLU
# and GELU (near 1 and 4) and from the clamped SwiGLUs (gpt-oss 7, DeepSeek-V4 10: at 30).
_FORWARD_REACH = (1.0, 4.0, 30.0)
# The largest relative error (per row, of its norm) the probed forward may have against the
# formula in float64: a few roundings in the weights' dtype (machine epsilon: float32 1.2e-7,
# float16 9.8e-4, bfloat16 7.8e-3); GELU or ReLU in the SiLU's place is off by 0.1 or more at 1.
_FORWARD_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
# The block's own exceptions from a forward it cannot run on the probe (another signature, ...).
_FORWARD_ERRORS = (TypeError, RuntimeError, ValueError, AttributeError, IndexError)
# Per-expert MLP attribute names: (gate, up, down), Mixtral's then Qwen's (transformers 4).
_MLP_NAMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))


def _check_silu(act: object, where: str) -> None:
    if not callable(act):
        raise PlanError(f"{where}: no act_fn to check; expert_parallel_ffn computes silu(gate) * up")
    probe = torch.tensor(_PROBE, device="cpu")
    try:  # (on a copy: an in-place SiLU, nn.SiLU(inplace=True), would change the probe itself)
        same = torch.allclose(act(probe.clone()), F.silu(probe), atol=_PROBE_TOL)
    except (TypeError, RuntimeError):
        same = False
    if not same:
        raise PlanError(
            f"{where}: its activation {act!r} is not SiLU; expert_parallel_ffn computes silu(gate) * up"
        )


def _check_gate(experts: nn.Module) -> None:
    """Raise ``PlanError`` unless the fused block's gating (its ``_apply_gate`` of (R, 2I) rows,
    which transformers' experts implementations call, else its ``act_fn``) is ``silu(gate) * up``; a
    block with neither has its forward probed by ``fused_block``."""
    apply_gate = getattr(experts, "_apply_gate", None)
    if apply_gate is None:
        if getattr(experts, "act_fn", None) is not None:  # (none: its forward is probed instead)
            _check_silu(experts.act_fn, "experts")
        return
    probe = torch.tensor(_PROBE, device="cpu")
    gate, up = (t.reshape(-1) for t in torch.meshgrid(probe, probe, indexing="ij"))
    # I = 1: the concatenated [gate | up] and the interleaved [g0, u0] rows are the same
    try:
        got = apply_gate(torch.stack([gate, up], dim=1)).reshape(-1)
        same = torch.allclose(got, F.silu(gate) * up, rtol=_PROBE_TOL, atol=_PROBE_TOL)
    except (TypeError, RuntimeError, AttributeError):
        same = False
    if not same:
        raise PlanError(
            f"experts: its gating ({type(experts).__name__}._apply_gate) is not silu(gate) * up, which "
            "expert_parallel_ffn computes"
        )


def _check_forward(
    run: Callable[[torch.Tensor, int], torch.Tensor],
    w13: torch.Tensor,
    w2: torch.Tensor,
    experts: list[int],
    where: str,
) -> None:
    """``PlanError`` unless ``run(x, e)``, the block's own forward of rows ``x`` through its expert
    ``e``, is ``silu(x @ gate) * (x @ up) @ down`` of ``w13`` (E, H, 2I) and ``w2`` (E, I, H) for each
    of ``experts``: the activation check of a block that names none (no ``act_fn``)."""
    fix = "give it an act_fn (a SiLU), as transformers' experts have"
    if w13.device.type == "meta":
        raise PlanError(
            f"{where}: no act_fn to check, and its weights on the meta device hold no values to probe "
            f"its forward with; {fix}, or build it on a real device"
        )
    tol = _FORWARD_TOL.get(w13.dtype)
    if tol is None:  # (a dtype the op does not take: the module's dtype check refuses it)
        return
    inter = w2.shape[1]
    base = torch.randn(len(_FORWARD_REACH), w13.shape[1], generator=torch.Generator().manual_seed(0))
    reach = torch.tensor(_FORWARD_REACH)[:, None]
    for e in experts:
        w13e, w2e = w13[e].detach().double().cpu(), w2[e].detach().double().cpu()
        peak = (base.double() @ w13e[:, :inter]).abs().amax(dim=1, keepdim=True)
        if not bool((peak > 0).all()):
            raise PlanError(
                f"{where}: no act_fn to check, and expert {e}'s gate weights are zero, which leaves no "
                f"activation to probe its forward with; {fix}"
            )
        x = (base.double() * reach / peak).to(w13.dtype)
        gate_up = x.double() @ w13e
        want = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w2e
        try:
            with torch.no_grad():
                got = run(x.to(w13.device), e)
        except _FORWARD_ERRORS as exc:
            raise PlanError(
                f"{where}: no act_fn to check, and its forward could not be probed on expert {e}'s rows "
                f"({type(exc).__name__}: {exc}); {fix}"
            ) from None
        err = float("inf")
        if isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(want.shape):
            diff = (got.detach().double().cpu() - want).norm(dim=1)
            err = (diff / want.norm(dim=1).clamp_min(torch.finfo(torch.float64).tiny)).max().item()
        if not err <= tol:  # (NaN too)
            raise PlanError(
                f"{where}: it names no act_fn, so its forward was probed, and expert {e}'s is not "
                f"silu(x @ gate) * (x @ up) @ down (relative error {err:.1e}); expert_parallel_ffn "
                "computes silu(gate) * up"
            )


# (w13, w2) of every expert, whether the block trains each (its weights' requires_grad), and how
# the block names them.
Weights = tuple[torch.Tensor, torch.Tensor, tuple[bool, bool], "Source"]


@dataclass(frozen=True, slots=True)
class Source:
    """How the block ``from_experts`` read names and lays out its weights, so that a state_dict
    of such blocks (a Hugging Face checkpoint) loads into the sharded module."""

    fused: bool
    transposed: bool = False  # fused: (E, H, 2I) and (E, I, H) rather than (E, 2I, H) and (E, H, I)
    concatenated: bool = True  # fused: [gate | up] rather than [g0, u0, g1, u1, ...]
    names: tuple[str, str, str] = ("", "", "")  # per expert: the (gate, up, down) Linear names

    def fused_weights(self, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) as (E, H, 2I) and (E, I, H) from a fused block's gate_up_proj and down_proj;
        ``PlanError`` for what is not a fused block's (shapes, or tensors of another number of dims,
        named as the block holds them)."""
        held = (gate_up, down)
        fits = all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in held)
        if fits:
            if not self.transposed:
                gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
            experts_n, hidden, i2 = gate_up.shape
            fits = i2 % 2 == 0 and i2 > 0 and tuple(down.shape) == (experts_n, i2 // 2, hidden)
        if not fits:
            want = "(E, H, 2I) and (E, I, H)" if self.transposed else "(E, 2I, H) and (E, H, I)"
            shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in held]
            raise PlanError(
                f"gate_up_proj {shapes[0]} and down_proj {shapes[1]} are not the {want} of a "
                f"transformers experts block (is_transposed={self.transposed})"
            )
        if not self.concatenated:  # [g0, u0, g1, u1, ...] -> [gate | up]
            gate_up = torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1)
        return gate_up, down

    def keys(self, experts: int) -> list[str]:
        """The state_dict keys of such a block of ``experts`` experts (below its prefix)."""
        if self.fused:
            return ["gate_up_proj", "down_proj"]
        return [f"{e}.{name}.weight" for e in range(experts) for name in self.names]

    def weights(self, entries: dict[str, torch.Tensor], experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) of all ``experts`` from a state_dict's ``keys(experts)`` entries."""
        if self.fused:
            return self.fused_weights(entries["gate_up_proj"], entries["down_proj"])
        gate, up, down = self.names
        w13 = [
            torch.cat([entries[f"{e}.{gate}.weight"].t(), entries[f"{e}.{up}.weight"].t()], 1)
            for e in range(experts)
        ]
        return torch.stack(w13), torch.stack([entries[f"{e}.{down}.weight"].t() for e in range(experts)])


def fused_block(experts: nn.Module) -> Weights:
    """(w13, w2) of every expert from the fused layout, as (E, H, 2I) and (E, I, H)."""
    for flag, bad in (("has_bias", True), ("has_post_expert_norm", True), ("has_gate", False)):
        if getattr(experts, flag, not bad) == bad:
            raise PlanError(f"experts: {flag}={bad} is not the SwiGLU expert expert_parallel_ffn computes")
    _check_gate(experts)
    source = Source(
        fused=True,
        transposed=bool(getattr(experts, "is_transposed", False)),
        concatenated=bool(getattr(experts, "is_concatenated", True)),
    )
    gate_up, down = experts.gate_up_proj, experts.down_proj
    try:
        w13, w2 = source.fused_weights(
            *(t.detach() if isinstance(t, torch.Tensor) else t for t in (gate_up, down))
        )
    except PlanError as exc:
        raise PlanError(f"experts: a {type(experts).__name__}'s {exc}") from None
    if getattr(experts, "_apply_gate", None) is None and getattr(experts, "act_fn", None) is None:

        def run(x: torch.Tensor, e: int) -> torch.Tensor:
            ids = torch.full((x.shape[0], 1), e, dtype=torch.int64, device=x.device)
            return experts(x, ids, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device))

        _check_forward(run, w13, w2, list(range(w13.shape[0])), "experts")
    return w13, w2, (gate_up.requires_grad, down.requires_grad), source


def per_expert_block(experts: nn.ModuleList) -> Weights:
    """(w13, w2) of every expert from a ModuleList of MLPs (``_MLP_NAMES``)."""
    if not len(experts):
        raise PlanError("experts: an empty ModuleList; an experts block holds one MLP per expert")
    first = experts[0]
    names = next((n for n in _MLP_NAMES if all(hasattr(first, a) for a in n)), None)
    if names is None:
        raise PlanError(f"experts: an MLP without {' / '.join('/'.join(n) for n in _MLP_NAMES)} layers")
    entries, trains = {}, [False, False]  # (entries: the block's state_dict, as Source reads it)
    unnamed: list[int] = []  # the experts without an act_fn
    first = None  # experts[0]'s weight shapes, which every expert's must equal
    for i, mlp in enumerate(experts):
        gate, up, down = (getattr(mlp, a) for a in names)
        for name, layer in zip(names, (gate, up, down), strict=True):
            if not isinstance(getattr(layer, "weight", None), torch.Tensor):
                raise PlanError(
                    f"experts[{i}].{name}: expected an nn.Linear, got a layer without a weight "
                    f"({type(layer).__name__}); each expert's {' / '.join(names)} are its Linears"
                )
        shapes = tuple(tuple(layer.weight.shape) for layer in (gate, up, down))
        first = first or shapes
        if shapes != first or len(shapes[0]) != 2 or shapes[1] != shapes[0] or shapes[2] != shapes[0][::-1]:
            raise PlanError(
                f"experts[{i}]: its {' / '.join(names)} weights are {', '.join(map(str, shapes))}; every "
                f"expert's must be (I, H), (I, H) and (H, I), as experts[0]'s {', '.join(map(str, first))}"
            )
        if any(getattr(layer, "bias", None) is not None for layer in (gate, up, down)):
            raise PlanError(
                f"experts[{i}]: biases are not part of the SwiGLU expert expert_parallel_ffn computes"
            )
        if getattr(mlp, "act_fn", None) is None:  # (its forward is probed below)
            unnamed.append(i)
        else:
            _check_silu(mlp.act_fn, f"experts[{i}]")
        entries.update({f"{i}.{a}.weight": getattr(mlp, a).weight.detach() for a in names})
        trains[0] |= gate.weight.requires_grad or up.weight.requires_grad
        trains[1] |= down.weight.requires_grad
    source = Source(fused=False, names=names)
    w13, w2 = source.weights(entries, len(experts))
    if unnamed:
        _check_forward(lambda x, e: experts[e](x), w13, w2, unnamed, "experts")
    return w13, w2, (trains[0], trains[1]), source


def other_layout(experts: nn.Module) -> str:
    """What a block in neither layout holds instead, for the ``PlanError`` that refuses it."""
    kind = type(experts).__name__
    inner = getattr(experts, "experts", None)
    if isinstance(inner, nn.ModuleList) or (hasattr(inner, "gate_up_proj") and hasattr(inner, "down_proj")):
        # (the sparse MoE block around an experts block: its router and its experts)
        return (
            f"a {kind} holds its experts block as .experts: pass that (from_experts(block.experts)), or "
            "replace it in place with parallelize_experts(block); the router stays as it is"
        )
    if hasattr(experts, "up_proj") and hasattr(experts, "down_proj"):
        # (transformers' has_gate=False blocks: NemotronH's and Ergo's relu2 experts)
        return (
            f"a {kind} holds up_proj and down_proj without a gate (has_gate=False: act(x @ up) @ down), "
            "not the SwiGLU expert silu(x @ gate) * (x @ up) that expert_parallel_ffn computes"
        )
    held = [name for name, _ in experts.named_parameters()]
    more = f" (and {len(held) - 3} more)" if len(held) > 3 else ""
    holds = f"; it holds {', '.join(held[:3])}{more}" if held else ""
    return (
        f"a {kind} is neither a fused experts block (gate_up_proj, down_proj) nor a ModuleList of "
        f"expert MLPs{holds}"
    )
