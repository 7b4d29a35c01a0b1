"""A node's state as named tensors: what a state transfer sends and how a receiver loads it.

Parts (`protocols.messages.StatePart`): `weights` (the stage's parameters, names relative to the stage),
`optimizer` (Adam moments per parameter, `adam.{name}.exp_avg|exp_avg_sq|step`, plus NoLoCo's slow weights
and momentum, `outer.phi.{name}` / `outer.delta.{name}`), `embedding_copy` (E: from a data node, or from the
copy a stage-1 node keeps) and `head_copy` (E': from a data node, or from the copy the last stage keeps).
Everything received is checked against the local layout and for finite values before it touches a model.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from protocols.messages import StatePart, TensorSpec
from swarmnode.optim import StageOptimizer

TensorMap = dict[str, Tensor]

EMBEDDING_PREFIX = "embedding."
HEAD_PREFIX = "head."


class StateMismatch(ValueError):
    """Received state does not fit this node (names, shapes, dtypes) or holds non-finite values."""


def weights(module: nn.Module) -> TensorMap:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def optimizer_state(
    module: nn.Module, optimizer: StageOptimizer, phi: TensorMap, delta: TensorMap | None
) -> TensorMap:
    out: TensorMap = {}
    for name, param in module.named_parameters():
        state = optimizer.adam.state.get(param, {})
        for field in ("exp_avg", "exp_avg_sq", "step"):
            if field in state:
                out[f"adam.{name}.{field}"] = state[field].detach().clone().float()
        out[f"outer.phi.{name}"] = phi[name].clone()
        if delta is not None:
            out[f"outer.delta.{name}"] = delta[name].clone()
    return out


def split_piece_copy(piece_weights: TensorMap, part: StatePart) -> TensorMap:
    """A data node's E (`embedding_copy`) or E' (`head_copy`) out of its piece's weights, prefix removed."""
    prefix = EMBEDDING_PREFIX if part == StatePart.EMBEDDING_COPY else HEAD_PREFIX
    return {name.removeprefix(prefix): t for name, t in piece_weights.items() if name.startswith(prefix)}


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
    if set(received) != set(reference):
        missing = sorted(set(reference) - set(received))[:3]
        extra = sorted(set(received) - set(reference))[:3]
        raise StateMismatch(f"{what}: names differ (missing {missing}, unexpected {extra})")
    for name, tensor in received.items():
        if tensor.shape != reference[name].shape:
            raise StateMismatch(
                f"{what}: {name} has shape {tuple(tensor.shape)}, expected {tuple(reference[name].shape)}"
            )
        if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
            raise StateMismatch(f"{what}: {name} is not a finite floating-point tensor")


def load_weights(module: nn.Module, received: TensorMap) -> None:
    """Copy `received` into the module's parameters (checked first)."""
    own = dict(module.named_parameters())
    check_layout({n: p.detach() for n, p in own.items()}, received, "weights")
    with torch.no_grad():
        for name, param in own.items():
            param.copy_(received[name].to(param.dtype))


def load_optimizer(
    module: nn.Module, optimizer: StageOptimizer, received: TensorMap
) -> tuple[TensorMap, TensorMap | None]:
    """Load Adam moments; return the NoLoCo (phi, delta) in `received` (phi defaults to the weights)."""
    phi: TensorMap = {}
    delta: TensorMap = {}
    for name, param in module.named_parameters():
        moments = {f: received.get(f"adam.{name}.{f}") for f in ("exp_avg", "exp_avg_sq", "step")}
        if all(m is not None for m in moments.values()):
            for field in ("exp_avg", "exp_avg_sq"):
                if moments[field].shape != param.shape or not bool(torch.isfinite(moments[field]).all()):
                    raise StateMismatch(f"optimizer state of {name} does not fit")
            optimizer.adam.state[param] = {
                "step": moments["step"].reshape(()).float(),
                "exp_avg": moments["exp_avg"].clone(),
                "exp_avg_sq": moments["exp_avg_sq"].clone(),
            }
        phi_t = received.get(f"outer.phi.{name}")
        phi[name] = (
            phi_t.clone() if phi_t is not None and phi_t.shape == param.shape else param.detach().clone()
        )
        delta_t = received.get(f"outer.delta.{name}")
        if delta_t is not None and delta_t.shape == param.shape:
            delta[name] = delta_t.clone()
    return phi, (delta if len(delta) == len(phi) else None)
