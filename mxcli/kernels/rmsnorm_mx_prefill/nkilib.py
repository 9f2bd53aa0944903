"""AWS's version of ``rmsnorm_mx_prefill`` (nkilib ``core/rmsnorm``): its import path and what
it refuses, and how any third-party entry point with the API reference's signature is called
(registered on the kernel's spec, `spec.SPEC`; the generic loader is `mxcli.kernels.selection`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mxcli.kernels import nkilib
from mxcli.kernels.spec import ThirdParty


def refusal(args: Mapping[str, Any]) -> str | None:
    """What nkilib's prefill asserts away (before launching, in mxcli's words), or None."""
    act = args.get("router_act_fn")
    name = getattr(act, "name", str(act))
    if (
        args.get("router_weights") is not None
        and name == "NOAUX_TC"
        and args.get("pack_affinities")
    ):
        # nkilib rmsnorm_mx_prefill: kernel_assert(not pack_affinities, "NOAUX_TC emits fp32
        # affinities; pack_affinities (bf16 row tail) is unsupported"); mxcli's kernel packs them
        return "NOAUX_TC with pack_affinities (its NOAUX_TC affinities are fp32, the packed tail is bf16)"
    return None


# The documented import path (api/rmsnorm_mx_prefill.txt): the function re-exported by the
# package, or its submodule where the newest nkilib versions define it.
NKILIB_KERNEL = nkilib.implementation(
    "nkilib.core.rmsnorm:rmsnorm_mx_prefill",
    modules=("nkilib.core.rmsnorm.rmsnorm_mx_prefill",),
    refusal=refusal,
)

# Any third-party entry point: the API reference's arguments (`nki_backend.api_arguments`);
# `hidden_interleaved` is mxcli's own (not in the API reference), dropped at its default.
THIRD_PARTY = ThirdParty(
    arguments="mxcli.kernels.rmsnorm_mx_prefill.nki_backend:api_arguments",
    signature_keys=("hidden_states", "gamma"),
    mxcli_only=(("hidden_interleaved", False),),
)

__all__ = ["NKILIB_KERNEL", "THIRD_PARTY", "refusal"]
