"""The serving engine without HTTP: batched decoding equals ``generate`` row by row, rows join
and leave between steps, a cancelled request frees its row; chat templates and the text stream."""

import json
import queue
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import attnkit as ak
from attnkit.data.tokenizer import CharTokenizer
from attnkit.serve import PLAIN_TEMPLATE, Engine, Request, TextStream, render_chat

TEXT = "to be or not to be, that is the question: whether 'tis nobler in the mind to suffer"
PROMPTS = ["to be", "or not to be, th", "that", "question is", "b", "not to be or to be that"]


@pytest.fixture(scope="module")
def tokenizer():
    return CharTokenizer.train([TEXT])


def collect(q: queue.Queue, timeout: float = 60) -> list[dict]:
    events = []
    while True:
        event = q.get(timeout=timeout)
        events.append(event)
        if event["type"] != "token":
            return events


def model_for(tokenizer, seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = ak.ModelConfig.preset("tiny", vocab_size=tokenizer.vocab_size, **overrides)
    return ak.DecoderLM(cfg).eval()


@pytest.mark.parametrize(
    "overrides",
    [dict(position="rope"), dict(position="learned"), dict(position="alibi", n_kv_heads=1)],
    ids=["rope", "learned", "alibi-gqa"],
)
def test_batched_rows_equal_generate_alone(tokenizer, overrides):
    """Six prompts of different lengths arrive while others are decoding (four rows at most):
    every greedy reply equals generate() on that prompt alone."""
    model = model_for(tokenizer, **overrides)
    engine = Engine(model, tokenizer, max_batch=4)
    try:
        queues = []
        for i, prompt in enumerate(PROMPTS):
            q = queue.Queue()
            ids = tokenizer.encode(prompt)
            engine.submit(Request(ids, 10 + i, temperature=0), q.put)
            queues.append((q, ids, 10 + i))
            time.sleep(0.002 * i)  # later prompts join a batch that is already running
        total = 0
        for q, ids, n in queues:
            events = collect(q)
            got = [e["id"] for e in events if e["type"] == "token"]
            want = model.generate(torch.tensor([ids]), n, do_sample=False)[0, len(ids) :]
            assert got == want[: len(got)].tolist()
            assert events[-1]["type"] == "done"
            assert events[-1]["text"] == tokenizer.decode(got)
            total += len(got)
        assert engine.steps < total  # rows were decoded together, not one after another
    finally:
        engine.close()


def test_a_cancelled_request_leaves_the_batch(tokenizer):
    model = model_for(tokenizer, max_len=4096)
    engine = Engine(model, tokenizer, max_batch=4)
    try:
        slow, fast = queue.Queue(), queue.Queue()
        job = engine.submit(Request(tokenizer.encode("to be"), 4000, temperature=0), slow.put)
        slow.get(timeout=30)  # it is being decoded
        engine.submit(Request(tokenizer.encode("that"), 5, temperature=0), fast.put)
        job.cancel()
        assert collect(fast)[-1]["finish_reason"] == "length"
        deadline = time.monotonic() + 10
        while engine.stats()["running"] and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = engine.stats()
        assert (stats["running"], stats["waiting"]) == (0, 0)
    finally:
        engine.close()


def test_sampling_follows_the_seed_and_the_stop_string(tokenizer):
    model = model_for(tokenizer)
    engine = Engine(model, tokenizer)
    engine.eos_ids = set()  # an untrained model says EOS early; these replies run to the end
    try:
        replies = []
        for seed in (1, 1, 2):
            q = queue.Queue()
            engine.submit(Request(tokenizer.encode("to"), 30, temperature=1.5, seed=seed), q.put)
            replies.append(collect(q)[-1]["text"])
        assert replies[0] == replies[1] != replies[2]
        stop = replies[0][3:5]
        q = queue.Queue()
        request = Request(tokenizer.encode("to"), 30, temperature=1.5, seed=1, stop=[stop])
        engine.submit(request, q.put)
        events = collect(q)
        assert events[-1]["finish_reason"] == "stop"
        assert events[-1]["text"] == replies[0][: replies[0].index(stop)]
        assert "".join(e["text"] for e in events[:-1]) == events[-1]["text"]  # nothing taken back
    finally:
        engine.close()


def test_window_attention_is_served_one_request_at_a_time(tokenizer):
    model = model_for(tokenizer, attention="window", window=4)
    engine = Engine(model, tokenizer, max_batch=8)
    try:
        assert engine.max_batch == 1
        q = queue.Queue()
        ids = tokenizer.encode("not to be")
        engine.submit(Request(ids, 12, temperature=0), q.put)
        got = [e["id"] for e in collect(q) if e["type"] == "token"]
        want = model.generate(torch.tensor([ids]), 12, do_sample=False)[0, len(ids) :]
        assert got == want.tolist()
    finally:
        engine.close()


def test_requests_that_cannot_be_answered_are_refused(tokenizer):
    model = model_for(tokenizer, position="learned")
    engine = Engine(model, tokenizer)
    try:
        with pytest.raises(ValueError, match="the prompt is empty"):
            engine.submit(Request([], 5), print)
        with pytest.raises(ValueError, match=r"max_tokens=1000 does not fit: .* at most \d+ new"):
            engine.submit(Request([5, 6], 1000), print)
        with pytest.raises(TypeError, match="decoder-only"):
            Engine(ak.EncoderModel(ak.ModelConfig.preset("tiny")), tokenizer)
    finally:
        engine.close()


def run_until_answered(engine: Engine, queues: list[queue.Queue], timeout: float = 60) -> None:
    """Run a ``start=False`` engine on this thread until every queue has its last event (or
    ``timeout`` seconds have passed: a request that is never answered fails the test)."""
    deadline = time.monotonic() + timeout

    def answered() -> bool:
        return all(q.qsize() and q.queue[-1]["type"] != "token" for q in queues)

    engine.run(until=lambda: answered() or time.monotonic() > deadline)


CPU = torch.device("cpu")


class OneDevice(TorchDispatchMode):
    """Checks CUDA's rule, that the tensors of one operator are all on one device (a CPU
    scalar may join them), for a model on the meta device, the one device other than the CPU
    that every machine has. A meta tensor holds no values: copied to the CPU (the engine's
    logits) it becomes random numbers, and read as a Python number (``int(tensor)``) it is 0."""

    def __init__(self):
        super().__init__()
        self.mixed: list[tuple[str, list[str]]] = []
        self.generator = torch.Generator().manual_seed(0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        devices = {t.device.type for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
        if len(devices) > 1:
            self.mixed.append((str(func), sorted(devices)))
        if tensors and tensors[0].is_meta:
            if func is torch.ops.aten._to_copy.default and kwargs.get("device") == CPU:
                value = torch.randn(tensors[0].shape, generator=self.generator)
                return value.to(kwargs.get("dtype") or tensors[0].dtype)
            if func is torch.ops.aten._local_scalar_dense.default:
                return 0
        return func(*args, **kwargs)


@pytest.mark.parametrize("overrides", [dict(position="rope"), dict(attention="window", window=4)])
def test_the_batch_lives_on_the_models_device(tokenizer, overrides):
    """A model moved to another device (here meta; bench/gpu.py serves on a GPU) is served with
    its ids, masks and caches made there: three requests of different lengths join and leave
    the batch (one sampled, one with its attention recorded), and no operator ever mixes
    devices. Before, the engine made them on the CPU and every request ended in an error."""
    model = model_for(tokenizer, **overrides).to("meta")
    engine = Engine(model, tokenizer, max_batch=4, start=False)
    engine.eos_ids = set()  # the stood-in logits are random: run every reply to its length
    requests = [
        Request(tokenizer.encode("to be"), 3, temperature=1.0, seed=1),
        Request(tokenizer.encode("or not to"), 6, temperature=0),
        Request(tokenizer.encode("that"), 4, temperature=0, attention=True),
    ]
    queues = [queue.Queue() for _ in requests]
    mode = OneDevice()
    with mode:
        for request, q in zip(requests, queues, strict=True):
            engine.submit(request, q.put)
        run_until_answered(engine, queues)
    assert mode.mixed == []
    for request, q in zip(requests, queues, strict=True):
        events = list(q.queue)
        assert events[-1]["type"] == "done" and events[-1]["finish_reason"] == "length"
        assert events[-1]["completion_tokens"] == request.max_tokens
    recorded = engine.recording(events[-1]["id"])["job"].weights
    assert len(recorded) == 4 and all(w.device == CPU for w in recorded)


@pytest.mark.parametrize("attention", [True, False], ids=["recorded", "batched"])
def test_a_request_that_fails_before_it_joins_the_batch_is_told(tokenizer, monkeypatch, attention):
    """A request fails while it is started (its prompt's cache cannot be made): its client gets
    an error event (before, the client of a recorded request, or of one that failed outside the
    prompt's forward, waited forever), and the next request is answered."""
    model = model_for(tokenizer)
    engine = Engine(model, tokenizer, start=False)

    def broken(*args, **kwargs):
        raise RuntimeError("no room today")

    ids = tokenizer.encode("to be")
    for want in ("error", "done"):
        if want == "error":
            monkeypatch.setattr(model, "new_cache", broken)
        else:
            monkeypatch.undo()
        q = queue.Queue()
        engine.submit(Request(ids, 3, temperature=0, attention=attention), q.put)
        run_until_answered(engine, [q])
        assert q.qsize() and q.queue[-1]["type"] == want
        if want == "error":
            assert q.queue[-1]["message"] == "RuntimeError: no room today"


def test_a_request_that_fails_in_the_batch_ends_alone(tokenizer):
    """Three requests decoded together; one of them fails at its fourth token (its sink raises,
    as a grammar that refuses a token does): it alone gets an error event, the other two
    finish with the tokens they get alone."""
    model = model_for(tokenizer)
    engine = Engine(model, tokenizer, max_batch=4, start=False)
    queues, jobs = [], []
    for prompt in ("to be", "that is", "or not"):
        q = queue.Queue()
        jobs.append(engine.submit(Request(tokenizer.encode(prompt), 8, temperature=0), q.put))
        queues.append(q)
    failing, seen = queues[1], []

    def sink(event):
        seen.append(event)
        if len(seen) == 4 and event["type"] == "token":
            raise RuntimeError("the grammar refused token 7")
        failing.put(event)

    jobs[1].sink = sink
    run_until_answered(engine, queues)
    assert failing.queue[-1] == {
        "type": "error",
        "message": "RuntimeError: the grammar refused token 7",
    }
    assert engine.steps >= 4  # the three were decoded together, past the failure
    for prompt, q in (("to be", queues[0]), ("or not", queues[2])):
        events = list(q.queue)
        assert events[-1]["type"] == "done" and events[-1]["finish_reason"] == "length"
        ids = tokenizer.encode(prompt)
        want = model.generate(torch.tensor([ids]), 8, do_sample=False)[0, len(ids) :].tolist()
        assert [e["id"] for e in events if e["type"] == "token"] == want


def test_the_attention_recording_is_the_models_own(tokenizer):
    """With attention=True each generated token keeps the weights (layers, heads, positions) of
    the query that chose it: equal to the model's weights over the whole sequence."""
    model = model_for(tokenizer)
    engine = Engine(model, tokenizer)
    try:
        q = queue.Queue()
        ids = tokenizer.encode("to be or")
        job = engine.submit(Request(ids, 6, temperature=0, attention=True), q.put)
        collect(q)
        full = torch.tensor([ids + job.generated])
        _, attentions = model(full, return_attention=True)
        for t in range(len(job.generated)):
            query = len(ids) - 1 + t  # the position whose output chose token t
            want = torch.stack([a[0, :, query, : query + 1] for a in attentions])
            torch.testing.assert_close(job.weights[t].float(), want, atol=2e-3, rtol=0)
        assert engine.recording(job.id)["job"] is job
    finally:
        engine.close()


class Bytes:
    """A byte-level tokenizer: one id per UTF-8 byte (as GPT-2's and Llama 3's are)."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_stream_holds_back_half_characters_and_stop_prefixes():
    stream = TextStream(Bytes(), stops=["END"])
    shown = [stream.push(b) for b in "毒蛇 E".encode()]
    assert shown == ["", "", "毒", "", "", "蛇", " ", ""]  # "E" may be the start of END
    assert stream.push(ord("a")) == "Ea"
    stream = TextStream(Bytes(), stops=["END"])
    text = "".join(stream.push(b) for b in "我 用 毒 ENDabc".encode())
    assert (text, stream.stopped) == ("我 用 毒 ", True)
    stream = TextStream(Bytes(), stops=["END"])
    assert "".join(stream.push(b) for b in b"EN") == ""
    assert stream.flush() == "EN"  # the reply ended: what was held back is released


def test_chat_templates_render_as_the_model_expects():
    smollm = (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
        "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    messages = [{"role": "user", "content": "今天 下雨"}]
    assert render_chat(smollm, messages) == (
        "<|im_start|>user\n今天 下雨<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_chat(None, messages) == "user: 今天 下雨\nassistant:"
    assert PLAIN_TEMPLATE in (PLAIN_TEMPLATE,)
    with pytest.raises(ValueError, match="refused the conversation: no system"):
        render_chat("{{ raise_exception('no system') }}", messages)
    with pytest.raises(ValueError, match="the chat template failed"):
        render_chat("{% for %}", messages)
    # the sandbox: a template cannot reach Python's internals
    with pytest.raises(ValueError):
        render_chat("{{ messages.__class__.__mro__[1].__subclasses__() }}", messages)


def test_chat_templates_are_found_where_models_keep_them(tmp_path):
    from attnkit.serve import chat_template_for

    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    assert chat_template_for(tmp_path) == template
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert chat_template_for(tmp_path) == template
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert chat_template_for(tmp_path) == "{{ messages[0]['content'] }}"
    assert chat_template_for(tmp_path / "nothing-here") is None


@pytest.mark.needs("smollm2")
def test_the_smollm2_file_carries_its_template():
    from attnkit.serve import chat_template_for

    text = render_chat(chat_template_for("smollm2"), [{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_serve_binds_to_localhost_by_default():
    from attnkit.cli import build_parser

    args = build_parser().parse_args(["serve", "model.gguf"])
    assert (args.host, args.port, args.max_batch) == ("127.0.0.1", 8000, 8)
