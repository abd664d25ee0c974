"""The models, batches and steps that bench/training.py times (and bench/memory.py and
bench/levers.py reuse): lm-small as attnkit's DecoderLM, Hugging Face GPT-2 and x-transformers;
mt-small as attnkit's Transformer, ``torch.nn.Transformer`` and Hugging Face BART; one AdamW and
one step function for all of them. bench/history/ lists every size."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
import transformers
from torch import Tensor, nn
from x_transformers import Decoder, TransformerWrapper

import attnkit as ak
from attnkit import accel
from attnkit.interop import to_hf
from common import SEED, training_levers

transformers.logging.set_verbosity_error()


# attnkit's variants, as (compiled layers, oneDNN products): the trainer's step (eager layers,
# oneDNN products where accel.onednn_choice() takes them by its rule: None), its layers compiled
# (train.compile), and both without the oneDNN products (ATTNKIT_ONEDNN_LINEAR=0), which leaves
# float32 products to torch's own GEMM (MKL on x86)
PADDED = "attnkit padded stacks"  # mt-small: the trainer's step without accel.unpad_stacks


VARIANTS = {
    "attnkit": (False, None),
    "attnkit compiled": (True, None),
    "attnkit no oneDNN": (False, False),
    "attnkit compiled, no oneDNN": (True, False),
}


LM_BATCH, LM_LEN = 8, 256


MT_BATCH, MT_LEN, MT_MIN_LEN = 32, 64, 51  # lengths uniform in [51, 64]: about 10% padding


def onednn_switch(onednn: bool | None):
    """``accel.onednn_linear(onednn)``; None leaves the default (``accel.onednn_choice()``)."""
    return contextlib.nullcontext() if onednn is None else accel.onednn_linear(onednn)


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    """AdamW as every candidate gets it: ``fused`` (one kernel per tensor group), ``foreach``
    or ``loop`` (PyTorch's per-parameter loop, its CPU default)."""
    options = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **options[kind])


def train_step(
    loss_of: Callable[[], Tensor], optimizer: torch.optim.Optimizer, precision: str
) -> Callable[[], float]:
    """One step: loss -> backward -> AdamW. bf16 runs the forward and the loss under autocast
    (weights, gradients and optimizer state stay float32)."""
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if precision == "bf16"
        else contextlib.nullcontext()
    )

    def step() -> float:
        with autocast:
            loss = loss_of()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def logits_loss(
    logits_of: Callable[[], Tensor], targets: Tensor, ignore_index: int = -100
) -> Callable[[], Tensor]:
    """The usual loss: the model's logits (B, N, V), then ``F.cross_entropy`` over them."""
    flat = targets.reshape(-1)

    def loss() -> Tensor:
        logits = logits_of()
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), flat, ignore_index=ignore_index
        )

    return loss


def lm_models() -> dict[str, nn.Module]:
    """The language models, seeded, one per candidate ("attnkit logits" is a second copy of
    attnkit's, so each has its own optimizer state); GPT-2 holds attnkit's weights exactly."""
    cfg = ak.ModelConfig.preset("lm-small")

    def attnkit() -> ak.DecoderLM:
        torch.manual_seed(SEED)
        return ak.DecoderLM(cfg).train()

    ours = attnkit()
    variants = {name: attnkit() for name in VARIANTS if name != "attnkit"}
    hf_config, state = to_hf(ours)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(**hf_config, attn_implementation="sdpa")
    )
    gpt2.load_state_dict(state, strict=False)  # strict=False: GPT-2's causal-mask buffers
    torch.manual_seed(SEED)
    xt = TransformerWrapper(
        num_tokens=cfg.vocab_size,
        max_seq_len=cfg.max_len,
        attn_layers=Decoder(
            dim=cfg.d_model,
            depth=cfg.n_layers,
            heads=cfg.n_heads,
            attn_dim_head=cfg.d_head,  # its default (64) would make attention twice as wide
            ff_mult=cfg.d_ff // cfg.d_model,
            attn_flash=True,  # torch's fused attention, as attnkit and GPT-2 (sdpa) use
        ),
        tie_embedding=True,
    )
    return {
        "attnkit": ours,
        **variants,
        "attnkit logits": attnkit(),
        "HF GPT-2": gpt2.train(),
        "x-transformers": xt.train(),
    }


