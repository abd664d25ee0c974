"""Prompt caching: a new prompt that begins like a recent one reuses that prompt's keys and values.

Chat requests repeat themselves: the same system prompt, the same conversation one turn longer.
The engine runs each prompt alone before it joins the batch (the prefill), and that costs time
in proportion to the prompt's length before the first token comes. :class:`PromptCache` keeps
the prefilled KV caches of recent prompts (least recently used first out, within a budget of
cached tokens); a new prompt that shares at least ``minimum`` leading tokens with one of them
copies those positions' keys and values (each layer's ``KVCache.append``) and runs only the
rest. The result is the same as prefilling the whole prompt: the keys and values of a position
depend on the tokens up to it alone (causal attention), and those are the same tokens.
"""

from __future__ import annotations

from collections import OrderedDict

from attnkit.caches import KVCache
from attnkit.stacks import DecoderCache

__all__ = ["PromptCache"]


class PromptCache:
    """Prefilled caches of recent prompts, at most ``budget`` tokens in all."""

    def __init__(self, budget: int = 16384, minimum: int = 16) -> None:
        self.budget, self.minimum = budget, minimum
        self.entries: OrderedDict[tuple[int, ...], DecoderCache] = OrderedDict()
        self.hits = 0
        self.reused = 0  # positions copied instead of computed, over all hits

    def tokens(self) -> int:
        return sum(len(ids) for ids in self.entries)

    def lookup(self, ids: list[int]) -> tuple[int, DecoderCache | None]:
        """The longest prefix of ``ids`` that a kept prompt shares (at most all but the last
        token, which must run to give the next token's logits): (its length, that prompt's
        cache), or (0, None) below ``minimum`` tokens."""
        best, found = 0, None
        for kept, cache in self.entries.items():
            n = min(len(kept), len(ids) - 1)
            shared = next((i for i in range(n) if kept[i] != ids[i]), n)
            if shared > best:
                best, found = shared, (kept, cache)
        if found is None or best < self.minimum:
            return 0, None
        self.entries.move_to_end(found[0])  # recently used
        self.hits += 1
        self.reused += best
        return best, found[1]

    def store(self, ids: list[int], cache: DecoderCache) -> None:
        """Keep ``cache``, the prefilled cache of prompt ``ids`` (it is only read from now on);
        the least recently used prompts leave while over the budget."""
        if len(ids) < self.minimum or len(ids) > self.budget:
            return
        if not all(isinstance(c, KVCache) for c in cache.self_attn):
            return  # window or linear attention: their state is not per position
        self.entries[tuple(ids)] = cache
        self.entries.move_to_end(tuple(ids))
        while self.tokens() > self.budget:
            self.entries.popitem(last=False)

    @staticmethod
    def fill(cache: DecoderCache, source: DecoderCache, length: int) -> None:
        """Copy the first ``length`` positions of ``source`` into the empty ``cache``."""
        for out, kept in zip(cache.self_attn, source.self_attn, strict=True):
            out.append(kept.k[:, :, :length], kept.v[:, :, :length], kept.positions[:, :length])

    def stats(self) -> dict:
        return {"prompt_cache_hits": self.hits, "prompt_cache_reused_tokens": self.reused}
