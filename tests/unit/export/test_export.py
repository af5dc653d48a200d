"""``python -m megatron.patchset export``: what it writes, what it refuses, idempotence."""

import ast
import filecmp
import os
import re
import shutil
import subprocess
import sys

import pytest

from megatron.patchset.core import features
from megatron.patchset.core.provided import BEGIN, END, features_in
from megatron.patchset.export import changes, export
from megatron.patchset.export.plan import exportability, recorded_digests
from megatron.patchset.export.source import (
    ExportRefused,
    SourceTree,
    bound_names,
    digest,
    find_symbol,
)
from tests.unit.export.conftest import installed_source

# The package fixture `exported` is built once: test_export.py and test_equivalence.py run in
# one xdist worker.
pytestmark = pytest.mark.xdist_group("exported-installed-source")

EXPORTABLE = [f.name for f in features.load() if exportability(f) is None]


def _copy(tmp_path):
    """A writable copy of the installed source's megatron/core and megatron/training."""
    source = os.path.join(installed_source(), "megatron")
    for part in ("core", "training"):
        shutil.copytree(
            os.path.join(source, part),
            tmp_path / "src" / "megatron" / part,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    return str(tmp_path / "src")


def _files(folder):
    found = {}
    for base, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(base, name)
            with open(path, "rb") as handle:
                found[os.path.relpath(path, folder)] = handle.read()
    return found


def test_the_features_meant_for_upstream_are_exportable():
    assert {"p2p_overlap", "fsdp_cuda_graphs", "grouped_mm"} <= set(EXPORTABLE)
    for feature in features.load():
        if not feature.upstream_pr.exportable:
            assert exportability(feature).startswith("fork-only")


def test_recorded_digests_match_the_installed_megatron_core():
    tree = SourceTree(installed_source())
    for target, recorded in recorded_digests().items():
        assert digest(find_symbol(tree, target)) == recorded, target


def test_export_edits_upstreams_files_and_writes_one_patch_per_feature(exported):
    out, result = exported
    assert result.exported == EXPORTABLE and not result.refused
    assert result.patches == [
        os.path.join("patches", f"{i:04d}-{name}.patch") for i, name in enumerate(EXPORTABLE, 1)
    ]
    assert "megatron/training/arguments.py" in result.files
    with open(os.path.join(out, "megatron/training/arguments.py")) as handle:
        arguments = handle.read()
    assert features_in(arguments) == set(EXPORTABLE)
    # flags in upstream's style, called from add_megatron_arguments; rules in validate_args
    assert "    parser = _add_p2p_overlap_args(parser)\n" in arguments
    assert "def _add_p2p_overlap_args(parser):" in arguments
    assert "'--overlap-p2p-wgrad-delayed-layer-number'" in arguments
    validate = arguments[arguments.index("def validate_args(") :]
    assert "_validate_p2p_overlap_args(args)" in validate.split("\ndef ")[0]
    assert "_enable_fsdp_cuda_graphs(args)" in validate.split("\ndef ")[0]
    with open(os.path.join(out, "megatron/core/transformer/module.py")) as handle:
        module = handle.read()
    assert "GraphableMegatronModule.__call__ = _call(GraphableMegatronModule.__call__)" in module
    # the exported code is self-contained: nothing of the overlay is imported
    for relative in result.files:
        with open(os.path.join(out, relative)) as handle:
            text = handle.read()
        assert not re.search(r"megatron\.patchset|megatron/patchset", text), relative
    assert not os.path.exists(os.path.join(out, "megatron", "patchset"))


def _definitions(text: str, feature: str) -> set[str]:
    """Names the feature's module-level region of ``text`` defines (imports left out)."""
    found = set()
    for region in re.findall(
        rf"^{re.escape(BEGIN + feature)}\n(.*?)^{re.escape(END + feature)}$", text, re.M | re.S
    ):
        for stmt in ast.parse(region).body:
            if not isinstance(stmt, (ast.Import, ast.ImportFrom)):
                found.update(bound_names(stmt))
    return found


def test_each_fork_definition_is_exported_once(exported):
    """A definition that several edited modules use lives in one of them; the others import it
    (one class, one cache, whichever module uses it)."""
    out, result = exported
    for feature in result.exported:
        where: dict[str, list[str]] = {}
        for relative in result.files:
            with open(os.path.join(out, relative)) as handle:
                for name in _definitions(handle.read(), feature):
                    where.setdefault(name, []).append(relative)
        assert {n: f for n, f in where.items() if len(f) > 1} == {}, feature
    with open(
        os.path.join(out, "megatron/core/extensions/transformer_engine_spec_provider.py")
    ) as f:
        spec = f.read()
    assert "GroupedMMForward" not in _definitions(spec, "grouped_mm")
    # PatchsetError too: the weight-gradient carve-out in experts.py raises it as well
    imported = "FLAG, GroupedMMForward, PatchsetError"
    assert f"from megatron.core.transformer.moe.experts import {imported}\n" in spec


def test_a_triton_kernel_keeps_its_constexpr_annotations(exported):
    """Annotations are dropped from exported functions, except where a ``jit`` decorator compiles
    the function: grouped_mm's Triton kernel needs ``BLOCK: tl.constexpr``."""
    out, result = exported
    if "grouped_mm" not in result.exported:
        pytest.skip("grouped_mm is not exportable here")
    with open(os.path.join(out, "megatron/core/transformer/moe/experts.py")) as handle:
        tree = ast.parse(handle.read())
    kernels = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name == "add_reversed_kernel"
    ]
    assert len(kernels) == 1
    annotations = {a.arg: ast.unparse(a.annotation) for a in kernels[0].args.args if a.annotation}
    assert annotations == {
        "BLOCK": "tl.constexpr",
        "OVERWRITE": "tl.constexpr",
        "DESCENDING": "tl.constexpr",
    }
    plain = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and n.name == "add_reversed_available"
    ]
    assert plain and plain[0].returns is None  # "-> bool" in the fork's source


