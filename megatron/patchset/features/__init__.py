"""The overlay's features, one folder each (``<name>/__init__.py`` defines ``FEATURE``).

:data:`ORDER` is the order in which they load: that of ``--list``, of the validation table and of
the flags in ``--help``.
"""

ORDER = (
    "p2p_overlap",
    "fsdp_cuda_graphs",
    "torch_compile",
    "flex_dispatch",
    "paged_stash",
    "grouped_mm",
    "static_dispatch",
    "torch_adam",
    "dp_grad_scaling",
    "triton_cross_entropy",
    "triton_swiglu",
    "offload",
    "memory_budget",
)
