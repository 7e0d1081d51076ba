"""Word n-gram repetition of a completion, on nltk's n-gram utilities (no nltk data needed).

    fraction = 1 - |unique n-grams| / |n-grams|     over the lower-cased, white-space-split words

0 for a completion with fewer than n words or no repeated n-gram; it approaches 1 for a
completion that repeats one n-gram. The `repetition` reward is max_penalty x fraction (Open-R1's
repetition penalty), and the trainer logs the 4-gram fraction as `response/repetition_4gram`.
"""

from __future__ import annotations


def repeated_ngram_fraction(text: str, n: int) -> float:
    """Share of the word n-grams of `text` that repeat an earlier one."""
    from nltk.util import ngrams  # imported here: nltk takes 0.4 s, every config load would pay

    words = text.lower().split()
    grams = list(ngrams(words, n))
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)
