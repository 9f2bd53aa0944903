"""Helpers in a second module: the front-end check follows calls into other modules."""

from __future__ import annotations

import torch

from mxcli.nkisim.nki import language as nl


def checked_size(n):
    if n % 2:
        raise ValueError(f"odd size {n}")  # violates: raise
    return n


def asserted_size(n):
    assert n % 2 == 0, f"odd size {n}"
    return n


class BadConfig:  # violates: class-base
    """A plain class holding a torch dtype, its method called by the kernel."""

    def __init__(self, n):
        self.n = n
        self.dtype = torch.bfloat16  # host-side construction: reported as the argument's value

    def size(self):
        if self.n < 0:
            raise ValueError("negative")  # violates: raise
        return self.n


class GoodConfig(nl.NKIObject):
    """The same config as an NKIObject with an nki dtype."""

    def __init__(self, n):
        self.n = n
        self.dtype = nl.bfloat16

    def size(self):
        assert self.n >= 0, "negative"
        return self.n
