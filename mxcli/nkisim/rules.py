"""Stable names for the rules the interpreter enforces beyond single-op operand checks.

Tests and error messages name a rule by its value (``"is"``, ``"lnc-race"``, ...), so the values
never change. Front-end rules come from the NKI 0.6 meta-programming subset (language guide,
migration guide "Language restrictions", and upstream NKI Library usage where the docs are
silent); hardware rules from the 2.32 API stubs and the MXFP matmul guide. mxcli/nkisim/README.md
lists what each rule rejects and which upstream usage decided it.
"""

from __future__ import annotations

import enum

from mxcli.nkisim.errors import NkiValidationError

__all__ = ["NkiRuleError", "Rule", "rule_error"]


class Rule(str, enum.Enum):
    """One enforced rule; the value is the stable name used in messages (``[name]``)."""

    # -- front end: Python outside the NKI 0.6 subset (checked on the source, before tracing)
    TRY = "try"
    RAISE = "raise"
    WITH = "with"
    LAMBDA = "lambda"
    SET = "set"
    GENERATOR = "generator"
    COMPREHENSION = "comprehension"
    GLOBAL = "global"
    YIELD = "yield"
    DELETE = "del"
    WALRUS = "walrus"
    SYNTAX = "syntax"
    IMPORT = "import"
    IDENTITY = "is"
    CLASS_BASE = "class-base"
    DECORATOR = "decorator"
    SIGNATURE = "signature"
    LIST_ARGUMENT = "list-argument"
    VALUE = "value"
    TORCH_NUMPY = "torch-numpy"
    BUILTIN = "builtin"
    JIT_SUBKERNEL = "jit-subkernel"
    SOURCE = "source"
    # -- interpreter: hardware and synchronization rules (checked while the kernel runs)
    MEMSET_X4 = "memset-x4"
    PARTITION_DIM = "partition-dim"
    TENSOR_SCALAR_FP32 = "tensor-scalar-fp32"
    MX_SCALE_QUADRANT = "mx-scale-quadrant"
    LNC_RACE = "lnc-race"
    DMA_NEGATIVE_INDEX = "dma-negative-index"


class NkiRuleError(NkiValidationError):
    """A named rule was broken; ``.rule`` is the `Rule`, and the message contains ``[name]``."""

    def __init__(self, rule: Rule, message: str) -> None:
        super().__init__(message)
        self.rule = rule


def rule_error(rule: Rule, message: str) -> NkiRuleError:
    """``NkiRuleError`` whose message is ``"<message> [<rule name>]"``."""
    return NkiRuleError(rule, f"{message} [{rule.value}]")
