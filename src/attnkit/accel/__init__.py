"""Speed levers, applied to a built model from outside: the model code never mentions them.

Each lever is switchable and measured on its own in ``bench/history/`` (the gain depends on the
processor: measure before relying on one).

::

    onednn.py     float32 matrix products through oneDNN's GEMM on the CPU (forward and both
                  gradients), a module swap: ``use_onednn_products(model)`` (each product
                  takes oneDNN where it measured faster than MKL here, ``onednn_choice()``; forced:
                  ``onednn_linear(False)``, ``ATTNKIT_ONEDNN_LINEAR=0`` or ``=1``);
                  ``bf16_products_fast()``: whether torch has fast bf16 products here
    attention.py  attention's forward and backward for training steps by a C kernel
                  (attention.c), registered as the fused kernel "attnkit" of
                  ``backends.FUSED`` and chosen per layer: ``use_attention_kernel(model)``
                  (off: ``attention_kernel(False)`` or
                  ``ATTNKIT_ATTENTION_KERNEL=0``); in bfloat16 on AMX tiles where the
                  processor has them (``tiles_available()``; off: ``attention_tiles(False)``
                  or ``ATTNKIT_ATTENTION_TILES=0``)
    unpadded.py   the encoder and decoder stacks run their layers on a padded batch's real
                  tokens only, attention over packed sequences in attention.c:
                  ``unpad_stacks(model)`` (off: ``unpadding(False)`` or ``ATTNKIT_UNPAD=0``)
    lm_loss.py    the output layer and its cross-entropy in one chunked pass, without the
                  (tokens x V) logits, each chunk's row-wise work in one C call (lm_loss.c):
                  ``fuse_lm_loss(model)`` (the C kernel off: ``loss_kernels(False)`` or
                  ``ATTNKIT_LOSS_KERNEL=0``)
    decoding.py   one-row (decoding) products over weights laid out as (in, out) rows:
                  ``lay_out_for_decoding(model)`` (off: ``decoding_layouts(False)``)
    compiled.py   the cached decoding steps through torch.compile, weights frozen into them:
                  ``compiled_steps(device)``, a model's ``decoding_steps`` (CPU autotuning
                  off: ``autotuning(False)`` or ``ATTNKIT_AUTOTUNE=0``)
    compiled_training.py  a training step whose Transformer layers run through torch.compile
                  (the products still in oneDNN): ``with compiled_layers(model):``
    memory.py     glibc's malloc keeps freed blocks in the process instead of handing them
                  back and faulting them in again every step: ``keep_freed_memory()`` (the
                  trainer calls it; off: ``ATTNKIT_KEEP_MEMORY=0``), and
                  ``with return_freed_memory():`` around a resident-memory measurement;
                  ``release_file_pages(tensor)``: a memory-mapped file's pages out of the
                  resident set (the integer path's tiles replace the file's blocks)
    native.py     the C kernels (attention.c, lm_loss.c, packed.c, tiles.c, llama_step.c),
                  built at install by
                  setup.py into one library per instruction set (variants.py), the best this
                  CPU runs loaded at first use (``ATTNKIT_KERNELS`` names one, or ``off``);
                  none loaded: each caller falls back to PyTorch, and a warning says why
    block_formats.py  the block formats' bytes, their dequantization (bit for bit gguf.quants)
                  and the repacking of Q4_K, Q5_K, Q6_K and Q5_0 at load
    packed.py     linear layers and token tables kept in a GGUF file's Q8_0 / Q4_0 / Q4_1 /
                  Q4_K / Q6_K blocks, multiplied by the C kernels: ``PackedLinear``,
                  ``PackedEmbedding`` (``from_pretrained(path, dequantize=False)`` puts them in);
                  ``use_integer_products(model)``: their int8-activation path
    packed_step.py  a Llama model's decoder stack with packed weights in C, prompt chunks and
                  decoding steps alike, a module swap: ``packed_stack(model)`` (off:
                  ``packed_steps(False)`` or ``ATTNKIT_PACKED_STEP=0``)
    quantize.py   any model's linear layers rounded to those blocks (weight-only int8 / int4):
                  ``quantize(model, "int4")``

``prepare(model, "training" | "decoding")`` (prepare.py) is the front door: it turns on what the
job uses here and returns every lever with its state and why it is off, one line for a run's
header; ``levers(job)`` answers without a model (``attnkit info``); the trainer also calls
``keep_freed_memory()``. Nothing below ``accel`` imports it: the models, ``generate`` and
``import attnkit`` run without it, and a lever reaches a model only through what a caller
applies here.
"""

from __future__ import annotations

from attnkit.accel.attention import (
    FUSED_NAME,
    attention_kernel,
    attention_tiles,
    tiles_available,
    use_attention_kernel,
)
from attnkit.accel.compiled import autotuning, compiled_steps
from attnkit.accel.compiled_training import check_compiler, compiled_layers
from attnkit.accel.decoding import decoding_layouts, lay_out_for_decoding
from attnkit.accel.lm_loss import FusedLMHead, fuse_lm_loss, linear_cross_entropy, loss_kernels
from attnkit.accel.memory import keep_freed_memory, release_file_pages, return_freed_memory
from attnkit.accel.onednn import (
    bf16_products_fast,
    linear,
    onednn_choice,
    onednn_linear,
    onednn_linear_available,
    use_onednn_products,
)
from attnkit.accel.packed import PackedEmbedding, PackedLinear, use_integer_products
from attnkit.accel.packed_step import PackedStack, packed_stack, packed_steps
from attnkit.accel.prepare import Lever, Prepared, levers, prepare
from attnkit.accel.quantize import quantize
from attnkit.accel.unpadded import unpad_stacks, unpadding

__all__ = [
    "FUSED_NAME",
    "FusedLMHead",
    "Lever",
    "PackedEmbedding",
    "PackedLinear",
    "PackedStack",
    "Prepared",
    "attention_kernel",
    "attention_tiles",
    "autotuning",
    "bf16_products_fast",
    "check_compiler",
    "compiled_layers",
    "compiled_steps",
    "decoding_layouts",
    "fuse_lm_loss",
    "keep_freed_memory",
    "lay_out_for_decoding",
    "levers",
    "linear",
    "linear_cross_entropy",
    "loss_kernels",
    "onednn_choice",
    "onednn_linear",
    "onednn_linear_available",
    "packed_stack",
    "packed_steps",
    "prepare",
    "quantize",
    "release_file_pages",
    "return_freed_memory",
    "tiles_available",
    "unpad_stacks",
    "unpadding",
    "use_attention_kernel",
    "use_integer_products",
    "use_onednn_products",
]
