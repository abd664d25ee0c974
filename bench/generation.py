"""Greedy generation speed: attnkit's DecoderLM with its KV cache against Hugging Face's
GPT2LMHeadModel.generate(use_cache=True), the same weights, in the same process.

The ``lm-small`` preset (vocab 8192, d_model 256, 8 heads, 4 layers, d_ff 1024, learned
positions, Pre-LN, GELU, tied), random weights, batch 1, a 32-token prompt, 256 new tokens.
Prints tokens/s for both, their ratio, and attnkit's milliseconds per token over tokens 1-64
against tokens 193-256 (a cache that grew by copying would make late tokens slower). attnkit
runs twice, prepared as ``attnkit generate`` prepares it (``accel.prepare(model, "decoding")``):
eager, and a copy prepared with ``compile=True`` (the decoding step through torch.compile; its
one-off compile time is printed and not in the timed rounds).

    python bench/generation.py [--new-tokens 256] [--repeats 3] [--threads 2] [--json out.json]
                               [--no-compile]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import time
from pathlib import Path

import torch
import transformers

import attnkit as ak
from attnkit import accel
from attnkit.interop import to_hf
from common import save_results


def build(seed: int = 0):
    """lm-small with random weights, and GPT-2 (sdpa attention) holding the same weights."""
    # max_len 512: the 32-token prompt plus 256 new tokens exceed lm-small's 256 positions
    cfg = ak.ModelConfig.preset("lm-small", max_len=512, eos_id=None, bos_id=None)
    torch.manual_seed(seed)
    ours = ak.DecoderLM(cfg).eval()
    hf_config, state = to_hf(ours)
    config = transformers.GPT2Config(**hf_config, attn_implementation="sdpa")
    ref = transformers.GPT2LMHeadModel(config).eval()
    ref.load_state_dict(state, strict=False)
    return ours, ref


def timed(run) -> tuple[list[int], list[float], float]:
    """Run ``run(stamp)`` once, where ``stamp()`` is called as each token is made; return the
    tokens, the time between successive tokens, and the total time."""
    stamps: list[float] = []
    start = time.perf_counter()
    tokens = run(lambda *_: stamps.append(time.perf_counter()))
    total = time.perf_counter() - start
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return tokens, gaps, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=32, help="prompt length")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--json", type=Path, default=Path("runs/bench/generation.json"),
        help="where to write the figures (default runs/bench/generation.json)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument(
        "--no-compile", action="store_true", help="leave out attnkit's compiled steps"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    ours, ref = build()
    fast = None if args.no_compile else copy.deepcopy(ours)
    print(accel.prepare(ours, "decoding").line())
    if fast is not None:
        accel.prepare(fast, "decoding", compile=True)
    prompt = torch.randint(0, 8192, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    new = args.new_tokens

    def run_ours(stamp):
        return ours.generate(prompt, new, on_token=stamp)[0, args.prompt :].tolist()

    def run_compiled(stamp):
        out = fast.generate(prompt, new, on_token=stamp)
        return out[0, args.prompt :].tolist()

    class Stamp(transformers.generation.streamers.BaseStreamer):
        """Hugging Face calls put() with the prompt, then with each new token."""

        def __init__(self, stamp):
            self.stamp = stamp

        def put(self, value):
            self.stamp()

        def end(self):
            pass

    def run_hf(stamp):
        with torch.no_grad():
            out = ref.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                use_cache=True,
                eos_token_id=None,
                pad_token_id=0,
                streamer=Stamp(stamp),
            )
        return out[0, args.prompt :].tolist()

    candidates = {"attnkit": run_ours, "hf": run_hf}
    if not args.no_compile:
        candidates["attnkit compiled"] = run_compiled
    started = time.perf_counter()
    run_ours(lambda *_: None), run_hf(lambda *_: None)  # warm-up
    warm = time.perf_counter()
    if not args.no_compile:
        run_compiled(lambda *_: None)  # compiles, once per process
    compile_s = time.perf_counter() - warm - (warm - started) / 2  # about: minus one eager run
    speed: dict[str, list[float]] = {name: [] for name in candidates}
    gaps: dict[str, list[list[float]]] = {name: [] for name in candidates}
    tokens = {}
    for _ in range(args.repeats):  # interleaved: round r runs every candidate once
        for name, run in candidates.items():
            toks, gap, total = timed(run)
            tokens[name] = toks
            speed[name].append(new / total)
            gaps[name].append(gap)
    tps = {name: statistics.median(values) for name, values in speed.items()}
    hf_tps = tps["hf"]
    print(
        f"greedy generation, lm-small, batch 1, prompt {args.prompt}, {new} new tokens, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}"
    )
    print(f"  Hugging Face GPT-2 generate      {hf_tps:8.1f} tokens/s")
    figures: dict = {"threads": torch.get_num_threads(), "hf_tokens_per_s": hf_tps}
    for name in candidates:
        if name == "hf":
            continue
        early = statistics.median(statistics.mean(g[:63]) for g in gaps[name]) * 1000
        late = statistics.median(statistics.mean(g[-63:]) for g in gaps[name]) * 1000
        same = tokens[name] == tokens["hf"]
        label = "attnkit (KV cache)" if name == "attnkit" else "attnkit, compile=True"
        print(f"  {label:32s} {tps[name]:8.1f} tokens/s")
        print(f"    ratio to Hugging Face          {tps[name] / hf_tps:8.2f}x")
        print(f"    ms/token, tokens 2-64          {early:8.3f}")
        print(f"    ms/token, last 63 tokens       {late:8.3f}  ({late / early - 1:+.1%})")
        print(f"    same tokens as Hugging Face    {same}")
        key = name.replace(" ", "_")
        figures |= {
            f"{key}_tokens_per_s": tps[name],
            f"{key}_ratio": tps[name] / hf_tps,
            f"{key}_early_ms_per_token": early,
            f"{key}_late_ms_per_token": late,
            f"{key}_same_tokens": same,
        }
    if not args.no_compile:
        print(f"  compiling (once per process)     {compile_s:8.1f} s")
        figures["compile_s"] = compile_s
    figures["ratios"] = {
        f"generation: {name} / HF generate": tps[name] / hf_tps
        for name in candidates
        if name != "hf"
    }
    print(f"wrote {save_results('generation', figures, args.json)}")


if __name__ == "__main__":
    main()
