"""fastaxial.AxialAttention: the reference module's drop-in replacement."""

import warnings

import torch

from . import ops, reference

__all__ = ["AxialAttention"]


class AxialAttention(reference.AxialAttentionReference):
    """Axial attention on x (B, H, W, D) through fastaxial's fused kernels.

    Same constructor, parameters (names, shapes, initialisation, creation
    order) and forward as fastaxial.reference.AxialAttentionReference, so
    state dicts load both ways and equal seeds give equal weights. Gradients
    flow through the operator's registered autograd formula. Inputs the fused
    kernels do not serve yet (a dtype other than float32, a device without a
    kernel, dropout active in training mode, different LayerNorm epsilons per
    axis) run the reference math instead, with a warning the first time.
    """

    # Submodules are read from self._modules rather than as attributes: each
    # attribute read of a submodule goes through nn.Module.__getattr__, about
    # 0.6 us of host time, and the checks below run on every forward.
    def _fused_unsupported(self, x, weights):
        """Why the fused path cannot serve this call, or None when it can."""
        mods = self._modules
        if self.training and mods["dropout"].p > 0:
            return "dropout is active in training mode"
        if x.dtype is not torch.float32 or not all(w.dtype is torch.float32 for w in weights):
            return f"dtype {x.dtype} is not supported yet (float32 is)"
        if not ops.has_kernel(x.device.type):
            return f"no fastaxial kernel for device type '{x.device.type}' in this build"
        if mods["row_norm"].eps != mods["col_norm"].eps:
            return "row_norm and col_norm have different eps"
        return None

    def forward(self, x):
        weights = self.weights()
        reason = self._fused_unsupported(x, weights) if isinstance(x, torch.Tensor) else None
        if reason is not None:
            _warn_once(reason)
            return super().forward(x)
        return ops.axial_attention(x, *weights, self.num_heads, self._modules["row_norm"].eps)


_warned = set()


def _warn_once(reason):
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"fastaxial.AxialAttention: {reason}; running the reference PyTorch math", stacklevel=3)
