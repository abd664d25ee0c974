"""The APIs agents speak, against the real ``attnkit serve smollm2`` and called with code nobody
here wrote: OpenAI's Responses API with the official ``openai`` client (whole and streamed,
``previous_response_id``, a tool round trip, a JSON schema) and the ``openai-agents`` loop;
Anthropic's Messages API with the official ``anthropic`` client (``messages.create``,
``messages.stream``, ``count_tokens``, ``x-api-key``); ``GET /metrics`` read by
``prometheus_client``'s own parser. One question asked on the three routes gets the same tokens,
and bad input gets each API's own error shape while the server stays up."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from servers import serving

pytestmark = pytest.mark.needs("smollm2")

KEY = "sk-test-agents"
QUESTION = "What is the capital of France? Answer in one sentence."
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}},
    "required": ["city"],
    "additionalProperties": False,
}
CHAT_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now in a city.",
        "parameters": CITY,
    },
}
RESPONSES_TOOL = {"type": "function", **CHAT_TOOL["function"]}
MESSAGES_TOOL = {
    "name": "get_weather",
    "description": "The weather now in a city.",
    "input_schema": CITY,
}
GREEDY = {"temperature": 0}  # Anthropic's current API has no temperature: sent as an extra


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    headers = {"Authorization": f"Bearer {KEY}"}
    with serving(log, "--api-key", KEY, "--max-body", "65536", headers=headers) as url:
        yield url


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0)


def test_the_same_question_gets_the_same_tokens_on_every_route(oai, claude):
    """Chat completions, Responses and Messages, whole and streamed: one greedy text and one
    token count."""
    messages = [{"role": "user", "content": QUESTION}]
    chat = oai.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=24, temperature=0
    )
    text, tokens = chat.choices[0].message.content, chat.usage.completion_tokens
    cut = chat.choices[0].finish_reason == "length"
    assert text and tokens > 3

    response = oai.responses.create(
        model="smollm2", input=QUESTION, max_output_tokens=24, temperature=0
    )
    assert response.output_text == text and response.usage.output_tokens == tokens
    assert response.status == ("incomplete" if cut else "completed")
    assert response.usage.input_tokens == chat.usage.prompt_tokens

    events = list(
        oai.responses.create(
            model="smollm2", input=QUESTION, max_output_tokens=24, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{response.status}"
    assert kinds.count("response.output_text.delta") > 3
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == text and events[-1].response.output_text == text
    assert [e.sequence_number for e in events] == list(range(len(events)))

    message = claude.messages.create(
        model="smollm2", max_tokens=24, messages=messages, extra_body=GREEDY
    )
    assert message.content[0].text == text and message.usage.output_tokens == tokens
    assert message.stop_reason == ("max_tokens" if cut else "end_turn")
    with claude.messages.stream(
        model="smollm2", max_tokens=24, messages=messages, extra_body=GREEDY
    ) as stream:
        pieces = [e.delta.text for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "".join(pieces) == text and final.content[0].text == text and len(pieces) > 3
    assert final.usage.output_tokens == tokens and final.stop_reason == message.stop_reason

    word = text.split()[2]  # a stop sequence the answer meets: cut before it, and named
    stopped = claude.messages.create(
        model="smollm2",
        max_tokens=24,
        messages=messages,
        stop_sequences=[word, "@@"],
        extra_body=GREEDY,
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text[: text.index(word)]

    counted = claude.messages.count_tokens(model="smollm2", messages=messages)
    assert counted.input_tokens == chat.usage.prompt_tokens == message.usage.input_tokens


def test_responses_keep_a_conversation_for_previous_response_id(oai, server):
    first = oai.responses.create(
        model="smollm2",
        input="My name is Ada.",
        instructions="Be brief.",
        max_output_tokens=12,
        temperature=0,
    )
    follow = oai.responses.create(
        model="smollm2",
        input="What is my name?",
        max_output_tokens=12,
        temperature=0,
        previous_response_id=first.id,
    )
    # the follow-up's prompt holds the first turn (question and answer) as the chat API renders it
    chat = oai.chat.completions.create(
        model="smollm2",
        max_tokens=12,
        temperature=0,
        messages=[
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
    )
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    assert follow.output_text == chat.choices[0].message.content

    assert oai.responses.retrieve(first.id).output_text == first.output_text
    oai.responses.delete(first.id)
    for call in (
        lambda: oai.responses.retrieve(first.id),
        lambda: oai.responses.create(
            model="smollm2", input="Again?", previous_response_id=first.id
        ),
    ):
        with pytest.raises(openai.NotFoundError) as refused:
            call()
        assert "is kept here" in refused.value.body["message"]
    unkept = oai.responses.create(model="smollm2", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unkept.id)


def test_a_tool_round_trip_on_responses_and_messages(oai, claude):
    """The call names the function with arguments its schema accepts, whole and streamed; the
    result goes back and the model answers in text."""
    asked = "What is the weather in Paris?"
    call = oai.responses.create(
        model="smollm2",
        input=asked,
        tools=[RESPONSES_TOOL],
        tool_choice="required",
        temperature=0,
        max_output_tokens=40,
    )
    (item,) = call.output
    assert item.type == "function_call" and item.name == "get_weather"
    jsonschema.validate(json.loads(item.arguments), CITY)
    streamed = list(
        oai.responses.create(
            model="smollm2",
            input=asked,
            tools=[RESPONSES_TOOL],
            tool_choice="required",
            temperature=0,
            max_output_tokens=40,
            stream=True,
        )
    )
    (delta,) = [e for e in streamed if e.type == "response.function_call_arguments.delta"]
    assert delta.delta == item.arguments and streamed[-1].type == "response.completed"
    answer = oai.responses.create(
        model="smollm2",
        previous_response_id=call.id,
        tools=[RESPONSES_TOOL],
        tool_choice="none",
        input=[{"type": "function_call_output", "call_id": item.call_id, "output": "Sunny, 20 C"}],
        temperature=0,
        max_output_tokens=30,
    )
    assert answer.output_text and answer.output[0].type == "message"

    messages = [{"role": "user", "content": asked}]
    used = claude.messages.create(
        model="smollm2",
        max_tokens=40,
        messages=messages,
        tools=[MESSAGES_TOOL],
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    )
    (block,) = used.content
    assert used.stop_reason == "tool_use" and block.type == "tool_use"
    assert block.name == "get_weather" and json.loads(item.arguments) == block.input
    with claude.messages.stream(
        model="smollm2",
        max_tokens=40,
        messages=messages,
        tools=[MESSAGES_TOOL],
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    ) as stream:
        assert stream.get_final_message().content[0].input == block.input
    result = {"type": "tool_result", "tool_use_id": block.id, "content": "Sunny, 20 C"}
    after = claude.messages.create(
        model="smollm2",
        max_tokens=30,
        tools=[MESSAGES_TOOL],
        messages=[
            *messages,
            {"role": "assistant", "content": [block]},
            {"role": "user", "content": [result]},
        ],
        tool_choice={"type": "none"},
        extra_body=GREEDY,
    )
    assert after.content[0].type == "text" and after.content[0].text


def test_a_json_schema_holds_on_responses_and_messages(oai, claude):
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 30}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    form = {"format": {"type": "json_schema", "name": "capital", "schema": schema}}
    response = oai.responses.create(
        model="smollm2", input=QUESTION, text=form, temperature=0, max_output_tokens=40
    )
    jsonschema.validate(json.loads(response.output_text), schema)
    message = claude.messages.create(
        model="smollm2",
        max_tokens=40,
        messages=[{"role": "user", "content": QUESTION}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    assert json.loads(message.content[0].text) == json.loads(response.output_text)


def test_an_agent_framework_runs_its_loop_with_a_tool(server):
    """openai-agents' Runner: the model calls the tool, reads its result, answers."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    asked = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather now in a city."""
        asked.append(city)
        return f"It is sunny and 20 C in {city}."

    client = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model="smollm2", openai_client=client),
        model_settings=ModelSettings(temperature=0, max_tokens=60, tool_choice="required"),
        reset_tool_choice=True,
    )
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    kinds = [type(item).__name__ for item in result.new_items]
    assert asked == ["Paris"] and kinds == [
        "ToolCallItem",
        "ToolCallOutputItem",
        "MessageOutputItem",
    ]
    assert isinstance(result.final_output, str) and result.final_output


