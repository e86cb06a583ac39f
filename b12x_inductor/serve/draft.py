"""Prompt-lookup (n-gram) drafts: speculative decoding without a second model.

The last n tokens of a sequence (n from `max_ngram` down to `min_ngram`) are looked up earlier in the same
sequence (prompt and output so far); the tokens that followed the most recent earlier occurrence are the
draft. The verify step checks all drafts in one forward pass, so greedy outputs stay those of plain decoding.
"""

from __future__ import annotations


def prompt_lookup(tokens: list[int], num_draft: int, *, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to `num_draft` tokens predicted to follow `tokens`; [] when no n-gram matches (a plain scan)."""
    if num_draft <= 0:
        return []
    size = len(tokens)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        tail = tokens[size - n:]
        for start in range(size - n - 1, -1, -1):  # most recent first; a token must follow the match
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + num_draft]
    return []


class NgramIndex:
    """`prompt_lookup` in O(max_ngram) per new token: for every n-gram it keeps where its latest continuation
    starts. One per request; the sequence it is given may only grow between calls."""

    def __init__(self, *, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"NgramIndex: need 1 <= min_ngram <= max_ngram; got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> position of the token after its latest occurrence
        self._indexed = 0  # tokens[:_indexed] are indexed

    def draft(self, tokens: list[int], num_draft: int) -> list[int]:
        for i in range(max(self._indexed, 1), len(tokens)):  # n-grams ending at i - 1 are followed by token i
            for n in range(self.min_ngram, min(self.max_ngram, i) + 1):
                self._next[tuple(tokens[i - n:i])] = i
        self._indexed = len(tokens)
        if num_draft <= 0:
            return []
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            start = self._next.get(tuple(tokens[len(tokens) - n:]))
            if start is not None:
                return tokens[start:start + num_draft]
        return []
