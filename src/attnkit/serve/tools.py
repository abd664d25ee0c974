"""Tool calls: ``tools`` with ``tool_choice`` ``"auto"``, ``"required"`` or a named function,
answered as OpenAI's ``tool_calls`` by constrained decoding.

A chat template that takes ``tools`` lays them out itself, and the model answers in the format
that template teaches (:mod:`attnkit.serve.formats`: Hermes/Qwen ``<tool_call>``, Mistral's
``[TOOL_CALLS]``, Llama 3's JSON). Any other template gets the tools in a system message of
attnkit's own (their names, descriptions and parameter schemas, and the shape of a call: a bare
JSON object). Either way the answer is held by the grammar of the format's calls, each
``{"name": one of the offered names, <arguments>: an object that the function's ``parameters``
schema accepts}`` (:mod:`attnkit.serve.grammar`), so every call names a real function and its
arguments validate, whatever the model would have written. ``"none"`` answers in text, as if no
tools were given. ``"auto"`` (the default when tools are given) lets the model choose at its
first token: the grammar is "calls, or text that does not begin like one", so an answer is
either whole calls (``tool_calls``) or plain text (``content``), never a half-call to guess at.
Several calls in one answer are allowed where the format has a separator, unless
``parallel_tool_calls`` is false.
"""

from __future__ import annotations

import json

from attnkit.serve.schema import ChatBody, Tool, ToolChoice, error

__all__ = ["call_schema", "chosen_tools", "tools_message", "with_tools"]


def chosen_tools(body: ChatBody) -> tuple[list[Tool] | None, bool]:
    """The tools the answer may call one of (None: a text answer), as ``tool_choice`` says, and
    whether text is allowed instead (``"auto"``)."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise error(400, "tool_choice needs tools", "tool_choice")
        return None, True
    choice = "auto" if choice is None else choice
    if choice == "none":
        return None, True
    if choice == "auto":
        return list(body.tools), True
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
        return named, False
    return list(body.tools), False


def _parameters(tool: Tool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def call_schema(tools: list[Tool], arguments: str = "arguments") -> dict:
    """The JSON schema of one call of one of ``tools`` (its arguments under ``arguments``)."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, arguments: _parameters(t)},
            "required": ["name", arguments],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def tools_message(tools: list[Tool]) -> str:
    """The system message that tells the model which functions it may call, and how."""
    lines = [
        "You can call functions. When one of them answers the request, reply with only one "
        'JSON object {"name": <function name>, "arguments": <an object of its parameters>}; '
        "otherwise reply in text.",
        "Functions:",
    ]
    for tool in tools:
        about = f" {tool.function.description}" if tool.function.description else ""
        parameters = json.dumps(_parameters(tool), ensure_ascii=False)
        lines.append(f"- {tool.function.name}:{about} Parameters: {parameters}")
    return "\n".join(lines)


def with_tools(messages: list[dict], tools: list[Tool]) -> list[dict]:
    """``messages`` with :func:`tools_message` at the start of the system message (one is added
    if the conversation has none)."""
    text = tools_message(tools)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = {**messages[0], "content": text + "\n\n" + messages[0]["content"]}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
