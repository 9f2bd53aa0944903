"""The `KernelSpec` of ``blockwise_mm_bwd_mxfp8``: its file contract, outputs, padding,
non-finite rule and NKI implementations (see `mxcli.kernels.spec`).

Names, order and defaults of the arguments come from the signature of `blockwise_mm_bwd_mxfp8`;
the tables below add only what a signature cannot say (stored dtypes, help, JSON parsing).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mxcli.errors import InputError, MxcliError
from mxcli.io.kwargs import dataclass_from_dict, json_object, to_jsonable, typed
from mxcli.kernels.blockwise_moe import identity
from mxcli.kernels.blockwise_moe.config import MXFP8MOEBwdConfig
from mxcli.kernels.blockwise_moe.contract import (
    OUTPUT_NAMES,
    blockwise_mm_bwd_mxfp8,
    output_names,
    validate,
)
from mxcli.kernels.blockwise_moe.nkilib import NKILIB_KERNEL, THIRD_PARTY
from mxcli.kernels.spec import (
    Implementation,
    KernelSpec,
    NkiLaunch,
    NonfiniteRule,
    PaddedDims,
    ScalarArg,
    TensorArg,
    register_spec,
)

FLOAT16 = (torch.bfloat16, torch.float16)
FLOATS = (torch.bfloat16, torch.float16, torch.float32)
INTS = (torch.int32, torch.int64)


# mxcli's own NKI kernel; AWS's (`nkilib.NKILIB_KERNEL`) and any MODULE:FUNCTION beside it
MXCLI_KERNEL = Implementation(
    "mxcli",
    "mxcli.kernels.blockwise_moe.nki_kernel:blockwise_mm_bwd_mxfp8_jit",
    own=True,
    doc="mxcli's NKI kernel (mxcli/kernels/blockwise_moe/nki_kernel/)",
)
# the host side of every NKI launch (`mxcli.kernels.launcher`): validation, planning, outputs
NKI_LAUNCH = NkiLaunch(
    as_call="mxcli.kernels.blockwise_moe.contract:as_call",
    prepare="mxcli.kernels.blockwise_moe.nki_backend:kernel_arguments",
    finish="mxcli.kernels.blockwise_moe.nki_backend:finish",
    result=tuple,
    lnc=2,  # the API's launch: two programs splitting the free dims (SHARD_ON_FREE)
    third_party=THIRD_PARTY,
)


def config_to_dict(config: Any) -> dict[str, Any]:
    """JSON-ready dict of an ``MXFP8MOEBwdConfig`` (enums by name, nested configs as dicts)."""
    return to_jsonable(config)  # type: ignore[no-any-return]


def config_from_dict(data: Mapping[str, Any]) -> MXFP8MOEBwdConfig:
    """``MXFP8MOEBwdConfig`` from a (possibly partial) JSON object of its fields."""
    try:
        return dataclass_from_dict(MXFP8MOEBwdConfig, data, "config")  # type: ignore[no-any-return]
    except MxcliError:
        raise
    except (TypeError, ValueError, KeyError) as exc:
        raise InputError(f"config: {exc}") from None


def _parse_config(v: Any) -> Any:
    if v is None or isinstance(v, MXFP8MOEBwdConfig):
        return v
    return config_from_dict(json_object(v, "config", "MXFP8MOEBwdConfig fields"))


def _dump_config(v: Any) -> Any:
    return None if v is None else config_to_dict(v)


def expert_intermediate_size(tensors: Mapping[str, torch.Tensor]) -> int | None:
    """The I of the run's down weight (``[E, I, H]``, pre-quantized ``[E, H/4, I]``)."""
    d = tensors.get("down_proj_weight")
    if d is None or d.dim() != 3:
        return None
    return int(d.shape[2] if "down_weight_scales" in tensors else d.shape[1])


