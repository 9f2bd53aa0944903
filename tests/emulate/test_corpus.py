"""The built-in corpus is the same bytes on every machine: its sha256 is pinned here."""

from __future__ import annotations

from mxcli.emulate import corpus


def test_corpus_is_pinned() -> None:
    data = corpus.default_corpus()
    assert len(data) == corpus.CORPUS_BYTES == 1 << 20
    assert corpus.corpus_sha256(data) == corpus.CORPUS_SHA256
    assert corpus.CORPUS_SHA256 == (
        "323190785a07fe7b88011d3eacac599c2fe2c936db4c769ef7eaa54506e1400e"
    )
    assert data.isascii() and b" + " in data and b" the " in data
    corpus.default_corpus.cache_clear()
    assert corpus.default_corpus() == data  # regenerated, not only cached


def test_generator_reference_values() -> None:
    """splitmix64 from seed 0: the published first outputs (Vigna's reference C code)."""
    g = corpus._SplitMix64(0)
    assert [g.next() for _ in range(3)] == [
        0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F,
    ]  # fmt: skip
