"""Counts in words, for log lines: `counted(1, "images without labels")` is "1 image without
labels"."""

from __future__ import annotations


def counted(n: int, phrase: str) -> str:
    """`n` and `phrase`, whose noun (its first word in the plural) is singular where `n` is 1:
    "label files without an image" -> "1 label file without an image"."""
    if n != 1:
        return f"{n} {phrase}"
    words = phrase.split(" ")
    for i, word in enumerate(words):
        if word.endswith(("xes", "ches", "shes", "sses")):
            words[i] = word[:-2]
            break
        if word.endswith("s") and not word.endswith("ss"):
            words[i] = word[:-1]
            break
    return f"1 {' '.join(words)}"
