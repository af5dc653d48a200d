"""The patch registry: apply, idempotence, revert, version guard, vanished targets, --list."""

import subprocess
import sys

import pytest

from megatron.patchset import patches
from tests.unit import fake_upstream

FAKE = "tests.unit.fake_upstream"


@pytest.fixture
def registry(monkeypatch):
    """An empty registry (the real one is restored afterwards) with the version guard passing."""
    monkeypatch.setattr(patches, "_REGISTRY", {})
    monkeypatch.setattr(patches, "_APPLIED", {})
    monkeypatch.setattr(patches, "_areas_loaded", True)
    yield patches
    patches.revert()


def test_apply_replaces_and_is_idempotent(registry):
    @registry.register("fake.helper", f"{FAKE}.helper", reason="r", upstream_pr="none")
    def helper(x):
        return x + 100

    original = fake_upstream.helper
    assert registry.apply_patches(registry.registered()) == ["fake.helper"]
    assert fake_upstream.call_helper_via_module(1) == 101
    assert registry.patched_by(fake_upstream.helper) == "fake.helper"
    assert fake_upstream.helper.__wrapped__ is original
    # Second application: nothing new, same object installed.
    installed = fake_upstream.helper
    assert registry.apply_patches(registry.registered()) == []
    assert fake_upstream.helper is installed
    assert registry.revert() == ["fake.helper"]
    assert fake_upstream.helper is original
    assert fake_upstream.call_helper_via_module(1) == 2


def test_wrapping_factory_receives_the_original(registry):
    seen = []

    @registry.register("fake.scale", f"{FAKE}.Widget.scale", reason="r", upstream_pr="none", wraps=True)
    def wrap_scale(original):
        def scale(self, x):
            seen.append(x)
            return original(self, x) + 1

        return scale

    registry.apply_patches(registry.registered())
    assert fake_upstream.Widget().scale(3) == 7
    assert seen == [3]
    registry.revert()
    assert fake_upstream.Widget().scale(3) == 6


def test_static_and_class_methods_keep_their_kind_and_revert(registry):
    static_before = fake_upstream.Widget.__dict__["describe"]
    class_before = fake_upstream.Widget.__dict__["build"]

    @registry.register("fake.describe", f"{FAKE}.Widget.describe", reason="r", upstream_pr="none")
    def describe():
        return "patched"

    @registry.register("fake.build", f"{FAKE}.Widget.build", reason="r", upstream_pr="none", wraps=True)
    def wrap_build(original):
        def build(cls):
            obj = original(cls)
            obj.tag = "built"
            return obj

        return build

    registry.apply_patches(registry.registered())
    assert isinstance(fake_upstream.Widget.__dict__["describe"], staticmethod)
    assert fake_upstream.Widget.describe() == "patched"
    assert fake_upstream.Widget().describe() == "patched"
    assert isinstance(fake_upstream.Widget.__dict__["build"], classmethod)
    assert fake_upstream.Widget.build().tag == "built"
    registry.revert()
    assert fake_upstream.Widget.__dict__["describe"] is static_before
    assert fake_upstream.Widget.__dict__["build"] is class_before


def test_inherited_attribute_is_deleted_again_on_revert(registry):
    @registry.register("fake.inherited", f"{FAKE}.Widget.inherited", reason="r", upstream_pr="none")
    def inherited(self):
        return "widget"

    assert "inherited" not in fake_upstream.Widget.__dict__
    registry.apply_patches(registry.registered())
    assert fake_upstream.Widget().inherited() == "widget"
    assert fake_upstream.Base().inherited() == "base"
    registry.revert()
    assert "inherited" not in fake_upstream.Widget.__dict__
    assert fake_upstream.Widget().inherited() == "base"


def test_apply_selects_by_flags(registry):
    @registry.register("fake.on", f"{FAKE}.helper", reason="r", upstream_pr="none",
                       flags=("--fake-on",), enabled=lambda a: a.fake_on)
    def helper(x):
        return -x

    class Args:
        fake_on = False

    assert registry.apply(Args()) == []
    assert fake_upstream.helper(1) == 2
    Args.fake_on = True
    assert registry.apply(Args()) == ["fake.on"]
    assert registry.apply(Args()) == []
    assert fake_upstream.helper(1) == -1


def test_skip_env_leaves_named_patches_out(registry, monkeypatch, capsys):
    @registry.register("fake.on", f"{FAKE}.helper", reason="r", upstream_pr="none", flags=("--fake-on",))
    def helper(x):
        return -x

    monkeypatch.setenv(patches.SKIP_ENV, "fake.on")
    assert registry.apply(object()) == []
    assert fake_upstream.helper(1) == 2
    assert "leaves out fake.on" in capsys.readouterr().out
    monkeypatch.setenv(patches.SKIP_ENV, "fake.on,no.such")
    with pytest.raises(patches.PatchsetError, match="no patch named no.such"):
        registry.apply(object())
    monkeypatch.delenv(patches.SKIP_ENV)
    assert registry.apply(object()) == ["fake.on"]
    assert fake_upstream.helper(1) == -1


def test_two_patches_on_one_target_are_refused(registry):
    registry.register("fake.a", f"{FAKE}.helper", reason="r", upstream_pr="none")(lambda x: 0)
    registry.register("fake.b", f"{FAKE}.helper", reason="r", upstream_pr="none")(lambda x: 1)
    with pytest.raises(patches.PatchsetError, match="already replaced by patch 'fake.a'"):
        registry.apply_patches(registry.registered())


