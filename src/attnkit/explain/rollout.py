"""Attention rollout and attention flow (Abnar & Zuidema, "Quantifying Attention Flow in
Transformers", 2020): how much each input token reaches each position at the top of the stack.

A raw attention map shows one layer mixing the previous layer's positions, which by the top are
no longer the input tokens. Both methods follow the mixing down to the inputs. Each layer's
weights are averaged over its heads, and with ``residual=True`` the residual connection is
counted as attention to oneself:

    Â_l = 0.5 * mean_h(A_l,h) + 0.5 * I,  rows renormalised to sum to 1

- **Rollout** multiplies the layers from the first to the last,
  ``R = Â_L · Â_(L-1) · ... · Â_1``, so that row i of R says how much of each input token
  reaches position i at the top, if the mixing simply composes.
- **Flow** reads the layers as a graph: a node per position per layer (layer 0 is the input),
  an edge from position i of layer l to position j of layer l - 1 whose capacity is Â_l[i, j].
  Row i is the maximum flow from top node i to each input node, normalised to sum to 1. A path is
  limited by its weakest edge, where rollout multiplies along every path.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = ["attention_flow", "attention_rollout", "layer_matrices", "rollout_by_layer"]


def layer_matrices(attentions, residual: bool = True, owner: str = "layer_matrices") -> np.ndarray:
    """Per-layer weights averaged over heads (and with ``residual``, 0.5 A + 0.5 I renormalised):
    an (L, B, N, N) float64 array. ``attentions`` is a sequence of (B, H, N, N) tensors, one per
    layer, as a model's ``return_attention=True`` gives them."""
    if isinstance(attentions, Tensor) or not isinstance(attentions, Sequence) or not attentions:
        raise TypeError(
            f"{owner}: attentions must be a non-empty list with one (B, H, N, N) tensor per "
            f"layer, got {type(attentions).__name__}"
        )
    if not isinstance(residual, bool):
        raise TypeError(f"{owner}: residual must be True or False, got {residual!r}")
    shape = None
    layers = []
    for i, t in enumerate(attentions):
        if t is None:
            raise ValueError(
                f"{owner}: attentions[{i}] is None: the model gave no weights for that layer "
                "(linear attention never forms them)"
            )
        if not isinstance(t, Tensor) or t.dim() != 4 or t.shape[-1] != t.shape[-2]:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(
                f"{owner}: attentions[{i}] must be a (B, H, N, N) tensor of self-attention "
                f"weights, got {got}"
            )
        if shape is not None and t.shape != shape:
            raise ValueError(
                f"{owner}: attentions[{i}] has shape {tuple(t.shape)}, but attentions[0] has "
                f"{tuple(shape)}"
            )
        shape = t.shape
        a = t.detach().to("cpu", torch.float64).numpy()
        if not np.isfinite(a).all() or (a < 0).any():
            raise ValueError(f"{owner}: attentions[{i}] must be finite and non-negative weights")
        layers.append(a.mean(axis=1))  # (B, N, N): heads averaged
    mats = np.stack(layers)  # (L, B, N, N)
    if residual:
        mats = 0.5 * mats + 0.5 * np.eye(mats.shape[-1])
        mats = mats / mats.sum(axis=-1, keepdims=True)
    return mats


def attention_rollout(attentions, residual: bool = True) -> Tensor:
    """Attention rollout: ``(B, N, N)``, row i the share of each input token in position i at
    the top, the product of the layers' head-averaged weights from the first to the last.

    ``attentions``: one (B, H, N, N) tensor per layer (a model's ``return_attention=True``
    output; for the encoder-decoder, its ``"encoder"`` or ``"decoder"`` list). With
    ``residual`` (the paper's choice) each layer is ``0.5 * A + 0.5 * I``, rows renormalised.
    """
    mats = layer_matrices(attentions, residual, owner="attention_rollout")
    joint = mats[0]
    for layer in mats[1:]:
        joint = layer @ joint  # R_l = Â_l · R_(l-1)
    return torch.from_numpy(joint).to(attentions[0].dtype)


def rollout_by_layer(attentions, residual: bool = True) -> Tensor:
    """The rollout through layers 0..l for every l: ``(L, B, N, N)``; the last entry is
    :func:`attention_rollout`. The report shows it as a section with one "head" per layer."""
    mats = layer_matrices(attentions, residual, owner="rollout_by_layer")
    joint, out = mats[0], [mats[0]]
    for layer in mats[1:]:
        joint = layer @ joint
        out.append(joint)
    return torch.from_numpy(np.stack(out)).to(attentions[0].dtype)


def attention_flow(attentions, residual: bool = True, *, progress=None) -> Tensor:
    """Attention flow: ``(B, N, N)``, row i the maximum flow from position i at the top to each
    input token through the graph of the layers (capacities the head-averaged weights, with
    ``residual`` as in :func:`attention_rollout`), normalised to sum to 1.

    It solves N x N maximum-flow problems per example (networkx's preflow-push), so it is
    slow for long inputs: about a second for 16 tokens and 6 layers, growing as N^4.
    ``progress(done, total)``, if given, is called after each top position.
    """
    import networkx as nx

    mats = layer_matrices(attentions, residual, owner="attention_flow")
    n_layers, batch, n, _ = mats.shape
    out = np.zeros((batch, n, n))
    for b in range(batch):
        graph = nx.DiGraph()
        for layer in range(1, n_layers + 1):
            weights = mats[layer - 1, b]
            for i in range(n):
                for j in range(n):
                    if weights[i, j] > 0:
                        graph.add_edge((layer, i), (layer - 1, j), capacity=float(weights[i, j]))
        for i in range(n):
            top = (n_layers, i)
            for j in range(n):
                if graph.has_node(top) and graph.has_node((0, j)):
                    out[b, i, j] = nx.maximum_flow_value(graph, top, (0, j))
            total = out[b, i].sum()
            if total > 0:
                out[b, i] /= total
            if progress is not None:
                progress(b * n + i + 1, batch * n)
    return torch.from_numpy(out).to(attentions[0].dtype)
