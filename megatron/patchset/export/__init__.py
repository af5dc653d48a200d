"""``python -m megatron.patchset export``: each feature as source edits to a Megatron-LM checkout.

The export reads a Megatron-LM checkout (or megatron-core's installed source) at run time and
writes an edited copy of its ``megatron/`` package into an output folder, with each selected
feature edited into upstream's own files (:mod:`.plan` says where), and one
``git format-patch``-style file per feature under ``patches/`` (:mod:`.patchfile`). Nothing of
upstream is stored in this repository: the edits are computed from the fork's code and the
checkout's source; only digests of the upstream symbols the patches target are recorded
(:mod:`.digests`), so that a target that moved or changed refuses its feature by name.
"""

__all__ = ["ExportResult", "export"]


def __getattr__(name):
    # The exporter loads on first use: the compat patches, which every launch applies, import
    # this package's edits and changes modules only.
    if name in __all__:
        from megatron.patchset.export import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
