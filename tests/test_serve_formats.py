"""Tools and reasoning in the model's own format: a chat template that takes ``tools`` (Qwen3's,
as llama.cpp keeps it in ``models/templates``) renders them exactly as ``transformers``'
``apply_chat_template(..., tools=...)`` does, the served answer is written in that template's
``<tool_call>`` format and read back as OpenAI's ``tool_calls``; a template that opens
``<think>`` has the reasoning split off on every API (``reasoning_content``, a ``reasoning``
item, a ``thinking`` block). The formats' grammars and readers are checked token by token."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest

from attnkit.interop import load_tokenizer_for
from attnkit.serve import render_chat
from attnkit.serve.formats import FORMATS, OWN, Thinking, takes_tools, tool_format
from servers import serving

pytestmark = pytest.mark.needs("smollm2")

TEMPLATES = Path(__file__).parent / "data" / "templates"
QWEN3 = (TEMPLATES / "qwen3.jinja").read_text()
THINKER = "Think step by step."  # a system message that makes the test's template open <think>
# Qwen3's template, opening the reasoning in the prompt when the system message asks for it (as
# the DeepSeek-R1 distills' templates always do)
FORCED = QWEN3.replace(
    "{{- '<|im_start|>assistant\\n' }}",
    "{{- '<|im_start|>assistant\\n' }}{%- if messages[0].content == '" + THINKER + "' %}"
    "{{- '<think>\\n' }}{%- endif %}",
)
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": CITY,
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}
ASKED = [{"role": "user", "content": "What is the weather in Paris?"}]


def _transformers(template: str, messages, tools=None) -> str:
    """The prompt ``transformers``' ``apply_chat_template`` writes, with SmolLM2's tokenizer."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=load_tokenizer_for("smollm2").hf)
    hf.chat_template = template
    return hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)


CONVERSATION = [
    {"role": "system", "content": "You help with the weather."},
    *ASKED,
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 20 C"},
]


def test_a_template_that_takes_tools_renders_them_as_transformers_does():
    assert takes_tools(QWEN3) and not takes_tools(None)
    assert tool_format(QWEN3).name == "hermes" and tool_format(None) is OWN
    names = {
        t: tool_format((TEMPLATES / f"{t}.jinja").read_text()).name
        for t in ("qwen3", "mistral-nemo", "llama3.2")
    }
    assert names == {"qwen3": "hermes", "mistral-nemo": "mistral", "llama3.2": "llama3"}
    for template in (QWEN3, (TEMPLATES / "llama3.2.jinja").read_text()):
        for messages, tools in ((ASKED, [WEATHER, TIME]), (CONVERSATION, [WEATHER]), (ASKED, None)):
            ours = (
                render_chat(template, messages, tools=tools)
                if tools
                else render_chat(template, messages)
            )
            assert ours == _transformers(template, messages, tools)
    assert "<tools>" in render_chat(QWEN3, ASKED, tools=[WEATHER])


