"""Errors of the overlay's core."""


class PatchsetError(RuntimeError):
    """Base class for errors raised by the patch registry and the features."""


class PatchsetVersionError(PatchsetError):
    """The installed megatron-core or TransformerEngine is not the one the patches target."""


class PatchTargetError(PatchsetError):
    """A patch target (an upstream module attribute) does not exist any more."""
