"""Where one decoding step of packed SmolLM2-135M-Instruct (Q4_1) spends its time, against
what the memory allows, with eager steps and with the C stack (``accel.PackedStack``), on the
float32 path of the packed products (``prepare(model, "decoding", exact=True)``).

- the step: median seconds per token over 48 greedy tokens after a 12-token prompt, eager
  (``packed_steps(False)``) and through the C step, alternating, three times each;
- the packed products: the time spent inside ``PackedLinear`` in those steps (the kernel, and
  the few tensor operations around each call);
- the rest: norms, RoPE, attention, the KV cache, residual adds, module calls: counted as the
  number of tensor operations (ATen calls, nested ones included, as torch.profiler lists them)
  one step makes;
- the kernel alone: the C kernel called directly on every layer's blocks, one after the other
  as in a step, without the Python around it;
- the C step's parts: the stack's call alone (30 layers and the final norm), and the rest (the
  token's embedding and the output layer in PyTorch);
- the floor: the bytes of weights one token reads (every block once), divided by the read
  bandwidth measured here (summing a 512 MB tensor on the same threads).

    python bench/gguf_profile.py [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import attnkit as ak
from attnkit.accel import native, packed, packed_steps
from attnkit.generation import lm_step
from attnkit.interop import load_tokenizer_for
from common import cpu_description
from gguf_speed import PROMPT, model_path


def read_bandwidth() -> float:
    data = torch.ones(128 * 2**20)  # 512 MB
    data.sum()
    start = time.perf_counter()
    for _ in range(5):
        data.sum()
    return 5 * data.numel() * 4 / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_description()}; {args.threads} threads; {model_path().name}")
    model = ak.from_pretrained(model_path(), dequantize=False)
    model = ak.accel.prepare(model, "decoding", exact=True).model
    ids = torch.tensor([load_tokenizer_for(model_path()).encode(PROMPT)])
    layers = [m for m in model.modules() if isinstance(m, packed.PackedLinear)]
    weight_bytes = sum(m.blocks.numel() for m in layers)

    inside, started = [0.0], [0.0]

    def timing(on: bool) -> list:
        """Forward hooks on every packed layer that add its time to inside[0] (on), or none."""
        if not on:
            return []
        before = [
            m.register_forward_pre_hook(lambda *_: started.__setitem__(0, time.perf_counter()))
            for m in layers
        ]
        after = [
            m.register_forward_hook(
                lambda *_: inside.__setitem__(0, inside[0] + time.perf_counter() - started[0])
            )
            for m in layers
        ]
        return before + after

    model.generate(ids, 4, do_sample=False)  # warm-up: the kernel is built and loaded
    steps, products, c_steps = [], [], []
    stamps: list[float] = []

    def step_time() -> float:
        stamps.clear()
        model.generate(
            ids, 49, do_sample=False, on_token=lambda t: stamps.append(time.perf_counter())
        )
        return (stamps[-1] - stamps[0]) / 48

    for _ in range(3):
        with packed_steps(False):
            hooks = timing(True)
            try:
                model.generate(ids, 2, do_sample=False)
                inside[0] = 0.0
                steps.append(step_time())
                products.append(inside[0] / 49)  # the prompt's products are a small share
            finally:
                for hook in hooks:
                    hook.remove()
        c_steps.append(step_time())
    prompted = model.new_cache(1, 64)
    with torch.no_grad():
        lm_step(model, ids, None, prompted)
        x, position = torch.randn(1, 1, model.cfg.d_model), torch.tensor([prompted.length])
        calls = []
        for _ in range(20):  # the same position each time, on a copy of the prompt's cache
            cache = copy.deepcopy(prompted)
            start = time.perf_counter()
            model.decoder(x, positions=position, cache=cache)
            calls.append(time.perf_counter() - start)

    # the operators of one eager one-token step after the prompt (as generate runs it with
    # packed_steps(False)), counted by torch.profiler around that call alone
    counts, cache = [], model.new_cache(1, 64)
    with torch.no_grad(), packed_steps(False):
        token = lm_step(model, ids, None, cache).argmax(-1, keepdim=True)
        with torch.profiler.profile() as prof:
            lm_step(model, token, None, cache)
    counts.append(sum(event.name.startswith("aten::") for event in prof.events()))

    kernel, codes = native.library(), packed.KIND_CODES
    rows = {m.in_features: torch.randn(m.in_features) for m in layers}
    outs = [torch.empty(m.out_features) for m in layers]
    alone = []
    for _ in range(5):
        start = time.perf_counter()
        for m, out in zip(layers, outs, strict=True):
            x = rows[m.in_features]
            kernel.packed_matmul(
                codes[m.kind], m.blocks.data_ptr(), x.data_ptr(), out.data_ptr(), 1,
                m.out_features, m.in_features, args.threads,
            )  # fmt: skip
        alone.append(time.perf_counter() - start)
    bandwidth = read_bandwidth()
    step, product = statistics.median(steps), statistics.median(products)
    mb = weight_bytes / 1e6
    c_step, layer_calls = statistics.median(c_steps), statistics.median(calls)
    print(f"eager decoding step  {step * 1e3:7.1f} ms  ({1 / step:.1f} tokens/s)")
    print(f"  packed products    {product * 1e3:7.1f} ms  ({len(layers)} layers, {mb:.1f} MB)")
    print(f"  everything else    {(step - product) * 1e3:7.1f} ms  ({counts[0]} tensor operations)")
    print(f"C decoding step      {c_step * 1e3:7.1f} ms  ({1 / c_step:.1f} tokens/s)")
    print(f"  the stack's call   {layer_calls * 1e3:7.1f} ms  ({len(model.decoder.layers)} layers)")
    print(f"  everything else    {(c_step - layer_calls) * 1e3:7.1f} ms  (embedding, norm, output)")
    kernel_alone = statistics.median(alone)
    print(f"the kernel alone     {kernel_alone * 1e3:7.1f} ms  (every product, a call each)")
    print(f"read bandwidth       {bandwidth / 1e9:7.1f} GB/s (summing 512 MB)")
    floor = weight_bytes / bandwidth
    print(f"floor: the blocks    {floor * 1e3:7.1f} ms per token ({1 / floor:.0f} tokens/s)")


if __name__ == "__main__":
    main()
