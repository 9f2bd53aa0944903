"""Errors raised by the NKI interpreter.

api spec §9: the real simulator raises ``AssertionError`` for hardware-constraint violations and
its stub defines ``nki.isa.NkiValidationError``. We make the latter a subclass of both
``AssertionError`` and ``ValueError`` so that tests written against either type pass, and so
that mxcli's CLI reports it as a user error (one line) rather than a crash.
"""

from __future__ import annotations


class NkiValidationError(AssertionError, ValueError):
    """A kernel broke a documented hardware or API rule.

    Messages are shaped ``"<op>: <operand> <problem> (got X, expected Y)"``.
    """


class NkiOutOfBoundsError(NkiValidationError, IndexError):
    """A dynamic DMA address left its tensor under ``oob_mode.error`` (api spec §6.1)."""


class NkiUninitializedReadError(NkiValidationError):
    """An instruction read memory that nothing wrote since its allocation (api spec §2.4)."""


class NkiCapacityError(NkiValidationError):
    """Live SBUF or PSUM bytes per partition exceeded the target's budget."""


class NkiNotActiveError(RuntimeError):
    """An NKI call was made outside a simulated kernel."""
