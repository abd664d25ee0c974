"""Structured output: the tokens a JSON schema allows, as a mask over each step's logits.

``response_format: {"type": "json_schema", ...}`` (and ``json_object``) is answered by
constrained decoding: before each token is drawn, every token that could not continue a text
the schema accepts gets a logit of minus infinity, so whatever is drawn (greedy or sampled)
keeps the answer valid, and the answer ends as soon as the JSON value is complete. The mask
comes from llguidance (the grammar engine behind llama.cpp's and vLLM's guided decoding): it
compiles the schema to a grammar over the tokenizer's own vocabulary and, per step, computes the
allowed tokens in a few milliseconds. Each request of the batch has its own matcher, so the
rows of one batch may follow different schemas, or none.

llguidance was chosen over xgrammar because it needs nothing else installed (xgrammar 0.2.8 pulls
triton and transformers on Linux x86-64) and reads a ``tokenizers`` tokenizer as it is.
"""

from __future__ import annotations

import json

from torch import Tensor

__all__ = ["COMPACT", "Grammars", "Matcher"]

# compact JSON (one space after ':' and ','): with free whitespace a small model can spend its
# tokens on newlines and indentation and never close the value
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Matcher:
    """One request's place in its grammar: :meth:`allow` masks a step's logits, :meth:`accept`
    moves on by the drawn token, :attr:`done` says the value is complete."""

    def __init__(self, matcher, vocab_size: int) -> None:
        import llguidance.torch as guided

        self.matcher = matcher
        self.mask = guided.allocate_token_bitmask(1, vocab_size)
        self._guided = guided

    def allow(self, logits: Tensor) -> Tensor:
        """``logits`` (V,) with every token the grammar forbids at -inf (a new tensor)."""
        self._guided.fill_next_token_bitmask(self.matcher, self.mask, 0)
        masked = logits.float().clone()[None]
        self._guided.apply_token_bitmask_inplace(masked, self.mask)
        return masked[0]

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing may follow (the JSON value is closed)."""
        return self.matcher.is_stopped()


class Grammars:
    """Grammars over one tokenizer's vocabulary (the tokenizer is converted once, at first
    use: about half a second for SmolLM2's 49,152 tokens)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]) -> None:
        self.source, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._tokenizer = None

    def available(self) -> str | None:
        """Why structured output cannot be served (None when it can)."""
        hf = getattr(self.source, "hf", None)
        if hf is None or not hasattr(hf, "to_str"):
            return "structured output needs a tokenizer from the tokenizers library"
        return None

    def _lltokenizer(self):
        if self._tokenizer is None:
            import llguidance

            self._tokenizer = llguidance.LLTokenizer(
                self.source.hf.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_ids or None
            )
        return self._tokenizer

    def json_schema(self, schema: dict) -> str:
        """The grammar of the JSON values ``schema`` accepts; ValueError (one line) for a
        schema llguidance cannot compile."""
        import llguidance

        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults=COMPACT
            )
        except (ValueError, TypeError) as problem:
            raise ValueError(f"the JSON schema cannot be used: {problem}") from None
        message = llguidance.LLMatcher.validate_grammar(grammar, self._lltokenizer())
        if message and not message.startswith("WARNING"):
            first = message.strip().splitlines()[0]
            raise ValueError(f"the JSON schema cannot be used: {first}")
        return grammar

    def lark(self, grammar: str, what: str = "the grammar") -> str:
        """A grammar in llguidance's Lark dialect, checked; ValueError (one line, naming
        ``what``) when it cannot be used."""
        import llguidance

        try:
            compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
        except (ValueError, TypeError) as problem:
            raise ValueError(f"{what} cannot be used: {problem}") from None
        message = llguidance.LLMatcher.validate_grammar(compiled, self._lltokenizer())
        if message and not message.startswith("WARNING"):
            raise ValueError(f"{what} cannot be used: {message.strip().splitlines()[0]}")
        return compiled

    def matcher(self, grammar: str) -> Matcher:
        import llguidance

        matcher = llguidance.LLMatcher(self._lltokenizer(), grammar)
        if matcher.is_error():
            raise ValueError(f"the grammar cannot be used: {matcher.get_error()}")
        return Matcher(matcher, self.vocab_size)
