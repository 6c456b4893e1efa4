"""fastaxial: fused axial attention for PyTorch.

    import fastaxial
    layer = fastaxial.AxialAttention(dim=64, num_heads=4, height=32, width=32)
    y = layer(x)  # x is (B, H, W, D)

Same constructor, parameters and forward as fastaxial.reference.AxialAttentionReference.
"""

from . import ops, reference
from .module import AxialAttention
from .ops import axial_attention
from .reference import AxialAttentionReference

ModelNew = AxialAttention

__all__ = ["AxialAttention", "AxialAttentionReference", "ModelNew", "axial_attention", "ops", "reference"]
__version__ = "0.1.0"
