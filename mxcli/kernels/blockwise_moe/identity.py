"""What the CLI lists of this kernel before loading it (``mxcli --help``: ``run-bwd``).

Plain strings, importing nothing: `mxcli.kernels.spec.read_identity` runs this file without
importing the package (whose ``__init__`` loads torch). The spec takes SHORT and TITLE from
here; registration checks that NAME is the public function's name.
"""

NAME = "blockwise_mm_bwd_mxfp8"
SHORT = "bwd"
TITLE = "The MXFP8 backward pass of a blockwise MoE layer."
