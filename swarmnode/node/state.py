"""A node's state as named tensors: what a state transfer sends and how a receiver loads it.

Parts (`protocols.transfers.StatePart`): `weights` (the stage's parameters, names relative to the stage),
`optimizer` (Adam moments per parameter, `adam.{name}.exp_avg|exp_avg_sq|step`, plus NoLoCo's slow weights
and momentum, `outer.phi.{name}` / `outer.delta.{name}`), `embedding_copy` (E: from a data node, or from the
copy a stage-1 node keeps) and `head_copy` (E': from a data node, or from the copy the last stage keeps).
Everything received is checked against the local layout and for finite values before it touches a model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from protocols._arraymap import layout_mismatch
from protocols.bounds import drift_problem, moments_problem, size_problem
from protocols.manifest import TensorSpec
from protocols.transfers import StatePart
from swarmnode.adam import STATE_FIELDS as ADAM_FIELDS
from swarmnode.optim import StageOptimizer
from swarmnode.precision import all_finite

TensorMap = dict[str, Tensor]  # the runtime's one name -> torch tensor map (protocols': `ArrayMap`)

EMBEDDING_PREFIX = "embedding."
HEAD_PREFIX = "head."


class StateMismatch(ValueError):
    """Received state does not fit this node (names, shapes, dtypes) or holds non-finite values."""


def weights(module: nn.Module) -> TensorMap:
    """A copy of the module's weights on the host (what is sent, averaged and rebuilt from lives there,
    whatever device the node computes on)."""
    return {name: host_copy(p) for name, p in module.named_parameters()}


def host_copy(tensor: Tensor) -> Tensor:
    """A float32-preserving copy of `tensor` in CPU memory."""
    return tensor.detach().to("cpu", copy=True)


def optimizer_state(
    module: nn.Module, optimizer: StageOptimizer, phi: TensorMap, delta: TensorMap | None
) -> TensorMap:
    out: TensorMap = {}
    for name, param in module.named_parameters():
        state = optimizer.adam.state.get(param, {})
        for field in ADAM_FIELDS:
            if field in state:
                out[f"adam.{name}.{field}"] = host_copy(state[field]).float()
        out[f"outer.phi.{name}"] = phi[name].clone()
        if delta is not None:
            out[f"outer.delta.{name}"] = delta[name].clone()
    return out


def split_piece_copy(piece_weights: TensorMap, part: StatePart) -> TensorMap:
    """A data node's E (`embedding_copy`) or E' (`head_copy`) out of its piece's weights, prefix removed."""
    prefix = _piece_prefix(part)
    return {name.removeprefix(prefix): t for name, t in piece_weights.items() if name.startswith(prefix)}


def piece_copy(module: nn.Module, part: StatePart) -> TensorMap:
    """A copy of a data node's E or E' alone (`split_piece_copy` of `weights(module)`, without copying the
    other half of the piece: half the bytes of every CheckFree+ refresh a data node serves)."""
    prefix = _piece_prefix(part)
    named = module.named_parameters()
    return {name.removeprefix(prefix): host_copy(p) for name, p in named if name.startswith(prefix)}


def _piece_prefix(part: StatePart) -> str:
    return EMBEDDING_PREFIX if part == StatePart.EMBEDDING_COPY else HEAD_PREFIX


def manifest(tensors: TensorMap) -> tuple[TensorSpec, ...]:
    return tuple(
        TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in tensors.items()
    )


def unpack(specs: tuple[TensorSpec, ...], tensors: list[Tensor]) -> TensorMap:
    if len(specs) != len(tensors):
        raise StateMismatch(f"{len(specs)} tensors announced, {len(tensors)} received")
    out = {}
    for spec, tensor in zip(specs, tensors, strict=True):
        if tuple(tensor.shape) != spec.shape:
            raise StateMismatch(f"{spec.name}: shape {tuple(tensor.shape)} is not the announced {spec.shape}")
        out[spec.name] = tensor
    return out


def check_layout(reference: TensorMap, received: TensorMap, what: str) -> None:
    """Raise StateMismatch unless `received` has exactly `reference`'s names and shapes, all finite."""
    problem = layout_mismatch(reference, received)
    if problem is not None:
        raise StateMismatch(f"{what}: {problem}")
    for name, tensor in received.items():
        check_tensor(tuple(reference[name].shape), tensor, f"{what}: {name}")


def layout_check(reference: TensorMap, what: str) -> Callable[[object, TensorMap], None]:
    """A check for `recovery.fetch_any`: `check_layout` of what a donor sent against `reference`."""

    def check(_header: object, received: TensorMap) -> None:
        check_layout(reference, received, what)

    return check


