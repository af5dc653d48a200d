"""The exported tree the tests share: every exportable feature exported onto megatron-core's
installed source (the wheel's ``megatron/`` package, the same source the wheel unpacks)."""

import os

import pytest

from megatron.patchset.export import export


def installed_source() -> str:
    """The folder holding the installed ``megatron/`` package (megatron.core's source)."""
    import megatron.core

    return os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.abspath(megatron.core.__file__)))
    )


@pytest.fixture(scope="package")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("exported")
    result = export(installed_source(), str(out))
    return str(out), result
