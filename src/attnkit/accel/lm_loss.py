"""The output layer and its loss in one pass: no (tokens x vocabulary) logits tensor.

``linear_cross_entropy(hidden, weight, targets)`` is ``F.cross_entropy(hidden @ weight.T,
targets)`` computed in chunks of rows; ``fuse_lm_loss(model)`` makes a model's ``lm_head.loss``
(``layers.LMHead``) use it. Same value, same gradients (tested); the speed-up is measured in
bench/README.md.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from attnkit.accel.onednn import linear, mm_t
from attnkit.layers import LMHead

__all__ = ["FusedLMHead", "fuse_lm_loss", "linear_cross_entropy"]


def _chunk_rows(vocab_size: int) -> int:
    """Rows per chunk: about 16 MiB of float32 logits, which stay in the last-level cache, in
    few enough chunks that the per-chunk operations cost little (512 rows for V = 8192)."""
    return max(64, min(2048, (1 << 22) // vocab_size))


def _loss_and_grads(hidden, weight, targets, ignore_index, smoothing, with_grads):
    """The chunked loop behind :func:`linear_cross_entropy`: (loss, dL/dhidden, dL/dweight).

    Per chunk only the big operations run (three products, the max, the softmax, the in-place
    gradient); everything per row is gathered into (T, 1) columns and finished after the loop,
    so that few small serial operations sit between the parallel ones.
    """
    device = hidden.device
    autocast = torch.is_autocast_enabled(device.type)
    dtype = torch.get_autocast_dtype(device.type) if autocast else hidden.dtype
    h_all, w = hidden.to(dtype), weight.to(dtype)  # the dtype autocast would give the product
    n, vocab = hidden.shape[0], weight.shape[0]
    real = (targets != ignore_index)[:, None]  # (T, 1)
    safe = torch.where(real, targets[:, None], 0)  # (T, 1): an ignored id may be anything
    row_weight = real / real.sum().clamp(min=1)  # (T, 1): 1 / count on the counted rows, else 0
    top = torch.empty(n, 1, device=device)  # the row's max logit
    top_id = torch.empty(n, 1, dtype=torch.long, device=device)
    z_target = torch.empty(n, 1, device=device)  # the target's logit
    p_top = torch.empty(n, 1, device=device)  # softmax at the max: >= 1 / V, never underflows
    z_mean = torch.empty(n, 1, device=device) if smoothing else None
    grad_h_chunks, grad_w_t = [], None  # dL/dhidden per chunk; dL/dW^T (D, V) summed
    step = _chunk_rows(vocab)
    probs_buffer = torch.empty(min(step, n), vocab, device=device)
    with torch.autocast(device.type, enabled=False):
        for start in range(0, n, step):
            rows = slice(start, start + step)
            h = h_all[rows]
            logits = mm_t(h, w).float()  # (c, V): the only logits that ever exist
            torch.max(logits, dim=-1, keepdim=True, out=(top[rows], top_id[rows]))
            torch.gather(logits, 1, safe[rows], out=z_target[rows])
            if smoothing:
                torch.mean(logits, dim=-1, keepdim=True, out=z_mean[rows])
            # torch's fused row-wise softmax: max, exp-sum and scale while a row sits in L1
            probs = torch.softmax(logits, dim=-1, out=probs_buffer[: h.shape[0]])
            torch.gather(probs, 1, top_id[rows], out=p_top[rows])
            if not with_grads:
                continue
            # dL/dlogits = (softmax - (1 - eps) onehot - eps / V) * real / count, in place
            g = probs.mul_(row_weight[rows])
            g.scatter_add_(1, safe[rows], row_weight[rows] * (smoothing - 1))
            if smoothing:
                g.sub_(row_weight[rows] * (smoothing / vocab))
            g = g.to(dtype)
            grad_h_chunks.append(mm_t(g, w.t()))  # (c, D)
            part = mm_t(h.t(), g.t()).float()  # (D, V) = h^T g
            grad_w_t = part if grad_w_t is None else grad_w_t.add_(part)
    lse = top - p_top.log()  # logsumexp of each row's logits
    loss = lse - z_target  # -log p(y)
    if smoothing:  # eps times the cross-entropy against the uniform distribution
        loss = (1 - smoothing) * loss + smoothing * (lse - z_mean)
    loss = (loss * row_weight).sum()
    if not with_grads:
        return loss, None, None
    grad_h = torch.cat(grad_h_chunks).to(hidden.dtype)
    grad_w = grad_w_t.t().to(weight.dtype)
    return loss, grad_h, grad_w


class _LinearCrossEntropy(torch.autograd.Function):
    """The loss and both gradients come out of one forward pass (the chunk's logits are still
    in the cache when their gradient is formed); backward only scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, smoothing):
        loss, grad_h, grad_w = _loss_and_grads(
            hidden, weight, targets, ignore_index, smoothing, with_grads=True
        )
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss, grad_w * grad_loss, None, None, None


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    ignore_index: int = -100,
    smoothing: float = 0.0,
) -> Tensor:
    r"""Mean cross-entropy of the output layer ``logits = hidden @ weight^T`` against
    ``targets``, without ever holding the (tokens x V) logits::

        loss = mean over tokens with target != ignore_index of
               (1 - eps) (logsumexp(z) - z_y) + eps (logsumexp(z) - mean_k z_k)

    the same value as ``F.cross_entropy(hidden @ weight.T, targets, ignore_index=...,
    label_smoothing=eps)`` (tested). hidden (..., D), weight (V, D), targets (...) ids.

    The tokens go through in chunks of a few hundred rows; for each chunk the logits, their
    log-sum-exp and, while they are still in the cache, the gradient
    ``(softmax - target distribution) / count`` and its two products (dL/dhidden, dL/dW) are
    formed. Against logits + ``F.cross_entropy`` this saves writing and re-reading the full
    logits, their log-softmax, the zero-filled gradient and its log-softmax backward: four or
    five passes over tokens x V floats (64 MiB per pass for lm-small). The products run in the
    autocast dtype when autocast is on; the softmax always in float32.
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"linear_cross_entropy: targets must have shape hidden.shape[:-1] = "
            f"{tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"linear_cross_entropy: weight must have shape (V, D={hidden.shape[-1]}), "
            f"got {tuple(weight.shape)}"
        )
    if targets.is_floating_point() or targets.dtype == torch.bool:
        raise TypeError(f"linear_cross_entropy: targets must hold token ids, got {targets.dtype}")
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"linear_cross_entropy: smoothing must be in [0, 1), got {smoothing!r}")
    hidden2 = hidden.reshape(-1, hidden.shape[-1])  # (T, D)
    flat = targets.reshape(-1)  # (T,)
    real = flat[flat != ignore_index]
    if real.numel() and (int(real.min()) < 0 or int(real.max()) >= weight.shape[0]):
        bad = int(real.min()) if int(real.min()) < 0 else int(real.max())
        raise ValueError(f"linear_cross_entropy: target id {bad} is outside [0, {weight.shape[0]})")
    if hidden2.shape[0] == 0:  # no tokens: a zero loss, still attached to the graph
        return (hidden2.sum() + weight.sum()) * 0.0
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden2, weight, flat, ignore_index, float(smoothing))
    loss, _, _ = _loss_and_grads(hidden2, weight, flat, ignore_index, smoothing, False)
    return loss


class FusedLMHead(LMHead):
    """An ``LMHead`` whose ``loss`` is :func:`linear_cross_entropy` (same parameters, same
    state-dict names) and whose logits go through :func:`attnkit.accel.onednn.linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)

    def loss(self, hidden, targets, *, ignore_index: int = -100, smoothing: float = 0.0):
        return linear_cross_entropy(
            hidden, self.weight, targets, ignore_index=ignore_index, smoothing=smoothing
        )


def fuse_lm_loss(model: nn.Module) -> nn.Module:
    """Give every ``LMHead`` of ``model`` the fused loss (in place); returns the model."""
    for module in model.modules():
        if type(module) is LMHead:
            module.__class__ = FusedLMHead
    return model
