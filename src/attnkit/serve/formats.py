"""How a model writes tool calls and reasoning: one table of the formats chat templates teach,
each read both ways (the grammar that holds an answer to it, and the parser that reads the calls
back).

A chat template that takes ``tools`` (it reads the variable, as ``transformers``'
``apply_chat_template(..., tools=...)`` passes it) lays the tools out in the model's own words,
and the model answers in the format it was trained on; :func:`tool_format` finds which one by
the marker the template writes. A template that knows no tools gets attnkit's own system message
(:mod:`attnkit.serve.tools`) and answers with a bare JSON call.

A template that writes ``<think>`` (Qwen3, SmolLM3, the DeepSeek-R1 distills) has a reasoning
model behind it: its answer may begin with reasoning between ``<think>`` and ``</think>`` (or
begin inside it, when the template opens it in the prompt). :class:`Thinking` splits it off, whole
or token by token, and the grammar of a JSON schema or a call applies after it ends.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from attnkit.serve.grammar import COMPACT

__all__ = [
    "FORMATS",
    "OWN",
    "Reading",
    "Thinking",
    "ToolFormat",
    "takes_tools",
    "thinking_for",
    "tool_format",
]


@dataclass(frozen=True)
class ToolFormat:
    """Calls written as ``start``, then each call's JSON object ``{"name", <arguments>}``
    between ``open`` and ``close`` (``separator`` between calls; None: one call only), then
    ``end``."""

    name: str
    marker: str | None  # what a template of this format writes (None: attnkit's own)
    arguments: str  # the key of a call's arguments
    start: str = ""
    open: str = ""
    close: str = ""
    separator: str | None = None
    end: str = ""

    def lark(self, schema: dict, text_allowed: bool, parallel: bool = True) -> str:
        """The Lark rule ``answer`` (llguidance's grammar) of calls whose JSON follows
        ``schema`` (several when ``parallel`` and the format allows); with ``text_allowed``, of
        that or of text that does not begin like a call."""
        call = json.dumps({**schema, "x-guidance": COMPACT})
        several = parallel and self.separator is not None
        more = f" ({_quote(self.separator)} call)*" if several else ""
        rules = [
            f"calls: {_quote(self.start)} call{more} {_quote(self.end)}",
            f"call: {_quote(self.open)} %json {call} {_quote(self.close)}",
        ]
        if not text_allowed:
            return "answer: calls\n" + "\n".join(rules)
        first = (self.start or self.open or "{")[0]
        text = f"text: /[^{_regex_char(first)}\\s](.|\\n)*/"
        return "answer: calls | text\n" + "\n".join([*rules, text])

    def read(self, text: str) -> list[dict] | None:
        """The calls ``[{"name", "arguments"}]`` of an answer written in this format (None: it is
        not one, as an answer cut short)."""
        rest, calls, decoder = text.strip(), [], json.JSONDecoder()
        if not rest.startswith(self.start):
            return None
        rest = rest[len(self.start) :]
        while True:
            if not rest.startswith(self.open):
                return None
            try:
                call, used = decoder.raw_decode(rest[len(self.open) :])
            except ValueError:
                return None
            rest = rest[len(self.open) + used :]
            if not rest.startswith(self.close) or not isinstance(call, dict):
                return None
            rest = rest[len(self.close) :]
            if "name" not in call or self.arguments not in call:
                return None
            calls.append({"name": call["name"], "arguments": call[self.arguments]})
            if self.separator is None or not rest.startswith(self.separator):
                break
            rest = rest[len(self.separator) :]
        return calls if rest.strip() == self.end.strip() else None


# The formats chat templates teach, the first whose marker a template writes is its format.
FORMATS = (
    # Hermes 2/3, Qwen 2.5, Qwen3, QwQ: <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>
    ToolFormat(
        "hermes",
        "<tool_call>",
        "arguments",
        open="<tool_call>\n",
        close="\n</tool_call>",
        separator="\n",
    ),
    # Mistral Nemo, Small: [TOOL_CALLS][{"name": ..., "arguments": ...}, ...]
    ToolFormat(
        "mistral", "[TOOL_CALLS]", "arguments", start="[TOOL_CALLS][", separator=", ", end="]"
    ),
    # Llama 3.1-3.3's JSON tool calling: {"name": ..., "parameters": ...}, one call
    ToolFormat("llama3", '"parameters": dictionary of argument name', "parameters"),
)
OWN = ToolFormat("attnkit", None, "arguments")  # a bare call, told by attnkit's system message


def takes_tools(template: str | None) -> bool:
    """Whether ``template`` reads a ``tools`` variable (lays tools out itself)."""
    if not template:
        return False
    import jinja2.meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        parsed = ImmutableSandboxedEnvironment().parse(template)
    except Exception:  # a template jinja cannot parse fails when rendered, with its message
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


def tool_format(template: str | None) -> ToolFormat:
    """The format of calls a template teaches (:data:`OWN` when it takes no tools, or writes
    no format this table knows)."""
    if takes_tools(template):
        for form in FORMATS:
            if form.marker in template:
                return form
    return OWN


@dataclass(frozen=True)
class Thinking:
    """A reasoning model's markers, and whether the prompt already opened them (the answer
    begins inside the reasoning)."""

    opened: bool
    begin: str = "<think>"
    end: str = "</think>"

    def lark(self, answer: str | None) -> str:
        """The Lark grammar of reasoning (optional unless the prompt opened it), then ``answer``
        (the rule ``answer``'s grammar; None: free text)."""
        after = "answer" if answer else "/(.|\\n)*/"
        reasoning = "think" if self.opened else f"({_quote(self.begin)} think)?"
        think = f"think[suffix={_quote(self.end)}]: /(.|\\n)*/"  # lazy: ends at the first
        return f"start: {reasoning} /\\n*/ {after}\n{think}\n" + (answer or "")

    def split(self, text: str) -> tuple[str | None, str]:
        """``text`` as (reasoning or None, the answer after it)."""
        if not self.opened:
            stripped = text.lstrip()
            if not stripped.startswith(self.begin):
                return None, text
            text = stripped[len(self.begin) :]
        reasoning, closed, answer = text.partition(self.end)
        return reasoning.strip("\n"), answer.lstrip("\n") if closed else ""

    def stream(self) -> ThinkingStream:
        return ThinkingStream(self)


class ThinkingStream:
    """Text as it comes, told apart as :meth:`Thinking.split` tells the whole: :meth:`push`
    returns [(kind, text)] with kind "reasoning" or "content", holding back what may be the
    start of a marker and the newlines around one."""

    def __init__(self, thinking: Thinking) -> None:
        self.thinking = thinking
        self.state = "reasoning" if thinking.opened else "start"
        self.held, self.fresh = "", True  # fresh: no reasoning shown yet

    def push(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        self.held += text
        out = []
        while self.held or final:
            if self.state == "start":
                stripped, begin = self.held.lstrip(), self.thinking.begin
                if stripped.startswith(begin):
                    self.held, self.state = stripped[len(begin) :], "reasoning"
                elif begin.startswith(stripped) and not final:
                    break  # may still become the marker
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                if self.fresh:
                    self.held = self.held.lstrip("\n")
                reasoning, closed, rest = self.held.partition(self.thinking.end)
                if closed:
                    out.append(("reasoning", reasoning.rstrip("\n")))
                    self.held, self.state = rest, "after"
                    continue
                keep = 0 if final else _partial(reasoning, self.thinking.end)
                shown = reasoning[: len(reasoning) - keep].rstrip("\n")
                out.append(("reasoning", shown))
                self.held = "" if final else reasoning[len(shown) :]
                self.fresh = self.fresh and not shown
                break
            elif self.state == "after":
                self.held = self.held.lstrip("\n")
                if self.held or final:
                    self.state = "content"
                else:
                    break
            else:
                out.append(("content", self.held))
                self.held = ""
                break
        return [(kind, piece) for kind, piece in out if piece]


@dataclass(frozen=True)
class Reading:
    """How an answer is read back: the format of its calls (None: a text answer) and its
    reasoning (None: the model does not reason)."""

    calls: ToolFormat | None = None
    thinking: Thinking | None = None

    def message(self, text: str, finish: str, index: int = 0) -> tuple[dict, str]:
        """The assistant's message for ``text`` (``content``, with ``reasoning_content`` split
        off, and ``tool_calls`` for a whole answer of calls, whose finish is then
        ``tool_calls``), and the finish reason."""
        reasoning, content = self.thinking.split(text) if self.thinking else (None, text)
        message = {"role": "assistant", "content": content, "refusal": None}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        calls = self.calls.read(content) if self.calls and finish == "stop" else None
        if calls:
            stamp = f"{time.time_ns():x}"
            message.update(
                content=None,
                tool_calls=[
                    {
                        "id": f"call_{stamp}_{index}_{i}",
                        "type": "function",
                        "function": {
                            "name": call["name"],
                            "arguments": json.dumps(call["arguments"], ensure_ascii=False),
                        },
                    }
                    for i, call in enumerate(calls)
                ],
            )
            finish = "tool_calls"
        return message, finish


def thinking_for(template: str | None, prompt: str) -> Thinking | None:
    """How a template's model reasons (None: it does not), given the rendered ``prompt``."""
    probe = Thinking(opened=False)
    if not template or probe.begin not in template:
        return None
    opened = prompt.rfind(probe.begin) > prompt.rfind(probe.end)
    return Thinking(opened=opened)


def _partial(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` begin ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _quote(text: str) -> str:
    """A Lark literal for ``text`` (nothing for the empty text)."""
    return json.dumps(text) if text else ""


def _regex_char(c: str) -> str:
    return "\\" + c if c in "\\/.^$|?*+()[]{}-" else ("\\n" if c == "\n" else c)
