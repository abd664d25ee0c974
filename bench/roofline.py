"""How close decoding and prompts come to what this machine allows: its read bandwidth and its
integer product peak, measured here, and each shipped model's speed as a share of its limit.

A decoding step multiplies one row by every weight, so it cannot run faster than the weights'
bytes can be read: the limit is (bytes read per token) / (read bandwidth), for the bytes the
kernels read (the integer path's tiles: Q4_K and Q6_K repacked with float32 scales are larger
than the file's blocks) and for the file's own bytes (what a kernel reading the file's blocks as
they are would read). A prompt multiplies
many rows by the same weights, so its limit is the integer units' peak: 2 x weights operations
per token (a multiply and an add) at the int8 peak. Measured here:

- read bandwidth: a float32 tensor far larger than the caches (256 MiB), and one that fits in
  them (1 MiB, read again and again), read by torch's threads: the fastest of a sum and MKL's
  two matrix-vector products (a sum alone reads about 25% slower than a GEMV on the Xeon the
  project measured);
- int8 and bf16 product peaks: torch's own ``_int_mm`` (int8 x int8 -> int32) and bf16 matmul
  on 2048 x 2048 matrices (oneDNN's kernels: AMX tiles where the CPU has them);
- SmolLM2-135M (Q4_1) and Gemma 3 270M (Q4_K_M), packed and prepared as ``from_pretrained``
  gives them (the integer path, the C stack): decode tokens/s after a short prompt, and a
  256-token prompt's tokens/s (the logits of its last position, as ``generate``'s first step).

Prints the table and saves the shares (``python bench/report.py --record`` writes them into
docs/PERFORMANCE.md, one table per CPU).

    python bench/roofline.py [--threads 2] [--tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import cpu_description, save_results

PROMPT = "The animal didn't cross the street because it was too tired. "


def best_time(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def read_bandwidth(mib: int) -> float:
    """Bytes read per second from ``mib`` MiB of float32: the best of three readers, a sum and
    MKL's two matrix-vector products (x W and W x, W 2048 wide), each the best of several."""
    x = torch.ones(mib << 18)
    w, v = x.view(-1, 2048), torch.ones(2048)
    wt = x.view(2048, -1)
    repeats = max(8, 2048 // mib)
    readers = (lambda: x.sum(), lambda: torch.mv(w, v), lambda: v @ wt)
    return x.nbytes / min(best_time(read, repeats) for read in readers)


def product_peaks(n: int = 2048) -> dict[str, float]:
    """Operations per second of torch's int8 and bf16 products, n x n x n (best of 5)."""
    a8, b8 = (torch.randint(-128, 128, (n, n), dtype=torch.int8) for _ in range(2))
    a16, b16 = (torch.randn(n, n, dtype=torch.bfloat16) for _ in range(2))
    ops = 2 * n**3
    return {"int8": ops / best_time(lambda: torch._int_mm(a8, b8), 5),
            "bf16": ops / best_time(lambda: a16 @ b16, 5)}  # fmt: skip


def weights_read(model) -> tuple[int, int]:
    """(bytes a decoding step reads, weights of the decoder stack's products): every packed
    layer's tiles (the integer path's weights) or float32 weights, and the float32 norms."""
    from attnkit import accel

    total, weights = 0, 0
    for name, module in model.named_modules():
        if isinstance(module, accel.PackedLinear):
            stored = module.tiles if module.integer else module.blocks
            total += stored.nbytes
            if not name.startswith("lm_head"):
                weights += module.in_features * module.out_features
    total += sum(p.nbytes for p in model.decoder.parameters() if p.dtype == torch.float32)
    return total, weights


def model_speed(name: str, tokens: int) -> dict:
    import attnkit as ak
    from attnkit.interop import load_tokenizer_for

    model = ak.from_pretrained(name, dequantize=False)
    tokenizer = load_tokenizer_for(name)
    short = torch.tensor([tokenizer.encode(PROMPT)])
    long = torch.tensor([(tokenizer.encode(PROMPT * 40))[:256]])
    rates = []
    model.generate(short, 4)  # warm-up
    for _ in range(3):
        stamps: list[float] = []
        model.generate(
            short, tokens + 1, on_token=lambda t, s=stamps: s.append(time.perf_counter())
        )
        rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))

    def prefill():
        with torch.no_grad():
            model.lm_head(model.hidden_states(long)[0][:, -1])

    prompt = 256 / best_time(prefill, 3)
    read, weights = weights_read(model)
    from pathlib import Path

    from attnkit.interop.pretrained import shipped

    file_bytes = shipped(Path(name)).stat().st_size
    head = model.lm_head.in_features * model.lm_head.out_features
    return {"decode": statistics.median(rates), "prompt": prompt, "bytes_per_token": read,
            "ops_per_prompt_token": 2 * weights, "head_ops": 2 * head,
            "file_bytes": file_bytes}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="decoded tokens per round")
    parser.add_argument("--model", nargs="+", default=["smollm2", "gemma3"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{cpu_description()}, {args.threads} threads")
    bandwidth = {"256 MiB": read_bandwidth(256), "1 MiB": read_bandwidth(1)}
    peaks = product_peaks()
    print(f"read bandwidth: {bandwidth['256 MiB'] / 1e9:.1f} GB/s beyond the caches, "
          f"{bandwidth['1 MiB'] / 1e9:.1f} GB/s within them")  # fmt: skip
    print(f"torch's products: int8 {peaks['int8'] / 1e12:.2f} TOPS, "
          f"bf16 {peaks['bf16'] / 1e12:.2f} TFLOPS\n")  # fmt: skip
    figures: dict = {"bandwidth": bandwidth, "peaks": peaks, "models": {}, "ratios": {}}
    print("| model | decode tokens/s | floor (bytes read) | share | floor (file's bytes) | share "
          "| prompt tokens/s | ceiling (int8 peak) | share |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.model:
        speed = model_speed(name, args.tokens)
        floor = bandwidth["256 MiB"] / speed["bytes_per_token"]
        ceiling = peaks["int8"] / speed["ops_per_prompt_token"]
        file_floor = bandwidth["256 MiB"] / speed["file_bytes"]
        decode_share, prompt_share = speed["decode"] / floor, speed["prompt"] / ceiling
        print(f"| {name} | {speed['decode']:.1f} | {floor:.1f} | {decode_share:.0%} | "
              f"{file_floor:.1f} | {speed['decode'] / file_floor:.0%} | "
              f"{speed['prompt']:.0f} | {ceiling:.0f} | {prompt_share:.1%} |")  # fmt: skip
        figures["models"][name] = {**speed, "decode_floor": floor, "prompt_ceiling": ceiling}
        figures["ratios"][f"{name} decode: share of the read bandwidth"] = decode_share
        figures["ratios"][f"{name} decode: share of the file's floor"] = (
            speed["decode"] / file_floor
        )
        figures["ratios"][f"{name} prompt: share of the int8 peak"] = prompt_share
    print(f"\nsaved {save_results('roofline', figures)}")


if __name__ == "__main__":
    main()
