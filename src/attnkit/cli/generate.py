"""``attnkit generate``: continue a prompt with a language model."""

from __future__ import annotations

import argparse
import re

import torch

from attnkit.cli._common import UsageError, _load_model, _load_tokenizer, _to_device

# --------------------------------------------------------------------------------------------
# attnkit generate
# --------------------------------------------------------------------------------------------


def _cmd_generate(args: argparse.Namespace) -> None:
    positional = list(args.args)
    path = args.checkpoint or args.model
    option = "--checkpoint" if args.checkpoint else "--model" if args.model else "CHECKPOINT"
    if path is None:
        if not positional:
            raise UsageError("generate: give a model directory and a prompt (see --help)")
        path = positional.pop(0)
    if len(positional) != 1:
        raise UsageError(f"generate: expected one prompt, got {len(positional)} arguments")
    prompt = positional[0]
    model = _load_model(path, option, dequantize=args.dequantize)
    if getattr(model, "family", None) != "decoder-only":
        raise UsageError(
            f"{option}: {path} holds a {type(model).__name__}; generate needs a decoder-only "
            "language model"
        )
    tokenizer = _load_tokenizer(path, option)
    if tokenizer is None:
        raise UsageError(
            f"{option}: {path} has no tokenizer (tokenizer.json, or tokenizer.ggml.* in a GGUF "
            "file) to turn the prompt into ids"
        )
    ids = tokenizer.encode(prompt)
    if not ids:
        if model.cfg.bos_id is None:
            raise UsageError("generate: the prompt is empty and the model has no BOS token")
        ids = [model.cfg.bos_id]
    device = _to_device(model, args.device, path)
    prompt_ids = torch.tensor([ids], device=device)
    new_tokens = args.max_new_tokens
    if new_tokens is None:  # 200, or what a table of positions leaves (none: generate says why)
        limit = model.cfg.position_limit
        new_tokens = 200 if limit is None else min(200, max(limit - len(ids), 1))
    new_ids: list[int] = []
    shown = ""
    # The new text is what decoding prompt + new tokens adds to the decoded prompt: decoding the
    # new tokens alone would lose a SentencePiece token's leading space.
    base = tokenizer.decode(ids)

    def stream(tokens):
        nonlocal shown
        if not new_ids:
            print(prompt, end="", flush=True)
        new_ids.append(int(tokens[0]))
        text = tokenizer.decode(ids + new_ids)[len(base) :]
        if text.endswith("\ufffd"):
            return  # half a UTF-8 character so far: wait for the rest
        print(text[len(shown) :], end="", flush=True)
        shown = text

    try:
        out = model.generate(
            prompt_ids,
            new_tokens,
            do_sample=not args.greedy and args.beam == 1,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            num_beams=args.beam,
            seed=args.seed,
            on_token=stream if args.beam == 1 else None,
            compile=args.compile,
        )
    except ValueError as error:  # named as the options are, not as generate's arguments
        message = re.sub(
            r"\b(max_new_tokens|temperature|top_k|top_p|num_beams)\b", _option, str(error)
        )
        raise UsageError(f"generate: {message}") from None
    if args.beam > 1:
        print(prompt + tokenizer.decode(out[0].tolist())[len(base) :], end="")
    print()


def _option(name: re.Match) -> str:
    """model.generate's argument -> the option that sets it: num_beams -> --beam."""
    return {"num_beams": "--beam"}.get(name[0], "--" + name[0].replace("_", "-"))
