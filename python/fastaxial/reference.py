"""The contract: axial attention written as a plain PyTorch module.

fastaxial.AxialAttention computes the same function with fused kernels; the
tests, the main job and the benchmark compare against this module.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["AxialAttentionReference", "softmax_attention", "axis_attention", "axial_attention", "get_init_inputs", "get_inputs"]


def softmax_attention(q, k, v, dropout_p=0.0, training=False):
    """q, k, v (N, heads, L, head_dim) -> softmax(q k^T / sqrt(head_dim)), dropout, times v."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return F.dropout(scores.softmax(dim=-1), dropout_p, training) @ v


def axis_attention(x, norm_weight, norm_bias, qkv_weight, out_weight, out_bias, num_heads, eps=1e-5,
                   dropout_p=0.0, training=False, attend=softmax_attention):
    """Attention along dim 1 of x (N, L, D): LayerNorm, QKV, attention per head, output projection.

    Returns the attention branch only (no residual). attend(q, k, v, dropout_p,
    training) is the attention core; the benchmark swaps in PyTorch's SDPA.
    """
    N, L, D = x.shape
    head_dim = D // num_heads
    y = F.layer_norm(x, (D,), norm_weight, norm_bias, eps)
    qkv = F.linear(y, qkv_weight).view(N, L, 3, num_heads, head_dim)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (N, heads, L, head_dim)
    o = attend(q, k, v, dropout_p, training).transpose(1, 2).reshape(N, L, D)
    return F.linear(o, out_weight, out_bias)


def axial_attention(x, row_norm_weight, row_norm_bias, row_qkv_weight, row_out_weight, row_out_bias,
                    col_norm_weight, col_norm_bias, col_qkv_weight, col_out_weight, col_out_bias,
                    num_heads, eps=1e-5, dropout_p=0.0, training=False, col_eps=None,
                    attend=softmax_attention):
    """Rows then columns on x (B, H, W, D), each with a residual; same arguments as the fused op.

    eps is the LayerNorm epsilon of both axes unless col_eps is given.
    """
    B, H, W, D = x.shape
    row = (row_norm_weight, row_norm_bias, row_qkv_weight, row_out_weight, row_out_bias)
    col = (col_norm_weight, col_norm_bias, col_qkv_weight, col_out_weight, col_out_bias)
    a = axis_attention(x.reshape(B * H, W, D), *row, num_heads, eps, dropout_p, training, attend)
    x1 = x + a.reshape(B, H, W, D)
    xc = x1.permute(0, 2, 1, 3).reshape(B * W, H, D)
    a = axis_attention(xc, *col, num_heads, eps if col_eps is None else col_eps, dropout_p, training, attend)
    return x1 + a.reshape(B, W, H, D).permute(0, 2, 1, 3)


# (submodule, parameter) of each fused-op weight argument, in argument order.
_WEIGHT_NAMES = (("row_norm", "weight"), ("row_norm", "bias"), ("row_qkv", "weight"), ("row_out", "weight"),
                 ("row_out", "bias"), ("col_norm", "weight"), ("col_norm", "bias"), ("col_qkv", "weight"),
                 ("col_out", "weight"), ("col_out", "bias"))


class AxialAttentionReference(nn.Module):
    """Row attention then column attention on x (B, H, W, D), each LayerNorm'd, with residuals."""

    def __init__(self, dim, num_heads, height, width, dropout=0.0):
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        self.height = height
        self.width = width
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        # Creation order is part of the contract: it fixes which random numbers each weight gets.
        self.row_norm = nn.LayerNorm(dim)
        self.row_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.row_out = nn.Linear(dim, dim)
        self.col_norm = nn.LayerNorm(dim)
        self.col_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.col_out = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def weights(self):
        """The ten parameter tensors in the fused op's argument order."""
        # Read through the submodules' parameter dicts: the plain attribute path
        # goes through nn.Module.__getattr__ twenty times, about 20 us of host
        # time per forward, more than the GPU kernels take. Parametrized
        # weights (properties, not in _parameters) take the plain path.
        try:
            return tuple(self._modules[m]._parameters[p] for m, p in _WEIGHT_NAMES)
        except KeyError:
            return tuple(getattr(getattr(self, m), p) for m, p in _WEIGHT_NAMES)

    def forward(self, x):
        return axial_attention(x, *self.weights(), self.num_heads, self.row_norm.eps, self.dropout.p,
                               self.training, col_eps=self.col_norm.eps)


# The default problem.
BATCH, HEIGHT, WIDTH, DIM, HEADS = 4, 32, 32, 64, 4


def get_init_inputs():
    """Constructor arguments of the default problem: (dim, num_heads, height, width)."""
    return [DIM, HEADS, HEIGHT, WIDTH]


def get_inputs():
    """Forward inputs of the default problem: [x] with x of shape (4, 32, 32, 64)."""
    return [torch.randn(BATCH, HEIGHT, WIDTH, DIM)]
