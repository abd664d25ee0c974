"""The same request gets the same answer from ``attnkit serve``, on its default path (the
integer path of the packed products), whatever else happens: streamed or whole, first or
repeated (a repeat takes its prompt's keys and values from the prompt cache), alone or as one
of six requests decoded together, as one of ``n`` choices, with or without a grammar, for chat
and completions. Bit for bit: the tokens and every log-probability compare equal as floats.
Called with the official ``openai`` client against the real SmolLM2-135M-Instruct."""

from __future__ import annotations

import threading

import httpx
import pytest

from servers import serving

# every case also under every other kernel variant in make test (the server end to end on each)
pytestmark = [pytest.mark.needs("smollm2"), pytest.mark.variants]

# a prompt cache hit needs 16 shared tokens: the chat template gives those, and so does this
SYSTEM = "You answer in one short sentence, plainly, without lists or headings. "
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "people": {"type": "integer"}},
    "required": ["city", "people"],
    "additionalProperties": False,
}
GRAMMAR = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serving(log, "--max-batch", "6") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server + "/v1", api_key="not-needed", max_retries=0)


def chat(client, question: str, *, stream=False, n=1, grammar=False) -> list[tuple]:
    """The ``n`` greedy replies to ``question``: (text, [(token, logprob)]) each."""
    options = dict(response_format=GRAMMAR) if grammar else {}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    reply = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=12, temperature=0, logprobs=True,
        stream=stream, n=n, **options,
    )  # fmt: skip
    if not stream:
        return [
            (c.message.content, [(e.token, e.logprob) for e in c.logprobs.content])
            for c in sorted(reply.choices, key=lambda c: c.index)
        ]
    texts, scores = [""] * n, [[] for _ in range(n)]
    for chunk in reply:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.logprobs and c.logprobs.content:
                scores[c.index] += [(e.token, e.logprob) for e in c.logprobs.content]
    return list(zip(texts, scores, strict=True))


def complete(client, prompt: str, *, stream=False, n=1) -> list[tuple]:
    reply = client.completions.create(
        model="smollm2", prompt=SYSTEM + prompt, max_tokens=12, temperature=0, logprobs=1,
        stream=stream, n=n,
    )  # fmt: skip
    if not stream:
        return [
            (c.text, list(zip(c.logprobs.tokens, c.logprobs.token_logprobs, strict=True)))
            for c in sorted(reply.choices, key=lambda c: c.index)
        ]
    texts, scores = [""] * n, [[] for _ in range(n)]
    for chunk in reply:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.logprobs:
                scores[c.index] += list(
                    zip(c.logprobs.tokens, c.logprobs.token_logprobs, strict=True)
                )
    return list(zip(texts, scores, strict=True))


def hits(server) -> int:
    return httpx.get(server + "/health").json()["prompt_cache_hits"]


@pytest.mark.parametrize("kind", ["chat", "completions", "grammar"])
def test_invariance_first_repeated_streamed_and_n_choices(client, server, kind):
    """First (a cache miss), repeated (a hit), streamed, and three choices of one request: the
    same reply each time."""
    ask = {
        "chat": lambda **o: chat(client, "What is the capital of Italy?", **o),
        "completions": lambda **o: complete(client, "Once upon a time, in a city by the sea,", **o),
        "grammar": lambda **o: chat(client, "Name a city and its people.", grammar=True, **o),
    }[kind]
    before = hits(server)
    first = ask()
    assert first[0][0] and len(first[0][1]) >= 3
    assert ask() == first
    assert ask(stream=True) == first
    assert ask(n=3) == first * 3
    assert ask(n=2, stream=True) == first * 2
    assert hits(server) - before >= 4  # the repeats took their prompt from the cache


def test_invariance_six_requests_together_equal_each_alone(client, server):
    """Six different requests at once (rows of one batch that join as they arrive, chat,
    completions and a grammar among them), then each again alone: the same replies."""
    asks = [
        lambda: chat(client, "What colour is the sky?"),
        lambda: chat(client, "Who wrote Hamlet?"),
        lambda: complete(client, "Once upon a time"),
        lambda: complete(client, "The largest planet is"),
        lambda: chat(client, "Name a city and its people.", grammar=True),
        lambda: chat(client, "What is two plus two?"),
    ]
    together = [None] * len(asks)

    def run(i):
        together[i] = asks[i]()

    steps = httpx.get(server + "/health").json()["steps"]
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(asks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    lengths = [len(reply[0][1]) for reply in together]
    steps = httpx.get(server + "/health").json()["steps"] - steps
    # One after another, each reply's first token comes from its prompt and each other token
    # from a step of its own: sum - 6 steps. Decoded together, a step makes a token for every
    # row: the longest reply's steps, plus those taken while later requests were still joining.
    # Halfway between the two tells them apart.
    alone, longest = sum(lengths) - len(asks), max(lengths) - 1
    assert alone >= 2 * longest + 8, lengths  # room between the two
    assert steps <= (alone + longest) // 2, (steps, lengths)
    for ask, reply in zip(asks, together, strict=True):
        assert ask() == reply
