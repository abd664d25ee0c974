"""Turning a conversation into a prompt, and generated ids back into text.

A chat model was trained on conversations laid out in one exact way (SmolLM2:
``<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n``). That layout ships with the
model as a Jinja template: in a GGUF file under ``tokenizer.chat_template``, in a Hugging Face
directory in ``tokenizer_config.json`` (or ``chat_template.jinja``). :func:`chat_template_for`
finds it; :func:`render_chat` fills it in a sandboxed Jinja environment, as ``transformers``
does. A model that ships no template (attnkit's own) gets :data:`PLAIN_TEMPLATE`: one
``role: content`` line per message, then ``assistant:``.

:class:`TextStream` turns the ids of a reply into text as they come, holding back half a
UTF-8 character and anything that may be the start of a stop string, so that a client never
receives text it would have to take back.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path

__all__ = ["PLAIN_TEMPLATE", "TextStream", "chat_template_for", "render_chat"]

PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


# Gemma's turns (its GGUF files often ship without a template): a system message goes in front
# of the first user turn, the assistant is "model", each turn ends with <end_of_turn>. The
# tokenizer adds <bos> itself.
GEMMA_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] | trim + '\n\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') "
    "+ message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
# the template an architecture gets when its file has none
BUILT_IN = {"gemma3": GEMMA_TEMPLATE}


def chat_template_for(path: str | os.PathLike[str]) -> str | None:
    """The chat template a model ships with (a GGUF file's ``tokenizer.chat_template``, a
    directory's ``chat_template.jinja`` or ``tokenizer_config.json``), or None. A GGUF file of
    Gemma 3 without one gets Gemma's turns (:data:`GEMMA_TEMPLATE`)."""
    from attnkit.interop.gguf import read_gguf
    from attnkit.interop.pretrained import is_gguf_file, shipped

    path = shipped(Path(path))
    if is_gguf_file(path):
        metadata = read_gguf(path).metadata
        template = metadata.get("tokenizer.chat_template")
        if isinstance(template, str):
            return template
        return BUILT_IN.get(metadata.get("general.architecture"))
    if not path.is_dir():
        return None
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    config = path / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: str):
    raise ValueError(f"the chat template refused the conversation: {message}")


def render_chat(
    template: str | None,
    messages: list[dict[str, str]],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    **variables,
) -> str:
    """The prompt text for ``messages`` ([{"role": ..., "content": ...}, ...]) under
    ``template`` (:data:`PLAIN_TEMPLATE` when None). ``variables`` go to the template as
    ``transformers``' ``apply_chat_template`` passes them (``tools``, Qwen3's
    ``enable_thinking=False``), and it is rendered as there (the same ``tojson``).
    A template error is a ValueError."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson  # transformers' (jinja's own escapes HTML, sorts keys)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template or PLAIN_TEMPLATE).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **variables,
        )
    except jinja2.TemplateError as error:
        raise ValueError(f"the chat template failed: {error}") from None


class TextStream:
    """The text of a growing list of ids, released only when it is final.

    ``push(id)`` returns the new text that can be shown now; ``stopped`` turns True once the
    text contains one of ``stops`` (the text is cut before it, and ``found`` is that stop);
    ``text`` is all released text.
    """

    def __init__(self, tokenizer, stops: list[str] | tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False
        self.found: str | None = None

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        full = self.tokenizer.decode(self.ids)
        for stop in self.stops:
            at = full.find(stop)
            if at >= 0:
                full, self.stopped, self.found = full[:at], True, stop
        if not self.stopped:
            if full.endswith("\ufffd"):
                return ""  # half a UTF-8 character so far: wait for the rest
            full = full[: len(full) - self._held_back(full)]
        new = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += new
        return new

    def flush(self) -> str:
        """The text held back for a stop string that never came (at the end of a reply)."""
        if self.stopped:
            return ""
        full = self.tokenizer.decode(self.ids).rstrip("\ufffd")
        new = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += new
        return new

    def _held_back(self, text: str) -> int:
        """How many trailing characters could still grow into a stop string."""
        held = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:k]):
                    held = k
                    break
        return held
