"""Op tokens: ALU operators and activation functions (api spec §4.9).

Each token is a callable object (the experimental high-level ``nl.add(x, y)`` form) that the ISA
ops identify by identity (``op=nl.add``). ``alu`` evaluates the operator on float32 arrays;
``act`` evaluates an activation function exactly (float64 internally, rounded once to fp32 —
the hardware uses table/polynomial approximations, which this interpreter does not model).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import torch

__all__ = ["OpToken", "ALU_TOKENS", "ACT_TOKENS", "TOKENS"]

F32 = np.float32


# high-level ``nl.<op>(x, y, dtype=None)`` calls of the 2.32 stub (the rest take ``(x, dtype)``)
BINARY_CALLS = frozenset(
    "add subtract multiply divide maximum minimum equal not_equal greater greater_equal less "
    "less_equal logical_and logical_or logical_xor power abs_max abs_min bitwise_and bitwise_or "
    "bitwise_xor left_shift right_shift".split()
)


class OpToken:
    """One ``nl`` op token."""

    def __init__(
        self,
        name: str,
        *,
        binary: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
        unary: Callable[[np.ndarray], np.ndarray] | None = None,
        act: Callable[[np.ndarray], np.ndarray] | None = None,
        reducible: bool = False,
        identity: float | None = None,
        bitvec: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
        bitvec_unary: Callable[[np.ndarray], np.ndarray] | None = None,
        isa_alu: bool = True,
    ) -> None:
        self.name = name
        self.binary = binary
        self.unary = unary
        self.act = act
        self.reducible = reducible
        self.identity = identity
        self.bitvec = bitvec
        self.bitvec_unary = bitvec_unary
        self.isa_alu = isa_alu  # False: present in nl but not an ISA ALU op (nl.divide, §12.16)
        self.__name__ = name
        self.__qualname__ = name

    def __repr__(self) -> str:
        return f"nl.{self.name}"

    @property
    def is_alu(self) -> bool:
        return self.binary is not None or self.unary is not None

    @property
    def is_bitvec(self) -> bool:
        return self.bitvec is not None or self.bitvec_unary is not None

    @property
    def is_unary_alu(self) -> bool:
        return self.unary is not None and self.binary is None

    def apply(self, a: np.ndarray, b: Any) -> np.ndarray:
        """fp32 ALU evaluation: ``op(a, b)`` (unary ops ignore b)."""
        if self.binary is not None:
            return np.asarray(self.binary(a, b), dtype=F32)
        if self.unary is not None:
            return np.asarray(self.unary(a), dtype=F32)
        raise TypeError(f"nl.{self.name} is not an ALU operator")

    @property
    def __signature__(self) -> inspect.Signature:
        """The 2.32 stub's signature of the high-level call: ``(x, y, dtype=None)`` for binary
        operators, ``(x, dtype=None)`` otherwise."""
        P = inspect.Parameter
        names = ("x", "y") if self.name in BINARY_CALLS else ("x",)
        params = [P(n, P.POSITIONAL_OR_KEYWORD) for n in names]
        params.append(P("dtype", P.POSITIONAL_OR_KEYWORD, default=None))
        return inspect.Signature(params)

    # The high-level call ``nl.add(x, y)`` (api spec §4.8) is built on the ISA instructions,
    # which stand above this module and use its tokens: ``nki/highlevel.py`` hands its
    # implementation in here when it is imported (``nki.language`` imports it), so that no
    # import runs back up from the tokens to the instructions.
    high_level_call: ClassVar[Callable[..., Any] | None] = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = OpToken.high_level_call
        if call is None:
            raise TypeError(
                f"nl.{self.name}(...): the high-level call needs nki.language imported "
                "(mxcli.nkisim.nki.language)"
            )
        return call(self, *args, **kwargs)


def _cmp(f: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    return lambda a, b: f(a, b).astype(F32)


def _logical(f: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    return lambda a, b: f(np.asarray(a) != 0, np.asarray(b) != 0).astype(F32)


def _abs_max(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.broadcast_arrays(np.asarray(a, F32), np.asarray(b, F32))
    return np.where(np.abs(a) > np.abs(b), a, b)  # ties return b (api spec §4.9)


def _abs_min(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.broadcast_arrays(np.asarray(a, F32), np.asarray(b, F32))
    return np.where(np.abs(a) < np.abs(b), a, b)


def _u32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(np.int64) & 0xFFFFFFFF


def _f64(fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    """Evaluate in float64, round once to fp32 ("exact in fp32")."""

    def run(x: np.ndarray) -> np.ndarray:
        with np.errstate(all="ignore"):
            return np.asarray(fn(np.asarray(x, dtype=np.float64)), dtype=F32)

    return run


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _erf(x: np.ndarray) -> np.ndarray:
    return torch.erf(torch.from_numpy(np.ascontiguousarray(x))).numpy()


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _gelu_dx(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + _erf(x / math.sqrt(2.0))) + x * np.exp(-0.5 * x * x) / math.sqrt(
        2.0 * math.pi
    )


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


_GS = 1.702  # api spec §12.15: constant assumed for gelu_apprx_sigmoid


def _gelu_sig(x: np.ndarray) -> np.ndarray:
    return x * _sigmoid(_GS * x)


def _gelu_sig_dx(x: np.ndarray) -> np.ndarray:
    s = _sigmoid(_GS * x)
    return s + x * _GS * s * (1.0 - s)


def _silu_dx(x: np.ndarray) -> np.ndarray:
    # api spec §4.9: d/dx [x * sigmoid(x)] = sigmoid(x) * (1 + x * (1 - sigmoid(x)))
    s = _sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


add = OpToken("add", binary=lambda a, b: np.add(a, b, dtype=F32), reducible=True, identity=0.0)
subtract = OpToken(
    "subtract", binary=lambda a, b: np.subtract(a, b, dtype=F32), reducible=True, identity=0.0
)
multiply = OpToken(
    "multiply", binary=lambda a, b: np.multiply(a, b, dtype=F32), reducible=True, identity=1.0
)
maximum = OpToken(
    "maximum", binary=lambda a, b: np.maximum(a, b, dtype=F32), reducible=True, identity=-np.inf
)
minimum = OpToken(
    "minimum", binary=lambda a, b: np.minimum(a, b, dtype=F32), reducible=True, identity=np.inf
)
equal = OpToken("equal", binary=_cmp(np.equal))
not_equal = OpToken("not_equal", binary=_cmp(np.not_equal))
greater = OpToken("greater", binary=_cmp(np.greater))
greater_equal = OpToken("greater_equal", binary=_cmp(np.greater_equal))
less = OpToken("less", binary=_cmp(np.less))
less_equal = OpToken("less_equal", binary=_cmp(np.less_equal))
logical_and = OpToken("logical_and", binary=_logical(np.logical_and), reducible=True, identity=1.0)
logical_or = OpToken("logical_or", binary=_logical(np.logical_or), reducible=True, identity=0.0)
logical_xor = OpToken("logical_xor", binary=_logical(np.logical_xor), reducible=True, identity=0.0)
power = OpToken(
    "power", binary=lambda a, b: np.power(np.asarray(a, F32), np.asarray(b, F32), dtype=F32)
)
abs_max = OpToken("abs_max", binary=_abs_max)
abs_min = OpToken("abs_min", binary=_abs_min)
divide = OpToken("divide", binary=lambda a, b: np.divide(a, b, dtype=F32), isa_alu=False)
# bitvec operators: raw integer bits, integer dtypes only (api spec §4.9)
bitwise_and = OpToken("bitwise_and", bitvec=lambda a, b: _u32(a) & _u32(b), reducible=True)
bitwise_or = OpToken("bitwise_or", bitvec=lambda a, b: _u32(a) | _u32(b), reducible=True)
bitwise_xor = OpToken("bitwise_xor", bitvec=lambda a, b: _u32(a) ^ _u32(b), reducible=True)
invert = OpToken("invert", bitvec_unary=lambda a: ~_u32(a) & 0xFFFFFFFF)
left_shift = OpToken("left_shift", bitvec=lambda a, b: (_u32(a) << (_u32(b) & 31)) & 0xFFFFFFFF)
right_shift = OpToken("right_shift", bitvec=lambda a, b: _u32(a) >> (_u32(b) & 31))
bypass = OpToken("bypass", unary=lambda a: np.asarray(a, F32))

# tokens that are both unary ALU operators and activation functions
_abs = _f64(np.abs)
_square = _f64(np.square)
_relu = _f64(lambda x: np.maximum(x, 0.0))
_rsqrt = _f64(lambda x: 1.0 / np.sqrt(x))
_recip = _f64(lambda x: 1.0 / x)
abs = OpToken("abs", unary=_abs, act=_abs)  # noqa: A001 - NKI's name
square = OpToken("square", unary=_square, act=_square)
relu = OpToken("relu", unary=_relu, act=_relu)
rsqrt = OpToken("rsqrt", unary=_rsqrt, act=_rsqrt)
reciprocal = OpToken("reciprocal", unary=_recip, act=_recip)

# activation functions (Scalar engine), exact math in fp32
copy = OpToken("copy", act=lambda x: np.asarray(x, F32))
sigmoid = OpToken("sigmoid", act=_f64(_sigmoid))
exp = OpToken("exp", act=_f64(np.exp))
log = OpToken("log", act=_f64(np.log))
tanh = OpToken("tanh", act=_f64(np.tanh))
silu = OpToken("silu", act=_f64(lambda x: x * _sigmoid(x)))
silu_dx = OpToken("silu_dx", act=_f64(_silu_dx))
gelu = OpToken("gelu", act=_f64(_gelu))
gelu_dx = OpToken("gelu_dx", act=_f64(_gelu_dx))
gelu_apprx_tanh = OpToken("gelu_apprx_tanh", act=_f64(_gelu_tanh))
gelu_apprx_sigmoid = OpToken("gelu_apprx_sigmoid", act=_f64(_gelu_sig))
gelu_apprx_sigmoid_dx = OpToken("gelu_apprx_sigmoid_dx", act=_f64(_gelu_sig_dx))
softplus = OpToken("softplus", act=_f64(_softplus))
mish = OpToken("mish", act=_f64(lambda x: x * np.tanh(_softplus(x))))
erf = OpToken("erf", act=_f64(_erf))
erf_dx = OpToken("erf_dx", act=_f64(lambda x: 2.0 / math.sqrt(math.pi) * np.exp(-x * x)))
sqrt = OpToken("sqrt", act=_f64(np.sqrt))
sign = OpToken("sign", act=_f64(np.sign))
# sin: exact (the hardware polynomial has no range reduction outside [-pi, pi]; not modelled)
sin = OpToken("sin", act=_f64(np.sin))
arctan = OpToken("arctan", act=_f64(np.arctan))
prelu = OpToken("prelu", act=_f64(lambda x: x))  # slope applied by activate2 (relu_param)

TOKENS: dict[str, OpToken] = {
    name: tok for name, tok in list(globals().items()) if isinstance(tok, OpToken)
}
ALU_TOKENS = {n: t for n, t in TOKENS.items() if t.is_alu or t.is_bitvec}
ACT_TOKENS = {n: t for n, t in TOKENS.items() if t.act is not None}
