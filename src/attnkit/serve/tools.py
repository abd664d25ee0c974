"""Tool calls: ``tools`` with ``tool_choice`` ``"required"`` or a named function, answered as
OpenAI's ``tool_calls`` by constrained decoding.

The model is told about the tools in a system message (their names, descriptions and parameter
schemas, and the shape of a call), and its answer is held by the grammar of a call: a JSON
object ``{"name": one of the offered names, "arguments": an object that the function's
``parameters`` schema accepts}`` (:mod:`attnkit.serve.grammar`). So every call names a real
function and its arguments validate, whatever the model would have written. ``"none"`` answers
in text, as if no tools were given. ``"auto"`` (the model decides between text and a call) is
refused: telling a call from text needs the model's own tool-call format, which attnkit does not
parse. A ``tool`` message in the next turn goes through the chat template like any other.
"""

from __future__ import annotations

import json
import time

from attnkit.serve.schema import ChatBody, Tool, ToolChoice, error

__all__ = ["call_schema", "chosen_tools", "tool_calls", "tools_message"]


def chosen_tools(body: ChatBody) -> list[Tool] | None:
    """The tools the answer must call one of (None: a text answer), as ``tool_choice`` says."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise error(400, "tool_choice needs tools", "tool_choice")
        return None
    choice = "auto" if choice is None else choice
    if choice == "none":
        return None
    if choice == "auto":
        raise error(
            400,
            "tool_choice 'auto' is not supported: attnkit does not parse a model's own "
            "tool-call format; send tool_choice 'required' or name a function",
            "tool_choice",
        )
    if isinstance(choice, ToolChoice):
        named = [t for t in body.tools if t.function.name == choice.function.name]
        if not named:
            offered = ", ".join(t.function.name for t in body.tools)
            raise error(
                400,
                f"tool_choice names {choice.function.name!r}, which is not among the tools "
                f"({offered})",
                "tool_choice",
            )
        return named
    return list(body.tools)


def _parameters(tool: Tool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def call_schema(tools: list[Tool]) -> dict:
    """The JSON schema of one call of one of ``tools``."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def tools_message(tools: list[Tool]) -> str:
    """The system message that tells the model which functions it may call, and how."""
    lines = [
        "You can call functions. Answer with one JSON object "
        '{"name": <function name>, "arguments": <an object of its parameters>}.',
        "Functions:",
    ]
    for tool in tools:
        about = f" {tool.function.description}" if tool.function.description else ""
        parameters = json.dumps(_parameters(tool), ensure_ascii=False)
        lines.append(f"- {tool.function.name}:{about} Parameters: {parameters}")
    return "\n".join(lines)


def tool_calls(text: str, index: int) -> list[dict] | None:
    """OpenAI's ``tool_calls`` for an answer that is one complete call (None otherwise: an
    answer cut short by ``max_tokens``)."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    arguments = json.dumps(call["arguments"], ensure_ascii=False)
    function = {"name": call["name"], "arguments": arguments}
    return [{"id": f"call_{time.time_ns():x}_{index}", "type": "function", "function": function}]