def test_each_format_reads_back_what_its_grammar_writes():
    """Every format's grammar accepts its own calls (two where it allows several), its reader
    gives them back, and a call cut short, another function or text where a call must be are
    refused token by token."""
    from attnkit.serve.grammar import COMPACT, Grammars
    from attnkit.serve.schema import Tool
    from attnkit.serve.tools import call_schema

    tokenizer = load_tokenizer_for("smollm2")
    eos = tokenizer.hf.token_to_id("<|im_end|>")
    grammars = Grammars(tokenizer, 49152, {eos})
    tools = [Tool.model_validate(WEATHER), Tool.model_validate(TIME)]

    def walk(rule: str, text: str, end: bool) -> str:
        matcher = grammars.matcher(grammars.lark(rule))
        for i in tokenizer.encode(text, add_special_tokens=False) + ([eos] if end else []):
            try:
                matcher.accept(i)
            except RuntimeError:
                return "refused"
        return "done" if matcher.done else "open"

    calls = [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_time", "arguments": {"zone": "CET"}},
    ]
    for form in (*FORMATS, OWN):
        written = [json.dumps({"name": c["name"], form.arguments: c["arguments"]}) for c in calls]
        one = form.start + form.open + written[0] + form.close + form.end
        assert form.read(one) == calls[:1], form.name
        rule = "start: answer\n" + form.lark(call_schema(tools, form.arguments), False)
        assert walk(rule, one, end=True) == "done", form.name
        assert walk(rule, one[: len(one) // 2], end=True) == "refused", form.name
        assert walk(rule, "It is sunny.", end=True) == "refused", form.name
        other = one.replace("get_weather", "get_rain")
        assert (
            walk(rule, other, end=True) == "refused" and form.read(other)[0]["name"] == "get_rain"
        )
        if form.separator is None:
            continue
        both = form.start + form.separator.join(form.open + w + form.close for w in written)
        both += form.end
        assert form.read(both) == calls and walk(rule, both, end=True) == "done", form.name
        single = "start: answer\n" + form.lark(call_schema(tools, form.arguments), False, False)
        assert walk(single, both, end=True) == "refused", form.name  # parallel_tool_calls false

    # reasoning first, then the answer's grammar: free while thinking, held after </think>
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    answer = f"answer: %json {json.dumps({**schema, 'x-guidance': COMPACT})}"
    for opened, prefix in ((True, ""), (False, "<think>\n")):
        rule = Thinking(opened).lark(answer)
        assert walk(rule, prefix + 'Say {"a": 1}? Yes.\n</think>\n\n{"a": 1}', False) == "done"
        assert walk(rule, prefix + "No.\n</think>\n\nIt is one.", True) == "refused"
    assert walk(Thinking(False).lark(answer), '{"a": 2}', False) == "done"  # no reasoning at all


def test_reasoning_is_split_whole_and_as_it_streams():
    thinking = Thinking(opened=False)
    text = "<think>\nParis is in France.\n</think>\n\nThe capital is Paris."
    assert thinking.split(text) == ("Paris is in France.", "The capital is Paris.")
    assert thinking.split("The capital is Paris.") == (None, "The capital is Paris.")
    assert Thinking(opened=True).split("still thinking\n") == ("still thinking", "")
    for cut in range(len(text) + 1):
        for step in (1, 3, 7):
            stream, parts = thinking.stream(), []
            for at in range(0, cut, step):
                parts += stream.push(text[at : min(at + step, cut)])
            parts += stream.push(text[cut:]) + stream.push("", final=True)
            said = {
                k: "".join(t for kind, t in parts if kind == k) for k in ("reasoning", "content")
            }
            assert (said["reasoning"], said["content"]) == thinking.split(text), (cut, step)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("formats")
    (folder / "template.jinja").write_text(FORCED)
    with serving(folder / "serve.log", "--chat-template", str(folder / "template.jinja")) as url:
        yield url


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


def test_the_served_call_is_written_in_the_templates_format(oai, server):
    """The model answers in Qwen's <tool_call> format (its tokens say so), read back as
    tool_calls; the next turn renders the call and its result as transformers would."""
    reply = oai.chat.completions.create(
        model="smollm2",
        messages=ASKED,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=100,
        temperature=0,
        logprobs=True,
    )
    answer = reply.choices[0]
    written = "".join(t.token for t in answer.logprobs.content)
    assert written.startswith("<tool_call>\n{") and written.rstrip().endswith("</tool_call>")
    assert answer.finish_reason == "tool_calls" and answer.message.content is None
    for call in answer.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time")
        if call.function.name == "get_weather":
            jsonschema.validate(json.loads(call.function.arguments), CITY)

    follow = [
        *ASKED,
        {**answer.message.model_dump(exclude_none=True), "content": ""},
        {"role": "tool", "tool_call_id": answer.message.tool_calls[0].id, "content": "Sunny, 20 C"},
    ]
    after = oai.chat.completions.create(
        model="smollm2",
        messages=follow,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=20,
        temperature=0,
    )
    for message in follow:  # as transformers is handed them: arguments as objects
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    prompt = _transformers(QWEN3, follow, [WEATHER])
    count = httpx.post(server + "/tokenize", json={"content": prompt}).json()["count"]
    assert after.usage.prompt_tokens == count and after.choices[0].message.content


def test_reasoning_comes_apart_on_every_api(oai, server):
    """The template opens <think>: what the model writes is reasoning (it never closes it in 16
    tokens), the same text /v1/completions gives for the prompt, whole and streamed; a
    reasoning item in Responses, a thinking block in Messages."""
    messages = [
        {"role": "system", "content": THINKER},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    prompt = _transformers(FORCED, messages)
    assert prompt.endswith("<think>\n")
    plain = oai.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0)
    expected = plain.choices[0].text.strip("\n")
    assert expected and "</think>" not in expected

    reply = oai.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=16, temperature=0
    )
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] == expected and message.content == ""
    chunks = list(
        oai.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=16, temperature=0, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thought = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert thought == expected and not "".join(d.content or "" for d in deltas)
    assert sum(1 for d in deltas if (d.model_extra or {}).get("reasoning_content")) > 3

    response = oai.responses.create(
        model="smollm2",
        instructions=THINKER,
        temperature=0,
        input="What is the capital of France?",
        max_output_tokens=16,
    )
    (item,) = response.output
    assert item.type == "reasoning" and item.content[0].text == expected
    events = list(
        oai.responses.create(
            model="smollm2",
            instructions=THINKER,
            temperature=0,
            input="What is the capital of France?",
            max_output_tokens=16,
            stream=True,
        )
    )
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == expected and events[-1].response.output[0].type == "reasoning"

    claude = anthropic.Anthropic(base_url=server, api_key="none", max_retries=0)
    asked = [{"role": "user", "content": "What is the capital of France?"}]
    said = claude.messages.create(
        model="smollm2",
        max_tokens=16,
        system=THINKER,
        messages=asked,
        extra_body={"temperature": 0},
    )
    assert [b.type for b in said.content] == ["thinking"] and said.content[0].thinking == expected
    with claude.messages.stream(
        model="smollm2",
        max_tokens=16,
        system=THINKER,
        messages=asked,
        extra_body={"temperature": 0},
    ) as stream:
        thoughts = [
            e.delta.thinking
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
        ]
    assert "".join(thoughts) == expected
