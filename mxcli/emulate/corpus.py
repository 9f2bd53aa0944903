"""The default training corpus of ``mxcli emulate`` (issue 31 item 4): generated in code from a
fixed seed, identical on every machine and Python version (integer arithmetic only: a
splitmix64 generator, no `random`, no floats, no locale), identified by its sha256.

The text is a small synthetic language with structure at several scales, so a byte-level model
keeps improving over a few hundred steps: a Zipf-distributed vocabulary of made-up words,
sentences with subject-verb agreement (a plural subject takes the verb without ``s``), a
closing clause that repeats the sentence's subject, and exact sums (``17 + 25 = 42.``).
"""

from __future__ import annotations

import functools
import hashlib

__all__ = ["CORPUS_BYTES", "CORPUS_SHA256", "corpus_sha256", "default_corpus"]

CORPUS_BYTES = 1 << 20
# sha256 of `default_corpus()`: pinned by tests/emulate/test_corpus.py, recorded in every report
CORPUS_SHA256 = "323190785a07fe7b88011d3eacac599c2fe2c936db4c769ef7eaa54506e1400e"
_MASK = (1 << 64) - 1


class _SplitMix64:
    """Steele, Lea & Flood (2014) splitmix64: a 64-bit integer generator, the same everywhere."""

    def __init__(self, seed: int) -> None:
        self.s = seed & _MASK

    def next(self) -> int:
        self.s = (self.s + 0x9E3779B97F4A7C15) & _MASK
        z = self.s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n


def _words(rng: _SplitMix64, count: int, syllables: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < count:
        w = "".join(syllables[rng.below(len(syllables))] for _ in range(1 + rng.below(3)))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def _zipf(rng: _SplitMix64, n: int) -> int:
    """Index in [0, n) with weight 1/(i+1), by integer inverse-CDF (no floats)."""
    scale = 1 << 20
    cum = _zipf_table(n, scale)
    r = rng.below(cum[-1])
    lo, hi = 0, n - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if cum[mid] > r:
            hi = mid
        else:
            lo = mid + 1
    return lo


@functools.cache
def _zipf_table(n: int, scale: int) -> tuple[int, ...]:
    total, out = 0, []
    for i in range(n):
        total += scale // (i + 1)
        out.append(total)
    return tuple(out)


@functools.cache
def default_corpus() -> bytes:
    """`CORPUS_BYTES` bytes of the synthetic language (ASCII)."""
    rng = _SplitMix64(31)
    syl = tuple(c + v for c in "bdfgklmnprstvz" for v in ("a", "e", "i", "o", "u", "ai", "ou"))
    nouns = _words(rng, 300, syl)
    verbs = _words(rng, 120, syl)
    adjs = _words(rng, 80, syl)
    dets = ("the", "a", "every", "no", "that")
    parts: list[str] = []
    size = 0
    while size < CORPUS_BYTES:
        if rng.below(5) == 0:
            a, b = rng.below(100), rng.below(100)
            line = f"{a} + {b} = {a + b}."
        else:
            noun = nouns[_zipf(rng, len(nouns))]
            plural = rng.below(3) == 0
            subj = noun + ("s" if plural else "")
            verb = verbs[_zipf(rng, len(verbs))] + ("" if plural else "s")
            adj = adjs[_zipf(rng, len(adjs))] + " " if rng.below(2) else ""
            obj = nouns[_zipf(rng, len(nouns))]
            det = "the" if plural else dets[rng.below(len(dets))]
            line = f"{det} {adj}{subj} {verb} the {obj}"
            if rng.below(3) == 0:
                line += f", and the {subj} {'are' if plural else 'is'} {adjs[rng.below(len(adjs))]}"
            line += "."
        line += "\n" if rng.below(4) == 0 else " "
        parts.append(line)
        size += len(line)
    return "".join(parts).encode("ascii")[:CORPUS_BYTES]


def corpus_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
