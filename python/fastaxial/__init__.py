"""fastaxial: fused axial attention for PyTorch.

    import fastaxial
    layer = fastaxial.AxialAttention(dim=64, num_heads=4, height=32, width=32)
    y = layer(x)  # x is (B, H, W, D)

Same constructor, parameters and forward as fastaxial.reference.AxialAttentionReference.
"""

import logging as _logging


class _NoCudaRuntimeNote(_logging.Filter):
    """torch.compile imports torch.utils.cpp_extension, which logs "No CUDA runtime is found,
    using CUDA_HOME=..." on every machine with a CUDA toolkit but no GPU. It matters only to
    code that compiles CUDA extensions at run time, which fastaxial never does: drop that one
    message, nothing else torch logs."""

    def filter(self, record):
        return not str(record.msg).startswith("No CUDA runtime is found")


_logging.getLogger("torch.utils.cpp_extension").addFilter(_NoCudaRuntimeNote())

from . import ops, reference  # noqa: E402
from .module import AxialAttention  # noqa: E402
from .ops import axial_attention  # noqa: E402
from .reference import AxialAttentionReference  # noqa: E402

ModelNew = AxialAttention

__all__ = ["AxialAttention", "AxialAttentionReference", "ModelNew", "axial_attention", "ops", "reference"]
__version__ = "0.1.0"