SPEC = register_spec(
    KernelSpec(
        blockwise_mm_bwd_mxfp8,
        short=identity.SHORT,
        tensors=(
            TensorArg("hidden_states", "[T, H]", FLOAT16),
            TensorArg("expert_affinities_masked", "[T * E, 1]", FLOATS),
            TensorArg(
                "gate_up_proj_weight",
                "[E, H, 2, I] bf16 or [E, 2I/4, H] x4 (uint32)",
                (*FLOAT16, torch.uint32),
            ),
            TensorArg(
                "down_proj_weight",
                "[E, I, H] bf16 or [E, H/4, I] x4 (uint32)",
                (*FLOAT16, torch.uint32),
            ),
            TensorArg("token_position_to_id", "[N * B]", INTS),
            TensorArg("block_to_expert", "[N, 1]", INTS),
            TensorArg("output_hidden_states_grad", "[T, H]", FLOAT16),
            TensorArg("gate_up_proj_act_checkpoint_T", "[N, 2, I, B]", FLOAT16),
            TensorArg("gate_act_checkpoint_T", "[N, I, B]", FLOAT16),
            TensorArg("intermediate_checkpoint_T", "[N, I, B]", FLOAT16),
            TensorArg("scaled_intermediate_checkpoint_T", "[N, I, B]", FLOAT16),
            TensorArg("down_proj_act_checkpoint", "[N, B, H]", FLOAT16),
            TensorArg("gate_up_weight_scales", "e8m0 bytes (uint8)", (torch.uint8,)),
            TensorArg("down_weight_scales", "e8m0 bytes (uint8)", (torch.uint8,)),
            TensorArg("num_valid_tokens", "[1] int32", INTS),
        ),
        scalars=(
            ScalarArg(
                "block_size", "Tokens per block (128 ... 4096).", typed(int, "block_size", low=1)
            ),
            ScalarArg(
                "config",
                "MXFP8MOEBwdConfig as a JSON object of its fields.",
                _parse_config,
                _dump_config,
                file="MXFP8MOEBwdConfig fields",
            ),
        ),
        outputs=OUTPUT_NAMES,
        validate=validate,
        required_outputs=lambda kwargs, _inputs: output_names(
            bool(getattr(kwargs.get("config"), "bias", False))
        ),
        # bwd spec §10: H % 128 == 0 and I % 128 == 0; §1 layouts (gradients share them)
        padded=PaddedDims(
            inputs={
                "hidden_states": {1: "H"},  # [T, H]
                "output_hidden_states_grad": {1: "H"},  # [T, H]
                "gate_up_proj_act_checkpoint_T": {2: "I"},  # [N, 2, I, B]
                "gate_act_checkpoint_T": {1: "I"},  # [N, I, B]
                "intermediate_checkpoint_T": {1: "I"},  # [N, I, B]
                "scaled_intermediate_checkpoint_T": {1: "I"},  # [N, I, B]
                "down_proj_act_checkpoint": {2: "H"},  # [N, B, H]
            },
            outputs={
                "hidden_states_grad": {1: "H"},  # [T, H]
                "gate_up_proj_weight_grad": {1: "H", 3: "I"},  # [E, H, 2, I]
                "down_proj_weight_grad": {1: "I", 2: "H"},  # [E, I, H]
                "gate_and_up_proj_bias_grad": {2: "I"},  # [E, 2, I]
                "down_proj_bias_grad": {1: "H"},  # [E, H]
            },
            hidden="backward_hidden_size",
            unpad_outputs=True,
            intermediate_of=expert_intermediate_size,
        ),
        # the backward mixes every token and expert: any non-finite input explains every output
        nonfinite=NonfiniteRule(
            token_inputs=None, x4_inputs=("gate_up_proj_weight", "down_proj_weight")
        ),
        implementations=(MXCLI_KERNEL, NKILIB_KERNEL),
        nki=NKI_LAUNCH,
        title=identity.TITLE,
        tokens="hidden_states",
    )
)

__all__ = [
    "MXCLI_KERNEL",
    "NKILIB_KERNEL",
    "NKI_LAUNCH",
    "SPEC",
    "config_from_dict",
    "config_to_dict",
    "expert_intermediate_size",
]


def bwd_input_bytes(T: int, H: int, I: int, E: int, K: int, drawn: bool) -> int:  # noqa: E741
    """A lower bound of make-inputs' peak for bwd: the larger of what is held at the end (the
    bf16 weight stacks, 3*E*H*I elements; the fp32 affinities and their bf16 [T*E] mask; bf16
    hidden states and output gradient; the bf16 gate/up checkpoint of the T*K routed pairs) and,
    for `drawn` weights, the moment the gate/up stack exists in fp32 and bf16 beside the bf16
    down stack."""
    held = 6 * E * H * I + 6 * T * E + 4 * T * H + 4 * T * K * I
    return max(held, 14 * E * H * I if drawn else 0)
