"""Bad Hugging Face directories: each is a clear ValueError / FileNotFoundError naming the file
and the problem, never a crash or a silently wrong model. And nothing in attnkit unpickles."""

import ast
import json
import re
import struct
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

import attnkit as ak
from attnkit.cli import main

SMALL_BERT = dict(
    vocab_size=50,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=16,
)
SMALL_LLAMA = dict(
    vocab_size=50,
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    max_position_embeddings=32,
)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bert") / "m"
    transformers.BertModel(transformers.BertConfig(**SMALL_BERT)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "m"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL_LLAMA)).save_pretrained(path)
    return path


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_config(path: Path, **changes) -> Path:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is ...:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))
    return path


def _header(path: Path):
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _write_with_header(path: Path, header, body):
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


# --------------------------------------------------------------------------------------------
# The weights file
# --------------------------------------------------------------------------------------------


def test_missing_and_truncated_weights(tmp_path, bert_dir):
    path = _copy(bert_dir, tmp_path / "m")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=r"m/model\.safetensors: not a valid safetensors file"):
        ak.from_pretrained(path)
    weights.write_bytes(data[:5])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a valid safetensors file"):
        ak.from_pretrained(path)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match=r"m: no model\.safetensors"):
        ak.from_pretrained(path)
    (path / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")  # a pickle
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*pickle"):
        ak.from_pretrained(path)


def test_a_header_that_lies_about_offsets_sizes_or_dtypes(tmp_path, bert_dir):
    path = _copy(bert_dir, tmp_path / "m")
    weights = path / "model.safetensors"
    header, body = _header(weights)
    name = "encoder.layer.0.attention.self.query.weight"

    def lie(change):
        h = json.loads(json.dumps(header))
        change(h[name])
        _write_with_header(weights, h, body)

    lie(lambda t: t.update(data_offsets=[t["data_offsets"][0], t["data_offsets"][1] + 4]))
    with pytest.raises(ValueError, match=r"model\.safetensors: not a valid safetensors file"):
        ak.from_pretrained(path)
    lie(lambda t: t.update(data_offsets=[0, t["data_offsets"][1] - t["data_offsets"][0]]))
    with pytest.raises(ValueError, match=r"model\.safetensors: not a valid safetensors file"):
        ak.from_pretrained(path)
    lie(lambda t: t.update(shape=[64, 16]))  # the same byte count, the wrong shape
    with pytest.raises(ValueError, match=rf"'{name}' has shape \(64, 16\), expected \(32, 32\)"):
        ak.from_pretrained(path)
    lie(lambda t: t.update(dtype="I32"))
    with pytest.raises(ValueError, match=rf"'{name}' has dtype torch.int32; expected floating"):
        ak.from_pretrained(path)
    lie(lambda t: t.update(dtype="F64"))  # 8 bytes per element: the sizes no longer add up
    with pytest.raises(ValueError, match=r"not a valid safetensors file"):
        ak.from_pretrained(path)


def test_weights_that_do_not_fit_the_config(tmp_path, bert_dir):
    path = _edit_config(_copy(bert_dir, tmp_path / "deeper"), num_hidden_layers=3)
    with pytest.raises(
        ValueError, match=r"'encoder\.layer\.2\.attention\.self\.query\.weight' is missing"
    ):
        ak.from_pretrained(path)
    path = _copy(bert_dir, tmp_path / "extra")
    weights = ak.interop.checkpoint.read_safetensors(path / "model.safetensors")
    save_file(
        {**weights, "encoder.layer.0.adapter.weight": torch.zeros(3)}, path / "model.safetensors"
    )
    with pytest.raises(
        ValueError,
        match=r"1 tensor\(s\) that attnkit does not know how to place, "
        r"e\.g\. \['encoder\.layer\.0\.adapter\.weight'\]",
    ):
        ak.from_pretrained(path)


def test_broken_shard_indexes(tmp_path, llama_dir):
    model = ak.from_pretrained(llama_dir)
    src = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL_LLAMA))
    src.save_pretrained(tmp_path / "s", max_shard_size="20KB")
    index_path = tmp_path / "s" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    assert isinstance(ak.from_pretrained(tmp_path / "s"), type(model))
    shard = sorted(set(index["weight_map"].values()))[0]

    def with_map(weight_map):
        index_path.write_text(json.dumps({**index, "weight_map": weight_map}))

    with_map({k: "../../etc/passwd" for k in index["weight_map"]})
    with pytest.raises(
        ValueError, match=r"must be a file name in the directory, got '\.\./\.\./etc/passwd'"
    ):
        ak.from_pretrained(tmp_path / "s")
    with_map({k: "model-missing.safetensors" for k in index["weight_map"]})
    with pytest.raises(FileNotFoundError, match=r"model-missing\.safetensors: no such file"):
        ak.from_pretrained(tmp_path / "s")
    with_map({k: shard for k in index["weight_map"]})  # every tensor claimed by one shard
    with pytest.raises(ValueError, match=rf"{shard}: the tensor .* is missing \(listed in"):
        ak.from_pretrained(tmp_path / "s")
    with_map({})
    with pytest.raises(ValueError, match=r"expected a non-empty 'weight_map'"):
        ak.from_pretrained(tmp_path / "s")


