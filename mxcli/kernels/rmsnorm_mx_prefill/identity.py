"""What the CLI lists of this kernel before loading it (``mxcli --help``: ``run-prefill``).

Plain strings, importing nothing: `mxcli.kernels.spec.read_identity` runs this file without
importing the package (whose ``__init__`` loads torch). The spec takes SHORT and TITLE from
here; registration checks that NAME is the public function's name.
"""

NAME = "rmsnorm_mx_prefill"
SHORT = "prefill"
TITLE = "Fused RMSNorm + MXFP8 quantization (+ router top-K)."