def check_tensor(shape: tuple[int, ...], tensor: Tensor, what: str, nonnegative: bool = False) -> None:
    """Raise StateMismatch unless `tensor` has `shape` and finite floating-point values (>= 0 if asked)."""
    if tuple(tensor.shape) != shape:
        raise StateMismatch(f"{what} has shape {tuple(tensor.shape)}, expected {shape}")
    if not tensor.is_floating_point() or not all_finite(tensor):
        raise StateMismatch(f"{what} is not a finite floating-point tensor")
    if nonnegative and tensor.numel() and float(tensor.min()) < 0:
        raise StateMismatch(f"{what} has negative values")


def load_weights(module: nn.Module, received: TensorMap) -> None:
    """Copy `received` into the module's parameters (checked first)."""
    own = dict(module.named_parameters())
    check_layout({n: p.detach() for n, p in own.items()}, received, "weights")
    with torch.no_grad():
        for name, param in own.items():
            param.copy_(received[name].to(param.dtype))


@dataclass(frozen=True)
class ReplicaState:
    """A live replica's weights, Adam moments and NoLoCo state, checked against this node's stage."""

    weights: TensorMap
    moments: dict[str, tuple[Tensor, Tensor, Tensor]]  # parameter -> (step, exp_avg, exp_avg_sq)
    phi: TensorMap
    delta: TensorMap | None


def check_replica_state(
    module: nn.Module, received: TensorMap, *, max_grad_norm: float, max_step: int
) -> ReplicaState:
    """Everything a donor sent, checked before any of it is loaded (a refused state leaves the node as it
    was): the weights, each parameter's Adam moments (all three or none; `step` a scalar within 0..`max_step`,
    the moments within what gradients clipped to `max_grad_norm` produce), and NoLoCo's phi and delta (phi
    defaults to the weights; delta for every parameter or none; both within `bounds.MAX_DRIFT` of the
    weights). See `protocols.bounds`."""
    own = {name: param.detach() for name, param in module.named_parameters()}
    weights = {name: t for name, t in received.items() if name in own}
    check_layout(own, weights, "weights")
    moments: dict[str, tuple[Tensor, Tensor, Tensor]] = {}
    phi: TensorMap = {}
    delta: TensorMap = {}
    for name, param in own.items():
        shape = tuple(param.shape)
        step, exp_avg, exp_avg_sq = (received.get(f"adam.{name}.{f}") for f in ADAM_FIELDS)
        given = [t is not None for t in (step, exp_avg, exp_avg_sq)]
        if any(given) and not all(given):
            raise StateMismatch(f"optimizer state of {name} is incomplete")
        if step is not None and exp_avg is not None and exp_avg_sq is not None:
            if step.numel() != 1:
                raise StateMismatch(f"adam step of {name} is not a scalar")
            check_tensor((), step.reshape(()), f"adam step of {name}", nonnegative=True)
            check_tensor(shape, exp_avg, f"exp_avg of {name}")
            check_tensor(shape, exp_avg_sq, f"exp_avg_sq of {name}", nonnegative=True)
            problem = moments_problem(
                name, step, exp_avg, exp_avg_sq, max_grad_norm=max_grad_norm, max_step=max_step
            )
            if problem is not None:
                raise StateMismatch(problem)
            moments[name] = (step.reshape(()).float(), exp_avg.float(), exp_avg_sq.float())
        phi_t = received.get(f"outer.phi.{name}")
        if phi_t is not None:
            check_tensor(shape, phi_t, f"outer phi of {name}")
        phi[name] = phi_t.clone() if phi_t is not None else host_copy(param)
        delta_t = received.get(f"outer.delta.{name}")
        if delta_t is not None:
            check_tensor(shape, delta_t, f"outer delta of {name}")
            delta[name] = delta_t.clone()
    if delta and len(delta) != len(own):
        raise StateMismatch(f"outer delta for {len(delta)} of {len(own)} parameters")
    problem = drift_problem(weights, [("outer phi", phi)])
    if problem is None and delta:
        problem = size_problem("outer delta", delta, weights)
    if problem is not None:
        raise StateMismatch(problem)
    return ReplicaState(weights, moments, phi, delta or None)


def load_replica_state(module: nn.Module, optimizer: StageOptimizer, checked: ReplicaState) -> None:
    """Load a checked replica state's weights and Adam moments (NoLoCo's part is the caller's)."""
    load_weights(module, checked.weights)
    for name, param in module.named_parameters():
        if name in checked.moments:
            step, exp_avg, exp_avg_sq = checked.moments[name]
            optimizer.adam.state[param] = {
                "step": step.clone(),  # on the host, as Adam keeps it
                "exp_avg": exp_avg.to(param.device, copy=True),
                "exp_avg_sq": exp_avg_sq.to(param.device, copy=True),
            }