def lm_batch() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, 8192, (LM_BATCH, LM_LEN + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]  # inputs, next-token targets


def with_levers(
    loss_of: Callable[[], Tensor], model: nn.Module, variant: str = "attnkit"
) -> Callable[[], Tensor]:
    """attnkit's forward (and loss) with the speed levers the trainer applies to a step
    (oneDNN's products, which ``common.training_levers`` swapped in, forced on or off, and
    ``accel.compiled_layers`` for ``train.compile``) as ``variant`` (a key of VARIANTS) says;
    the references run as they are."""
    compiled, onednn = VARIANTS[variant]

    def run() -> Tensor:
        with (
            onednn_switch(onednn),
            accel.compiled_layers(model, compiled),
        ):
            return loss_of()

    return run


def lm_losses(models: dict[str, nn.Module], inputs: Tensor, targets: Tensor) -> dict:
    """Each candidate's loss. attnkit's own training loss is ``DecoderLM.loss`` (the LM head
    and the cross-entropy fused, no logits tensor); "attnkit logits" is the same model through
    its logits and ``F.cross_entropy``, as the references run."""
    plain = accel.use_attention_kernel(models["attnkit logits"])  # as training_levers does
    gpt2, xt = models["HF GPT-2"], models["x-transformers"]

    def ours(variant: str) -> Callable[[], Tensor]:
        model = training_levers(models[variant])
        return with_levers(lambda: model.loss(inputs, targets), model, variant)

    return {
        **{variant: ours(variant) for variant in VARIANTS},
        "attnkit logits": with_levers(logits_loss(lambda: plain(inputs), targets), plain),
        "HF GPT-2": logits_loss(lambda: gpt2(inputs).logits, targets),
        "x-transformers": logits_loss(lambda: xt(inputs), targets),
    }


def lm_flops_per_token(model: ak.DecoderLM) -> float:
    """6 P + 12 L D T (see the module docstring)."""
    cfg = model.cfg
    positions = model.embeddings.positions
    p = model.num_parameters() - (0 if positions is None else positions.embedding.weight.numel())
    return 6.0 * p + 12.0 * cfg.n_layers * cfg.d_model * cfg.max_len


class TorchSeq2Seq(nn.Module):
    """torch.nn.Transformer made into a translation model the way mt-small is built: a shared
    embedding times sqrt(d_model) plus the sinusoidal table, Post-LN layers, ReLU, and the output
    layer tied to the embedding. (nn.Transformer adds a final LayerNorm to each stack.)"""

    def __init__(self, cfg: ak.ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.register_buffer("table", ak.sinusoidal_table(cfg.max_len, cfg.d_model))
        self.scale = math.sqrt(cfg.d_model)
        self.core = nn.Transformer(
            cfg.d_model,
            cfg.n_heads,
            cfg.n_layers,
            cfg.n_layers,
            cfg.d_ff,
            dropout=0.0,
            batch_first=True,
        )
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.out.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=cfg.d_model**-0.5)  # as attnkit's scaled tables

    def forward(self, src: Tensor, tgt: Tensor, src_real: Tensor, tgt_real: Tensor) -> Tensor:
        s = self.embed(src) * self.scale + self.table[: src.shape[1]]
        t = self.embed(tgt) * self.scale + self.table[: tgt.shape[1]]
        blocked = ~ak.causal_mask(tgt.shape[1])  # torch's bool attn_mask: True = blocked
        hidden = self.core(
            s,
            t,
            tgt_mask=blocked,
            tgt_is_causal=True,
            # torch's key_padding_mask means True = padding: the opposite of attnkit's masks
            src_key_padding_mask=~src_real,
            tgt_key_padding_mask=~tgt_real,
            memory_key_padding_mask=~src_real,
        )
        return self.out(hidden)


