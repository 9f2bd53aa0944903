"""MXFP8 training-loss emulation (issue 23): an autograd experts layer with the kernels'
numerics (`layer`), patching Hugging Face models with it (`patch`), and the loss study behind
``mxcli emulate`` (`study`)."""

from mxcli.emulate.layer import MODES, Mode, MxExperts, experts_forward

__all__ = ["MODES", "Mode", "MxExperts", "experts_forward"]
