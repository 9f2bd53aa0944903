"""mxcli: MXFP8 Mixture-of-Experts kernels for AWS Trainium, their references, and a CLI."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mxcli")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.1.0"

__all__ = ["__version__"]