# --------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------

BERT_CONFIGS = [
    ({"hidden_size": "32"}, r"hidden_size must be an int >= 1, got '32' \(str\)"),
    ({"num_hidden_layers": True}, r"num_hidden_layers must be an int >= 1, got True \(bool\)"),
    ({"layer_norm_eps": -1}, r"layer_norm_eps must be a number >= 0.0, got -1"),
    ({"hidden_dropout_prob": 1.5}, r"hidden_dropout_prob must be a dropout rate in \[0, 1\)"),
    ({"num_attention_heads": 5}, r"ModelConfig: n_heads=5 must divide d_model=32"),
    ({"hidden_act": "swish"}, r"hidden_act='swish' is not supported by attnkit; expected one of"),
    (
        {"position_embedding_type": "relative_key"},
        r"position_embedding_type='relative_key' is not supported",
    ),
    ({"is_decoder": True}, r"is_decoder=True is not supported"),
    ({"pruned_heads": {"0": [1]}}, r"pruned_heads=\{'0': \[1\]\} is not supported"),
    ({"my_new_idea": 1}, r"unknown field\(s\) \['my_new_idea'\]: attnkit cannot tell"),
    ({"vocab_size": ...}, r"the field 'vocab_size' is missing"),
    (
        {"architectures": ["BertForQuestionAnswering"]},
        r"BERT architecture 'BertForQuestionAnswering' is not supported; "
        r"attnkit reads \['BertModel'",
    ),
    ({"quantization_config": {"load_in_8bit": True}}, r"the weights are quantized"),
    (
        {"model_type": "t5"},
        r"model type 't5' is not supported; "
        r"attnkit reads Hugging Face directories of "
        r"\['bert', 'gemma3_text', 'gpt2', 'llama', 'marian', 'mistral', 'phi3', 'qwen2', "
        r"'qwen3', 'roberta', 'xlm-roberta', 'xlm-roberta-xl'\], "
        r"GGUF files of \['gemma3', 'gpt2', 'llama', 'phi3', 'qwen2', 'qwen3'\]",
    ),
]


@pytest.mark.parametrize("changes, message", BERT_CONFIGS, ids=[m[:24] for _, m in BERT_CONFIGS])
def test_bad_bert_configs(tmp_path, bert_dir, changes, message):
    path = _edit_config(_copy(bert_dir, tmp_path / "m"), **changes)
    with pytest.raises(ValueError, match=re.escape(str(path / "config.json")) + ": " + message):
        ak.from_pretrained(path)


LLAMA_CONFIGS = [
    (
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0}},
        r"rope_type='yarn': this RoPE scaling is not implemented in attnkit \(it implements "
        r"\['linear', 'llama3'\]; docs/MODELS.md\)",
    ),
    (
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
        r"rope_parameters: the field 'low_freq_factor' is missing",
    ),
    (
        {"rope_parameters": ..., "rope_scaling": {"type": "dynamic", "factor": 2.0}},
        r"rope_type='dynamic': this RoPE scaling is not implemented",
    ),
    (
        {"attention_bias": True},
        r"attention_bias=True is not supported by attnkit \(expected False\)",
    ),
    ({"mlp_bias": True}, r"mlp_bias=True is not supported"),
    ({"head_dim": 16}, r"q_proj.weight' has shape \(32, 32\), expected \(64, 32\) from config"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported by attnkit \(expected 'silu'\)"),
    ({"num_key_value_heads": 3}, r"n_heads=4 must be a multiple of n_kv_heads=3"),
    ({"rms_norm_eps": "1e-5"}, r"rms_norm_eps must be a number >= 0.0, got '1e-5' \(str\)"),
    (
        {"architectures": ["LlamaForSequenceClassification"]},
        r"Llama architecture 'LlamaForSequenceClassification' is not supported",
    ),
    ({"sliding_window": 4096}, r"attention='window' is not supported for Llama"),
    ({"partial_rotary_factor": 0.5}, r"rotary_dim=4 is not supported for Llama"),
]