def _metrics(server) -> dict:
    text = httpx.get(server + "/metrics", headers={"x-api-key": KEY}).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_bad_input_gets_each_apis_error_shape_and_metrics_count_it(oai, server):
    before = _metrics(server)
    key = {"x-api-key": KEY}
    post = lambda path, body, headers=key: httpx.post(server + path, json=body, headers=headers)  # noqa: E731
    message = {"model": "smollm2", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}

    cases = [  # (path, body, headers, status, what the message says)
        (
            "/v1/responses",
            {"input": [{"type": "image_generation_call"}]},
            key,
            400,
            "unknown item type 'image_generation_call'",
        ),
        (
            "/v1/responses",
            {"input": "Hi", "previous_response_id": "resp_none"},
            key,
            404,
            "no response 'resp_none'",
        ),
        (
            "/v1/responses",
            {"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]},
            key,
            400,
            "which no function_call",
        ),
        (
            "/v1/responses",
            {"input": "Hi", "tools": [{"type": "web_search"}]},
            key,
            400,
            "only function tools",
        ),
        (
            "/v1/messages",
            {
                **message,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "toolu_x", "content": "x"}
                        ],
                    }
                ],
            },
            key,
            400,
            "which no tool_use",
        ),
        ("/v1/messages", {**message, "top_k": 5}, key, 400, "top_k is not supported"),
        ("/v1/messages", {**message, "model": "claude-opus"}, key, 404, "serves 'smollm2'"),
        (
            "/v1/messages",
            {k: v for k, v in message.items() if k != "max_tokens"},
            key,
            400,
            "missing field 'max_tokens'",
        ),
        ("/v1/messages", message, {"x-api-key": "wrong"}, 401, "Incorrect API key"),
        ("/v1/messages", {**message, "system": "x" * 70000}, key, 413, "larger than 65536"),
    ]
    for path, body, headers, status, says in cases:
        answer = post(path, body, headers)
        assert answer.status_code == status, (path, body, answer.text)
        shown = answer.json()
        if path == "/v1/messages":
            assert shown["type"] == "error" and says in shown["error"]["message"], shown
            assert shown["error"]["type"] != "api_error"
        else:
            assert says in shown["error"]["message"] and shown["error"]["type"], shown

    # a stream the client cuts after its first event: the server goes on serving
    with httpx.stream(
        "POST",
        server + "/v1/messages",
        headers=key,
        json={**message, "max_tokens": 200, "stream": True},
    ) as cut:
        assert next(cut.iter_lines()).startswith("event: message_start")
    reply = post("/v1/messages", message).json()
    assert reply["content"][0]["type"] == "text" and reply["usage"]["output_tokens"] >= 1
    chat = oai.chat.completions.create(
        model="smollm2", max_tokens=5, messages=[{"role": "user", "content": "Hi"}]
    )

    after = _metrics(server)

    def moved(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    total = "attnkit_requests_total"
    assert moved(total, route="/v1/responses", status="400") == 3
    assert moved(total, route="/v1/responses", status="404") == 1
    assert moved(total, route="/v1/messages", status="400") == 3
    assert moved(total, route="/v1/messages", status="401") == 1
    assert moved(total, route="/v1/messages", status="200") == 2
    assert moved(total, route="/v1/chat/completions", status="200") == 1
    assert moved("attnkit_rejected_requests_total", status="413") == 1
    generated = moved("attnkit_generation_tokens_total")
    assert generated >= reply["usage"]["output_tokens"] + chat.usage.completion_tokens
    assert moved("attnkit_prompt_tokens_total") >= reply["usage"]["input_tokens"] * 2
    assert moved("attnkit_time_to_first_token_seconds_count") >= 2
    assert after[("attnkit_queue_length", ())] == 0