def test_vanished_target_names_target_and_versions(registry):
    registry.register("fake.gone", "megatron.core.datasets.utils.compile_helpers_v2",
                      reason="r", upstream_pr="none")(lambda: None)
    with pytest.raises(patches.PatchTargetError) as err:
        registry.apply_patches(registry.registered())
    text = str(err.value)
    assert "megatron.core.datasets.utils.compile_helpers_v2" in text
    assert "0.19.2" in text and "compile_helpers_v2" in text


def test_vanished_class_in_path(registry):
    registry.register("fake.gone2", f"{FAKE}.Gadget.scale", reason="r", upstream_pr="none")(lambda: None)
    with pytest.raises(patches.PatchTargetError, match="has no attribute 'Gadget'"):
        registry.apply_patches(registry.registered())


def test_missing_module_is_a_target_error(registry):
    registry.register("fake.nomod", "megatron.core.no_such_area.fn", reason="r", upstream_pr="none")(lambda: None)
    with pytest.raises(patches.PatchTargetError, match="no_such_area"):
        registry.apply_patches(registry.registered())


def test_version_guard_refuses_other_megatron_core(registry, monkeypatch):
    monkeypatch.setattr(patches, "installed_mcore_version", lambda: "0.20.0")
    registry.register("fake.v", f"{FAKE}.helper", reason="r", upstream_pr="none")(lambda x: 0)
    with pytest.raises(patches.PatchsetVersionError) as err:
        registry.apply_patches(registry.registered())
    assert "0.20.0" in str(err.value) and "0.19.2" in str(err.value)
    assert fake_upstream.helper(1) == 2  # nothing applied


@pytest.mark.parametrize("te, ok", [(None, True), ("2.20.2", True), ("2.20.3", True),
                                    ("2.21.0", False), ("2.19.1", False), ("2.20.0", False)])
def test_version_guard_transformer_engine_range(te, ok):
    if ok:
        patches.check_versions(mcore_version="0.19.2", te_version=te)
    else:
        with pytest.raises(patches.PatchsetVersionError) as err:
            patches.check_versions(mcore_version="0.19.2", te_version=te)
        assert te in str(err.value) and "2.20.2" in str(err.value)


def test_upstream_mode_refuses_feature_patches(registry, monkeypatch):
    registry.register("fake.feature", f"{FAKE}.helper", reason="r", upstream_pr="none",
                      flags=("--fake",), enabled=lambda a: True)(lambda x: 0)
    monkeypatch.setenv("MEGATRON_PATCHSET", "off")
    with pytest.raises(patches.PatchsetError, match="--fake"):
        registry.apply(object())
    assert fake_upstream.helper(1) == 2


def test_upstream_mode_applies_compat_and_observe(registry, monkeypatch):
    registry.register("fake.compat", f"{FAKE}.helper", reason="r", upstream_pr="none", kind="compat")(lambda x: 7)
    monkeypatch.setenv("MEGATRON_PATCHSET", "off")
    assert registry.apply(object()) == ["fake.compat"]


def test_real_registry_applies_and_reverts_cleanly():
    """The shipped patches resolve against the installed megatron-core and revert exactly."""
    import megatron.core.datasets.utils as dutils

    before = dutils.compile_helpers
    names = patches.apply_patches([patches.get("datasets.compile_helpers")])
    try:
        assert names == ["datasets.compile_helpers"]
        assert patches.patched_by(dutils.compile_helpers) == "datasets.compile_helpers"
        dutils.compile_helpers()  # the wheel's extension imports: no make, no exit
    finally:
        patches.revert(names)
    assert dutils.compile_helpers is before


def _defined_in_source(target: str) -> bool:
    """``module.Class.method`` is defined in the module's source (for megatron's TE wrapper
    classes, which are placeholders when TransformerEngine is not installed, as on the CPU)."""
    import ast
    import importlib

    module_name, class_name, method = target.rsplit(".", 2)
    tree = ast.parse(open(importlib.import_module(module_name).__file__).read())
    return any(isinstance(node, ast.ClassDef) and node.name == class_name
               and any(isinstance(f, ast.FunctionDef) and f.name == method for f in node.body)
               for node in ast.walk(tree))


def test_every_registered_target_exists_in_the_pinned_wheel():
    from unittest import mock

    checked_in_source = []
    for patch in patches.registered():
        target = patch.target
        assert patch.reason and patch.upstream_pr and patch.kind in patches.KINDS
        try:
            owner, attr = patches.resolve_owner(target)
        except patches.PatchTargetError:
            module_name, class_name, _ = target.rsplit(".", 2)
            placeholder = getattr(sys.modules.get(module_name), class_name, None)
            assert isinstance(placeholder, mock.Mock), target  # only TE's absence excuses it
            assert _defined_in_source(target), target
            checked_in_source.append(patch.name)
            continue
        assert hasattr(owner, attr), target
    # Only the TE wrappers' methods need the source check (and only without TE).
    assert all(name.startswith("compile.te_") for name in checked_in_source), checked_in_source
    assert not _defined_in_source("megatron.core.extensions.transformer_engine.TELinear.no_such_method")


def test_list_cli_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "megatron.patchset", "--list"],
                         capture_output=True, text=True, check=True).stdout
    assert "upstream target" in out and "upstream PR" in out
    for patch in patches.registered():
        assert patch.name in out and patch.target in out