@pytest.mark.parametrize("changes, message", LLAMA_CONFIGS, ids=[m[:24] for _, m in LLAMA_CONFIGS])
def test_bad_llama_configs(tmp_path, llama_dir, changes, message):
    path = _edit_config(_copy(llama_dir, tmp_path / "m"), **changes)
    with pytest.raises(ValueError, match=message):
        ak.from_pretrained(path)


def test_older_llama_configs_with_top_level_rope_theta_load(tmp_path, llama_dir):
    path = _edit_config(
        _copy(llama_dir, tmp_path / "m"), rope_parameters=..., rope_theta=1e6, rope_scaling=None
    )
    assert ak.from_pretrained(path).cfg.rope_theta == 1e6


def test_the_cli_reports_a_bad_directory_in_one_line(tmp_path, llama_dir, capsys):
    path = _edit_config(_copy(llama_dir, tmp_path / "m"), attention_bias=True)
    assert main(["generate", "--model", str(path), "hello"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "attention_bias=True is not supported" in err
    assert main(["embed", "--model", str(llama_dir), "hello"]) == 2
    assert "embed needs an encoder" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# Nothing is ever unpickled
# --------------------------------------------------------------------------------------------


UNPICKLERS = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "joblib", "marshal", "shelve"}


TORCH_LOADS = {"torch.load", "torch.serialization.load"}


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _unpickling_calls(path: Path) -> list[str]:
    """Code (not comments or strings) that may unpickle, found in the syntax tree: an import of
    a pickle-like module (or of anything from one), a name or attribute that says pickle
    (``pd.read_pickle``), ``allow_pickle=True``, or a call of ``torch.load`` under any name
    (``torch.load``, ``torch.serialization.load``, ``from torch import load as f``...) without
    ``weights_only=True``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases: dict[str, str] = {}  # local name -> what it was imported as
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in UNPICKLERS:
                    found.append((node.lineno, alias.name))
                local = alias.asname or alias.name.split(".")[0]
                aliases[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[0] in UNPICKLERS:
                found.append((node.lineno, module))
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and "pickle" in node.attr.lower():
            found.append((node.lineno, node.attr))
        if isinstance(node, ast.Name) and node.id in UNPICKLERS:
            found.append((node.lineno, node.id))
        if not isinstance(node, ast.Call):
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        if _is_true(keywords.get("allow_pickle")):
            found.append((node.lineno, "allow_pickle=True"))
        name = _dotted(node.func)
        if name is not None:
            head, _, rest = name.partition(".")
            name = ".".join(filter(None, [aliases.get(head, head), rest]))
        if name in TORCH_LOADS and not _is_true(keywords.get("weights_only")):
            found.append((node.lineno, "torch.load without weights_only=True"))
    return [f"{path.name}:{line}: {what}" for line, what in sorted(found)]


def _is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def test_nothing_in_attnkit_unpickles():
    src = Path(ak.__file__).parent
    offenders = [hit for path in sorted(src.rglob("*.py")) for hit in _unpickling_calls(path)]
    assert not offenders, offenders


def test_the_unpickling_scan_finds_what_it_should(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle  # no\n"
        "x = torch.load(f)\n"
        "y = torch.load(\n    f, map_location='cpu', weights_only=False)\n"
        "ok = torch.load(f, weights_only=True)\n"
        "z = np.load(f, allow_pickle=True)\n"
        "s = 'pickle in a string is fine'\n"
    )
    assert [hit.split(": ", 1)[1] for hit in _unpickling_calls(bad)] == [
        "pickle",
        "torch.load without weights_only=True",
        "torch.load without weights_only=True",
        "allow_pickle=True",
    ]
    # what a token scan for "torch.load(" misses: other names for the same function
    renamed = tmp_path / "renamed.py"
    renamed.write_text(
        "from torch import load\n"
        "import torch.serialization\n"
        "from torch.serialization import load as restore\n"
        "import dill as d\n"
        "a = load(f)\n"
        "b = torch.serialization.load(f)\n"
        "c = restore(f, weights_only=False)\n"
        "e = pd.read_pickle(f)\n"
        "ok = load(f, weights_only=True)\n"
    )
    assert [hit.split(": ", 1)[1] for hit in _unpickling_calls(renamed)] == [
        "dill",
        "torch.load without weights_only=True",
        "torch.load without weights_only=True",
        "torch.load without weights_only=True",
        "read_pickle",
    ]
