"""The overlay's core: the patch registry and version guard, the feature descriptors, the rule
engine with the parallel-layout rules, the fork's flags, ``--dry-run``, and the compat and observe
patches every run may use. Features live in :mod:`megatron.patchset.features`, one folder each."""
