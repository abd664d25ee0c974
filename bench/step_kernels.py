"""The two C kernels of a training step against the torch operators they replace, alone.

- attention, forward and backward (``accel.attention.attention``, ``attention.c``) against torch's
  CPU flash attention (``F.scaled_dot_product_attention``), at lm-small's shape (batch 8, 8
  heads, 256 positions, d 32, causal) and mt-small's (batch 32, 8 heads, 64 positions, d 32, a
  key-padding mask), with the heads laid out as the layers make them;
- the fused LM-head loss (``linear_cross_entropy``, forward and backward, 2,048 tokens, V = 8192,
  d 256) with its row kernel (``lm_loss.c``) and with torch's operators (``loss_kernels(False)``).

Each in float32 and bf16; the two sides alternate call by call and each figure is the median.
The bf16 loss is skipped where torch has no fast bf16 products (``accel.bf16_products_fast()``:
an AVX2-only CPU), since both sides' products would run at a scalar loop's speed.
Where bf16 attention runs on AMX tiles (``accel.tiles_available()``), its two shapes are also
timed against the same kernel in float32 arithmetic (``attention_tiles(False)``).

    python bench/step_kernels.py [--repeats 15] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from attnkit.accel import (
    attention_kernel,
    attention_tiles,
    bf16_products_fast,
    linear_cross_entropy,
    loss_kernels,
    tiles_available,
)
from attnkit.accel.attention import attention
from common import cpu_description

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def attention_case(b, h, n, d, dtype, padded):
    """A forward and backward of causal (or key-padded) attention over heads laid out as the
    layers make them: (B, N, 3 H d) split and transposed."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, n, 3 * h * d, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(b, n, h * d, generator=g).to(dtype)
    mask = None
    if padded:
        lengths = torch.randint(n * 8 // 10, n + 1, (b, 1), generator=g)
        mask = (torch.arange(n) < lengths).view(b, 1, 1, n)

    def run() -> None:
        q, k, v = (t.view(b, n, h, d).transpose(1, 2) for t in x.split(h * d, -1))
        out = attention(q, k, v, attn_mask=mask, is_causal=not padded)
        out.transpose(1, 2).reshape(b, n, h * d).backward(grad)
        x.grad = None

    return run


def loss_case(dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2048, 256, generator=g).requires_grad_()
    weight = (torch.randn(8192, 256, generator=g) * 0.06).requires_grad_()
    targets = torch.randint(0, 8192, (2048,), generator=g)

    def run() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = linear_cross_entropy(hidden, weight, targets)
        loss.backward()
        hidden.grad = weight.grad = None

    return run


def compare(run, switch, repeats: int) -> tuple[float, float]:
    """Median ms of ``run`` with the switch off (torch) and on (the C kernel), alternating."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(2 + repeats):
        for on in (False, True):
            with switch(on):
                start = time.perf_counter()
                run()
                if round_ >= 2:
                    times[on].append(time.perf_counter() - start)
    return statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per side")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_description()}; {args.threads} threads; forward + backward, median ms")
    print(f"  {'':<52} {'torch':>8} {'C kernel':>9} {'speed-up':>9}")
    cases = [
        ("attention, lm-small (8 x 8 heads x 256, d 32, causal)", (8, 8, 256, 32), False),
        ("attention, mt-small (32 x 8 heads x 64, d 32, padded)", (32, 8, 64, 32), True),
    ]
    for precision, dtype in DTYPES.items():
        for name, shape, padded in cases:
            run = attention_case(*shape, dtype, padded)
            torch_ms, c_ms = compare(run, attention_kernel, args.repeats)
            label = f"{name} {precision}"
            print(f"  {label:<52} {torch_ms:8.2f} {c_ms:9.2f} {torch_ms / c_ms:8.2f}x")
        label = f"LM-head loss (2,048 x 256 -> 8,192) {precision}"
        if dtype == torch.bfloat16 and not bf16_products_fast():
            # both sides' products are bf16: at a scalar loop's speed, minutes a call
            print(f"  {label:<52} skipped: torch has no fast bf16 products on this CPU")
            continue
        torch_ms, c_ms = compare(loss_case(dtype), loss_kernels, args.repeats)
        print(f"  {label:<52} {torch_ms:8.2f} {c_ms:9.2f} {torch_ms / c_ms:8.2f}x")
    if tiles_available():
        print(f"  {'bf16 attention on AMX tiles':<52} {'float32':>8} {'tiles':>9} {'speed-up':>9}")
        for name, shape, padded in cases:
            run = attention_case(*shape, torch.bfloat16, padded)
            plain_ms, tiles_ms = compare(run, attention_tiles, args.repeats)
            print(f"  {name:<52} {plain_ms:8.2f} {tiles_ms:9.2f} {plain_ms / tiles_ms:8.2f}x")


if __name__ == "__main__":
    main()