def mt_models() -> dict[str, nn.Module]:
    """The translation models, seeded, one per candidate (as :func:`lm_models`)."""
    cfg = ak.ModelConfig.preset("mt-small")

    def attnkit() -> ak.Transformer:
        torch.manual_seed(SEED)
        return ak.Transformer(cfg).train()

    ours = attnkit()
    variants = {name: attnkit() for name in (*VARIANTS, PADDED) if name != "attnkit"}
    torch.manual_seed(SEED)
    reference = TorchSeq2Seq(cfg).train()
    torch.manual_seed(SEED)
    bart = transformers.BartForConditionalGeneration(
        transformers.BartConfig(
            vocab_size=cfg.vocab_size,
            max_position_embeddings=cfg.max_len,
            d_model=cfg.d_model,
            encoder_layers=cfg.n_layers,
            decoder_layers=cfg.n_layers,
            encoder_attention_heads=cfg.n_heads,
            decoder_attention_heads=cfg.n_heads,
            encoder_ffn_dim=cfg.d_ff,
            decoder_ffn_dim=cfg.d_ff,
            activation_function="relu",
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            scale_embedding=True,
            pad_token_id=cfg.pad_id,
            bos_token_id=cfg.bos_id,
            eos_token_id=cfg.eos_id,
            decoder_start_token_id=cfg.bos_id,
            attn_implementation="sdpa",
        )
    )
    return {
        "attnkit": ours,
        **variants,
        "attnkit logits": attnkit(),
        "torch.nn.Transformer": reference,
        "HF BART": bart.train(),
    }


def mt_batch() -> dict[str, Tensor]:
    """Sources and targets with lengths uniform in [MT_MIN_LEN, MT_LEN], right-padded with 0."""
    cfg = ak.ModelConfig.preset("mt-small")
    g = torch.Generator().manual_seed(SEED)

    def padded() -> Tensor:
        ids = torch.randint(3, cfg.vocab_size, (MT_BATCH, MT_LEN), generator=g)
        lengths = torch.randint(MT_MIN_LEN, MT_LEN + 1, (MT_BATCH, 1), generator=g)
        return ids.masked_fill(torch.arange(MT_LEN) >= lengths, cfg.pad_id)

    src, tgt = padded(), padded()
    tgt_in = ak.shift_right(tgt, cfg.bos_id)  # teacher forcing: [BOS, y_1 .. y_{T-1}]
    tgt_in_real = torch.cat([torch.ones_like(tgt[:, :1], dtype=torch.bool), tgt[:, :-1] != 0], 1)
    return {"src": src, "src_real": src != 0, "tgt_in": tgt_in, "tgt_in_real": tgt_in_real,
            "targets": tgt}  # fmt: skip


def mt_losses(models: dict[str, nn.Module], b: dict[str, Tensor]) -> dict:
    """Each candidate's loss over the real target tokens (padding is ignore_index 0)."""
    plain = accel.use_attention_kernel(models["attnkit logits"])  # as training_levers does
    ref, bart = models["torch.nn.Transformer"], models["HF BART"]
    args = (b["src"], b["tgt_in"], b["src_real"], b["tgt_in_real"])

    def bart_logits() -> Tensor:
        return bart(
            input_ids=b["src"],
            attention_mask=b["src_real"].long(),
            decoder_input_ids=b["tgt_in"],
            decoder_attention_mask=b["tgt_in_real"].long(),
        ).logits

    def ours(variant: str) -> Callable[[], Tensor]:
        model = training_levers(models[variant], unpadded=variant != PADDED)
        return with_levers(
            lambda: model.loss(*args[:2], b["targets"], *args[2:], ignore_index=0),
            model,
            "attnkit" if variant == PADDED else variant,
        )

    return {
        **{variant: ours(variant) for variant in (*VARIANTS, PADDED)},
        "attnkit logits": with_levers(logits_loss(lambda: plain(*args), b["targets"], 0), plain),
        "torch.nn.Transformer": logits_loss(lambda: ref(*args), b["targets"], 0),
        "HF BART": logits_loss(bart_logits, b["targets"], 0),
    }


def mt_padding() -> float:
    b = mt_batch()
    real = (b["src_real"].float().mean() + (b["targets"] != 0).float().mean()) / 2
    return 1.0 - float(real)
