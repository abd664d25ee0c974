"""The output layer and its loss in one pass: no (tokens x vocabulary) logits tensor.

``linear_cross_entropy(hidden, weight, targets)`` is ``F.cross_entropy(hidden @ weight.T,
targets)`` computed in chunks of rows; ``fuse_lm_loss(model)`` makes a model's ``lm_head.loss``
(``layers.LMHead``) use it. Same value, same gradients (tested); the speed-up is measured in
bench/history/.

Each chunk's row-wise work (log-sum-exp, the target's logit, the gradient written over the
logits) is one call of a small C kernel, ``lm_loss.c``, built at install
(:mod:`attnkit.accel.native`): three passes over each row while it sits in the cache, in the
logits' own dtype, where torch's operators take six to eight passes and, under bf16 autocast,
two casts of the chunk. Without the kernels (or with ``loss_kernels(False)``,
``ATTNKIT_LOSS_KERNEL=0``) torch's operators do the same work.

Where torch's own product forms the logits (float32 without oneDNN, bf16), each chunk's logits
are written into one scratch tensor that the calling thread keeps for its next call (one per
dtype, 32 MiB or more on the CPU): fresh memory of that size costs thousands of page faults.
"""

from __future__ import annotations

import threading
from functools import cache
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.profiler import record_function

from attnkit.accel import native
from attnkit.accel.onednn import linear, mm_t, use_onednn
from attnkit.accel.swap import rebuilt, swap_modules
from attnkit.accel.switch import Switch
from attnkit.layers import LMHead

__all__ = ["FusedLMHead", "fuse_lm_loss", "linear_cross_entropy", "loss_kernels"]

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# loss_kernels(False) holds the lever off inside a with block (ATTNKIT_LOSS_KERNEL=0: off)
loss_kernels = _switch = Switch("ATTNKIT_LOSS_KERNEL")


@cache
def _last_level_cache() -> int:
    """The size in bytes of the processor's last-level cache (Linux's sysfs), or 0."""
    sizes = {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip()
            sizes[level] = int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]]
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return sizes[max(sizes)] if sizes else 0


