"""The structured upstream_pr of features and patches."""

import pytest

from megatron.patchset.core import features, registry
from megatron.patchset.core.errors import PatchsetError
from megatron.patchset.core.upstream_pr import UpstreamPR


@pytest.mark.parametrize(
    "text, kind, number, note",
    [
        ("PR 4268", "pr", 4268, ""),
        ("PR 4232 (with #4231)", "pr", 4232, "with #4231"),
        ("NVIDIA/Megatron-LM#17 (closed)", "pr", 17, "closed"),
        ("#9", "pr", 9, ""),
        ("proposed", "proposed", None, ""),
        ("proposed (after 0.20)", "proposed", None, "after 0.20"),
        ("fork-only (library API)", "fork-only", None, "library API"),
    ],
)
def test_parse(text, kind, number, note):
    pr = UpstreamPR.parse(text)
    assert (pr.kind, pr.number, pr.note) == (kind, number, note)
    assert UpstreamPR.parse(str(pr)) == pr
    assert pr.exportable == (kind != "fork-only")


@pytest.mark.parametrize("text", ["fork-only", "fork-only ()", "none", "PR x", "maybe (later)"])
def test_free_text_and_a_fork_only_without_reason_are_refused(text):
    with pytest.raises(PatchsetError):
        UpstreamPR.parse(text)


def test_every_feature_and_patch_has_a_structured_upstream_pr():
    for feature in features.load():
        assert isinstance(feature.upstream_pr, UpstreamPR)
    for patch in registry.registered():
        assert isinstance(patch.upstream, UpstreamPR), patch.name
    assert features.get("p2p_overlap").upstream_pr.reference == "NVIDIA/Megatron-LM#4268"
    assert features.get("fsdp_cuda_graphs").upstream_pr.number == 4232


def test_a_patch_with_unstructured_upstream_pr_is_refused_at_declaration():
    with pytest.raises(PatchsetError, match="patch 'x.y'"):
        registry.patch("x.y", "megatron.core.a.b", reason="r", upstream_pr="see the wiki")
