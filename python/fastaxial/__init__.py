"""fastaxial: fused axial attention for PyTorch.

    import fastaxial
    layer = fastaxial.AxialAttention(dim=64, num_heads=4, height=32, width=32)
    y = layer(x)  # x is (B, H, W, D)

Same constructor, parameters and forward as fastaxial.reference.AxialAttentionReference.
"""

import sys as _sys

__all__ = ["AxialAttention", "AxialAttentionReference", "ModelNew", "axial_attention", "ops", "reference"]
__version__ = "0.1.0"


def _load():
    """Imports torch and the operator library, and the package's names with them."""
    from importlib import import_module

    # import_module, not `from . import ops`: that asks the package for the name first, which in
    # the lazy case below would come back here.
    ops, reference = import_module(__name__ + ".ops"), import_module(__name__ + ".reference")
    AxialAttention = import_module(__name__ + ".module").AxialAttention
    globals().update(ops=ops, reference=reference, AxialAttention=AxialAttention, axial_attention=ops.axial_attention,
                     AxialAttentionReference=reference.AxialAttentionReference, ModelNew=AxialAttention)


# `python -m fastaxial --help` answers without importing torch (seconds): while `python -m` imports
# the package to find its __main__, sys.argv[0] is "-m". Then, and only with a help flag, the
# names above load on first use (module __getattr__); every other import loads them here, so that
# a missing or mismatched operator library fails at `import fastaxial`.
# The same for the `fastaxial` command (pyproject.toml's project.scripts), whose argv[0] is its path.
_argv = getattr(_sys, "argv", None) or [""]  # embedded interpreters may have none
if (_argv[0] == "-m" or _argv[0].rsplit("/", 1)[-1] == "fastaxial") and {"-h", "--help"} & set(_argv[1:]):
    def __getattr__(name):
        if name in __all__:
            _load()
            return globals()[name]
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
else:
    _load()