def _chunk_rows(vocab_size: int) -> int:
    """Rows per chunk: float32 logits of 32 MiB, or of half the last-level cache where that is
    more, in a power of two of rows (1,024 for V = 8192, under a 32 MiB L3 and under the 105
    MiB of the Xeon in bench/history/): few enough chunks that the per-chunk work costs little,
    and a longer inner dimension for dL/dW's products. 16 MiB (512 rows) made a whole lm-small
    step 2-8% slower on the Xeon, and 3-4% slower on a Zen 3, whose 32 MiB L3 held them."""
    values = max(1 << 23, _last_level_cache() // 8)  # float32 values in 32 MiB, or LLC / 2
    rows = max(64, min(2048, values // vocab_size))
    return 1 << (rows.bit_length() - 1)


def _rows_c(logits, targets, weights, smoothing, with_grads, lse, z_target, z_mean) -> bool:
    """The row-wise work of a chunk by ``lm_loss.c`` (see its header), the gradient written
    over ``logits``; False (nothing done) where the kernel does not apply."""
    kernel = native.library() if _switch.on else None
    if (
        kernel is None
        or logits.device.type != "cpu"
        or logits.dtype not in _DTYPE_CODES
        or not logits.is_contiguous()
        or torch.compiler.is_compiling()
    ):
        return False
    with record_function("attnkit::lm_loss_rows"):  # named in torch.profiler's tables
        status = kernel.lm_loss_rows(
            _DTYPE_CODES[logits.dtype], logits.data_ptr(), logits.shape[0], logits.shape[1],
            targets.data_ptr(), weights.data_ptr(), smoothing, int(with_grads), lse.data_ptr(),
            z_target.data_ptr(), None if z_mean is None else z_mean.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
    if status == -2:
        raise MemoryError(f"lm_loss_rows: no memory for a row of {logits.shape[1]} floats")
    if status != 0:
        raise RuntimeError("lm_loss_rows: a target id outside the vocabulary")
    return True


def _add_transposed(total: Tensor | None, part: Tensor) -> Tensor:
    """total + part^T (a new tensor where total is None), summed in float32 or wider: a chunk's
    (D, V) part of dL/dW added to the (V, D) sum. By ``lm_loss.c`` on the CPU (torch's add of
    a transposed view runs ten times slower), else by torch."""
    wide = torch.promote_types(part.dtype, torch.float32) if total is None else total.dtype
    kernel = native.library() if _switch.on else None
    if (
        kernel is None
        or part.device.type != "cpu"
        or part.dtype not in _DTYPE_CODES
        or wide != torch.float32
        or not part.is_contiguous()
        or torch.compiler.is_compiling()
    ):
        if total is None:  # a new tensor: part may be scratch memory (_scratch)
            return part.new_empty(part.shape[::-1], dtype=wide).copy_(part.t())
        return total.add_(part.t())
    add = total is not None
    if total is None:
        total = part.new_empty(part.shape[::-1], dtype=torch.float32)
    rows, cols = total.shape
    kernel.transpose_add(
        total.data_ptr(), part.data_ptr(), _DTYPE_CODES[part.dtype], rows, cols, int(add),
        torch.get_num_threads(),
    )  # fmt: skip
    return total


def _rows_torch(logits, targets, weights, smoothing, with_grads, lse, z_target, z_mean):
    """The same with torch's operators: the chunk's gradient, in float32."""
    logits = logits.float()
    top, top_id = logits.max(dim=-1, keepdim=True)
    torch.gather(logits, 1, targets, out=z_target)
    if z_mean is not None:
        torch.mean(logits, dim=-1, keepdim=True, out=z_mean)
    # torch's fused row-wise softmax: max, exp-sum and scale while a row sits in L1
    probs = torch.softmax(logits, dim=-1)
    torch.sub(top, probs.gather(1, top_id).log(), out=lse)  # p at the max never underflows
    if not with_grads:
        return None
    # dL/dlogits = (softmax - (1 - eps) onehot - eps / V) * weight, in place
    g = probs.mul_(weights)
    g.scatter_add_(1, targets, weights * (smoothing - 1))
    if smoothing:
        g.sub_(weights * (smoothing / logits.shape[1]))
    return g


_kept = threading.local()  # per thread: (use, dtype) -> a CPU scratch tensor


def _scratch(
    shape: tuple[int, int], dtype: torch.dtype, device: torch.device, use: str = "logits"
) -> Tensor:
    """An uninitialised tensor of ``shape`` for one chunk's logits (``use="logits"``) or for
    a chunk's bf16 part of dL/dW^T (``"part"``), which never leave :func:`_chunked`. On the
    CPU the same memory serves every call of this thread (one tensor per use and dtype, as
    large as the largest asked for: 4-64 MiB for lm-small), so that these never land on fresh
    pages (thousands of page faults each, about 1.5 us apiece on the Xeon in
    bench/history/); elsewhere a new tensor (the device's own allocator keeps freed
    blocks)."""
    numel = shape[0] * shape[1]
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    kept = _kept.__dict__.setdefault("tensors", {})
    tensor = kept.get((use, dtype))
    if tensor is None or tensor.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor, writable in and out of the mode
            tensor = kept[use, dtype] = torch.empty(numel, dtype=dtype, device=device)
    return tensor[:numel].view(shape)


def _loss_and_grads(hidden, weight, targets, ignore_index, smoothing, with_grads):
    """(loss, dL/dhidden, dL/dweight) over the rows whose target counts: an ignored row adds
    nothing to the loss and zero to both gradients, so its products are skipped (a batch of
    sentences padded to one length has many; its rows of dL/dhidden are zeros)."""
    kept = targets != ignore_index  # (T,)
    # (on the CPU only: elsewhere the check would wait for the device)
    if hidden.device.type != "cpu" or torch.compiler.is_compiling() or bool(kept.all()):
        return _chunked(hidden, weight, targets, ignore_index, smoothing, with_grads)
    rows = kept.nonzero().squeeze(1)  # (T_real,)
    loss, grad_h, grad_w = _chunked(
        hidden[rows], weight, targets[rows], ignore_index, smoothing, with_grads
    )
    if with_grads:
        grad_h = hidden.new_zeros(hidden.shape).index_copy_(0, rows, grad_h)
    return loss, grad_h, grad_w


def _chunked(hidden, weight, targets, ignore_index, smoothing, with_grads):
    """The chunked loop behind :func:`linear_cross_entropy`: (loss, dL/dhidden, dL/dweight).

    Per chunk only the big operations run: the logits' product, the row-wise work (the C
    kernel, or torch's operators) and the gradient's two products; everything per row is
    gathered into (T, 1) columns and finished after the loop.
    """
    device = hidden.device
    autocast = torch.is_autocast_enabled(device.type)
    dtype = torch.get_autocast_dtype(device.type) if autocast else hidden.dtype
    h_all, w = hidden.to(dtype), weight.to(dtype)  # the dtype autocast would give the product
    n = hidden.shape[0]
    real = (targets != ignore_index)[:, None]  # (T, 1)
    safe = torch.where(real, targets[:, None], 0).long()  # (T, 1): ignored ids become 0
    row_weight = (real / real.sum().clamp(min=1)).float()  # (T, 1): 1 / count, or 0 if ignored
    lse = torch.empty(n, 1, device=device)  # each row's log-sum-exp
    z_target = torch.empty(n, 1, device=device)  # the target's logit
    z_mean = torch.empty(n, 1, device=device) if smoothing else None
    grad_h_chunks, grad_w = [], None  # dL/dhidden per chunk; dL/dW summed in float32
    grad_wt = None  # oneDNN: dL/dW^T (D, V), summed over the chunks
    step = _chunk_rows(weight.shape[0])
    with torch.autocast(device.type, enabled=False):
        # Whether oneDNN forms the products (float32 only). dL/dW's layout: oneDNN runs the
        # product as (D, V) = h^T g a third faster than as (V, D) = g^T h, so that sum is
        # turned to W's own layout once at the end; bf16 products too run (D, V) faster
        # (a chunk's whole loss and gradients 1.08x), and each chunk's part is added, turned,
        # to a float32 (V, D) sum (_add_transposed: torch's add of a transposed view is ten
        # times slower); torch's float32 GEMM (MKL) gains nothing from it (0.98x), so it runs
        # (V, D) and adds each chunk inside the product (addmm_). bench/history/ has the
        # figures.
        onednn = use_onednn(h_all, w, None)
        # Where torch's product forms them, every chunk's logits go into one scratch tensor,
        # kept between calls on the CPU: a fresh 16 MiB tensor was fresh pages from the kernel
        # (glibc returns freed blocks this large), 4,096 page faults for lm-small's float32
        # logits, each chunk of each step
        buffer = None
        if not (onednn or torch.compiler.is_compiling()):
            buffer = _scratch((min(step, n), weight.shape[0]), dtype, device)
        for start in range(0, n, step):
            rows = slice(start, start + step)
            h = h_all[rows]
            out = None if buffer is None else buffer[: h.shape[0]]
            logits = mm_t(h, w, out=out)  # (c, V): the only logits that ever exist
            columns = (lse[rows], z_target[rows], None if z_mean is None else z_mean[rows])
            parts = (logits, safe[rows], row_weight[rows], smoothing, with_grads, *columns)
            g = logits if _rows_c(*parts) else _rows_torch(*parts)
            if not with_grads:
                continue
            g = g.to(dtype)
            grad_h_chunks.append(mm_t(g, w.t()))  # (c, D)
            if onednn:  # dL/dW^T = h^T g, (D, V), summed over the chunks
                part = mm_t(h.t(), g.t())
                grad_wt = part if grad_wt is None else grad_wt.add_(part)
            elif dtype.itemsize >= 4:  # (V, D) = g^T h, summed by the product itself
                grad_w = g.t() @ h if grad_w is None else grad_w.addmm_(g.t(), h)
            else:  # bf16: each chunk's (D, V) part added, turned, to the float32 (V, D) sum
                out = (
                    None
                    if torch.compiler.is_compiling()
                    else _scratch(w.shape[::-1], dtype, device, "part")
                )
                grad_w = _add_transposed(grad_w, torch.mm(h.t().contiguous(), g, out=out))
    loss = lse - z_target  # -log p(y)
    if smoothing:  # eps times the cross-entropy against the uniform distribution
        loss = (1 - smoothing) * loss + smoothing * (lse - z_mean)
    loss = (loss * row_weight).sum()
    if not with_grads:
        return loss, None, None
    if grad_wt is not None:  # to W's own layout (V, D)
        grad_w = _add_transposed(None, grad_wt)
    if grad_w is None:  # no rows at all
        return loss, torch.zeros_like(hidden), torch.zeros_like(weight)
    grad_h = torch.cat(grad_h_chunks).to(hidden.dtype)
    # in W's own layout (contiguous), a tied embedding's gradient adds to it in place and
    # autograd keeps it as .grad; a transposed view cost an add and a copy more
    grad_w = grad_w.to(weight.dtype)
    return loss, grad_h, grad_w


class _LinearCrossEntropy(torch.autograd.Function):
    """The loss and both gradients come out of one forward pass (the chunk's logits are still
    in the cache when their gradient is formed); backward only scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, smoothing):
        loss, grad_h, grad_w = _loss_and_grads(
            hidden, weight, targets, ignore_index, smoothing, with_grads=True
        )
        ctx.save_for_backward(grad_h, grad_w)  # released after backward (unless retain_graph)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        # a plain loss.backward() sends 1: hand the gradients on as they are (autograd then
        # keeps them as the .grad tensors) rather than multiply them into new ones
        if grad_loss.device.type != "cpu" or float(grad_loss) != 1.0:
            grad_h, grad_w = grad_h * grad_loss, grad_w * grad_loss
        return grad_h, grad_w, None, None, None


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
    autocast dtype when autocast is on (the gradient is rounded to it, as autocast's own
    backward rounds it); the softmax always in float32. Rows whose target is ``ignore_index``
    (a padded batch's padding) add nothing to the loss, so they skip the products too; their
    rows of dL/dhidden are zeros.
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

    @classmethod
    def from_head(cls, head: LMHead) -> FusedLMHead:
        """A new head holding ``head``'s weight and bias (the same tensors: a weight tied to
        the embedding stays tied)."""
        return rebuilt(cls, head)

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)

    def loss(self, hidden, targets, *, ignore_index: int = -100, smoothing: float = 0.0):
        return linear_cross_entropy(
            hidden, self.weight, targets, ignore_index=ignore_index, smoothing=smoothing
        )


def fuse_lm_loss(model: nn.Module) -> nn.Module:
    """Replace every ``LMHead`` of ``model`` by a :class:`FusedLMHead` over the same weights
    (:func:`~attnkit.accel.swap.swap_modules`); returns the model."""
    return swap_modules(model, lambda m: FusedLMHead.from_head(m) if type(m) is LMHead else None)