def test_patch_files_name_the_pr_and_apply_to_the_pristine_source(exported, tmp_path):
    out, result = exported
    with open(os.path.join(out, "patches", "0001-p2p_overlap.patch")) as handle:
        text = handle.read()
    assert text.startswith("From 0000000000000000000000000000000000000000 ")
    assert "Subject: [PATCH] Delayed weight gradients" in text
    assert "Corresponds to NVIDIA/Megatron-LM#4268" in text
    assert "diff --git a/megatron/training/arguments.py b/megatron/training/arguments.py" in text
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    source = _copy(tmp_path)
    for patch in result.patches:
        subprocess.run(
            ["git", "apply", "--check", os.path.join(out, patch)],
            cwd=source,
            check=True,
            capture_output=True,
        )


def test_exporting_twice_writes_the_same_files(exported, tmp_path):
    out, _ = exported
    again = tmp_path / "again"
    export(installed_source(), str(again))
    export(installed_source(), str(again))
    first, second = _files(out), _files(str(again))
    assert first.keys() == second.keys()
    assert [k for k in first if first[k] != second[k]] == []


def test_exporting_onto_an_exported_tree_replaces_its_regions(exported, tmp_path):
    out, result = exported
    onto = tmp_path / "onto"
    export(out, str(onto))
    for relative in result.files:
        assert filecmp.cmp(os.path.join(out, relative), onto / relative, shallow=False), relative
        with open(onto / relative) as handle:
            text = handle.read()
        for name in features_in(text):
            assert text.count(f"{BEGIN}{name}\n") >= 1


def test_a_renamed_target_refuses_its_feature_by_name(tmp_path):
    source = _copy(tmp_path)
    module = os.path.join(source, "megatron/core/transformer/module.py")
    with open(module) as handle:
        text = handle.read()
    assert text.count("def _te_cuda_graph_capture(") == 1
    with open(module, "w") as handle:
        handle.write(text.replace("def _te_cuda_graph_capture(", "def _te_graph_capture("))
    with pytest.raises(
        ExportRefused,
        match=r"megatron\.core\.transformer\.module\.GraphableMegatronModule\._te_cuda_graph_capture",
    ):
        export(source, str(tmp_path / "out"), ["fsdp_cuda_graphs"])
    # the other feature still exports; the refused one is reported
    result = export(source, str(tmp_path / "out"), ["p2p_overlap", "fsdp_cuda_graphs"])
    assert result.exported == ["p2p_overlap"]
    assert "_te_cuda_graph_capture" in result.refused["fsdp_cuda_graphs"]


def test_a_changed_target_refuses_its_feature_by_name(tmp_path):
    source = _copy(tmp_path)
    gpt = os.path.join(source, "megatron/training/models/gpt.py")
    with open(gpt) as handle:
        text = handle.read()
    with open(gpt, "w") as handle:
        handle.write(text.replace("import GPTModel", "import GPTModel as GPTModel, HybridModel", 1))
    with pytest.raises(ExportRefused, match=r"megatron\.training\.models\.gpt\.GPTModel changed"):
        export(source, str(tmp_path / "out"), ["p2p_overlap"])


def test_a_fork_only_feature_is_refused_with_its_reason(tmp_path):
    with pytest.raises(ExportRefused, match="torch_compile is not exportable: fork-only"):
        export(installed_source(), str(tmp_path / "out"), ["torch_compile"])


def test_the_cli_exports_and_list_says_what_can_be_exported(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "megatron.patchset", "export", "--megatron-lm", installed_source()]
        + ["--out", str(tmp_path), "--feature", "p2p_overlap"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "exported p2p_overlap" in done.stdout
    assert os.path.exists(tmp_path / "patches" / "0001-p2p_overlap.patch")
    listed = subprocess.run(
        [sys.executable, "-m", "megatron.patchset", "--list"], capture_output=True, text=True
    ).stdout
    for feature in features.load():
        section = listed[listed.index(f"\n{feature.name}: ") :]
        line = re.search(r"\n  export: (.*)", section).group(1)
        in_series = feature.name in {change.name for change in changes.series()}
        assert line.startswith("yes, in the patch series") == in_series, feature.name
        assert line.startswith("yes") == (feature.name in EXPORTABLE or in_series), feature.name


def test_the_patches_do_not_depend_on_the_hash_seed(tmp_path):
    """Every exportable feature, exported under two PYTHONHASHSEED values: the same bytes (the
    order of definitions once followed the iteration order of a set of attribute names)."""
    outputs = []
    for seed in ("3", "4"):
        out = tmp_path / seed
        done = subprocess.run(
            [sys.executable, "-m", "megatron.patchset", "export", "--megatron-lm"]
            + [installed_source(), "--out", str(out)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        assert done.returncode == 0, done.stderr
        outputs.append({p.name: p.read_bytes() for p in (out / "patches").glob("*.patch")})
    assert len(outputs[0]) == len(EXPORTABLE) and outputs[0] == outputs[1]
