"""Model families as data (ecosystem §2.4, §3).

- `layouts`: how experts are stored on disk (`PerExpert`, `Fused`, `Shared`) and loaded into the
  kernel layouts;
- `routing`: a family's router math (`RouterMath`), the kernel mode that reproduces it
  (`kernel_router`) or the refusal, and the fp32 routing oracle of ``--check``;
- `table`: one declarative entry per family (config keys and aliases, tensor names, MoE layer
  rule, norm, router math, backward departures), the refused families, config resolution.
"""

from mxcli.weightprep.families.layouts import (
    Fused,
    FusedDense,
    PerExpert,
    Scratch,
    Shared,
    Stacked,
    load_weight,
    t2,
)
from mxcli.weightprep.families.routing import (
    MAX_EXPERTS,
    MAX_GROUPS,
    MAX_TOP_K,
    ConfigError,
    RouterMath,
    RouterRefused,
    RouterSpec,
    compare_routing,
    kernel_router,
    route_fp32,
)
from mxcli.weightprep.families.table import (
    FAMILIES,
    FAMILY_LIST,
    NORM_1PW,
    NORM_W,
    REFUSED,
    REFUSED_LIST,
    REQUIRED,
    Family,
    ModelConfig,
    Refused,
    bind_tensor_names,
    check_semantics,
    check_shape,
    detect_family,
    fold_gamma,
    fp8_scale_shape,
    resolve_config,
    supported_model_types,
)

__all__ = [
    "FAMILIES",
    "FAMILY_LIST",
    "MAX_EXPERTS",
    "MAX_GROUPS",
    "MAX_TOP_K",
    "NORM_1PW",
    "NORM_W",
    "REFUSED",
    "REFUSED_LIST",
    "REQUIRED",
    "ConfigError",
    "Family",
    "Fused",
    "FusedDense",
    "ModelConfig",
    "PerExpert",
    "Refused",
    "RouterMath",
    "RouterRefused",
    "RouterSpec",
    "Scratch",
    "Shared",
    "Stacked",
    "bind_tensor_names",
    "check_semantics",
    "check_shape",
    "compare_routing",
    "detect_family",
    "fold_gamma",
    "fp8_scale_shape",
    "kernel_router",
    "load_weight",
    "resolve_config",
    "route_fp32",
    "supported_model_types",
    "t2",
]
