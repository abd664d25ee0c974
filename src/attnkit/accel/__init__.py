"""Speed levers, above the models: the model code never mentions them, and nothing below this
package imports it (the models, ``generate``, ``import attnkit``).

``prepare(model, "training" | "decoding")`` (prepare.py) is the front door: it applies what the
job uses here, each lever by its rule (never by a timing), and returns every lever with its
state and why, one line for a run's header; ``levers(job)`` answers without a model (``attnkit
info``). A lever acts in one way: a module swap that builds new modules over the same weights
(swap.py), as torchao's ``quantize_`` does. Its switch (``unpadding(False)``, ...) holds it off
inside a ``with`` block; its environment variable (``ATTNKIT_UNPAD=0``, ...) is read when the
levers are reported (switch.py). docs/ARCHITECTURE.md has the table of levers.

::

    training   lm_loss.py (the fused LM-head loss), unpadded.py (the stacks over real tokens),
               onednn.py (float32 products by oneDNN, on AMD), attention.py (the C kernel,
               registered as the attention implementation "attnkit"), compiled_training.py
               (layers through torch.compile for a block), memory.py (glibc keeps freed memory)
    decoding   decoding.py (weights laid out for one-row products), packed.py (GGUF blocks,
               and their integer path), packed_step.py (a packed Llama stack in C),
               compiled.py (the cached steps through torch.compile, a model's decoding_steps)
    formats    block_formats.py (the blocks' bytes), quantize.py (any model to those blocks)
    kernels    native.py: the C kernels, built at install into one library per instruction set
               (variants.py), the best this CPU runs loaded at first use; none loaded, each
               caller falls back to PyTorch and a warning says why
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
from attnkit.accel.prepare import Lever, Prepared, levers, prepare, ready_for_decoding
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
    "ready_for_decoding",
    "release_file_pages",
    "return_freed_memory",
    "tiles_available",
    "unpad_stacks",
    "unpadding",
    "use_attention_kernel",
    "use_integer_products",
    "use_onednn_products",
]
