"""The patch registry: declaration, apply, idempotence, revert, version guard, vanished targets."""

import sys

import pytest

from megatron.patchset.core import features, versions
from megatron.patchset.core import registry as real_registry
from megatron.patchset.core.registry import patch
from tests.unit.support import fake_upstream

FAKE = "tests.unit.support.fake_upstream"


def replace_with(obj):
    """A factory that ignores the original (a plain replacement)."""
    return lambda _original: obj


@pytest.fixture
def registry(monkeypatch):
    """An empty registry (the real one is restored afterwards) with the version guard passing."""
    features.load()  # the real patches register first, into the real registry
    monkeypatch.setattr(real_registry, "_REGISTRY", {})
    monkeypatch.setattr(real_registry, "_APPLIED", {})
    yield real_registry
    real_registry.revert()


def test_apply_replaces_and_is_idempotent(registry):
    def helper(x):
        return x + 100

    patch("fake.helper", f"{FAKE}.helper", reason="r", upstream_pr="proposed")(replace_with(helper))

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

    @patch("fake.scale", f"{FAKE}.Widget.scale", reason="r", upstream_pr="proposed")
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

    def describe():
        return "patched"

    patch("fake.describe", f"{FAKE}.Widget.describe", reason="r", upstream_pr="proposed")(
        replace_with(describe)
    )

    @patch("fake.build", f"{FAKE}.Widget.build", reason="r", upstream_pr="proposed")
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
    def inherited(self):
        return "widget"

    patch("fake.inherited", f"{FAKE}.Widget.inherited", reason="r", upstream_pr="proposed")(
        replace_with(inherited)
    )

    assert "inherited" not in fake_upstream.Widget.__dict__
    registry.apply_patches(registry.registered())
    assert fake_upstream.Widget().inherited() == "widget"
    assert fake_upstream.Base().inherited() == "base"
    registry.revert()
    assert "inherited" not in fake_upstream.Widget.__dict__
    assert fake_upstream.Widget().inherited() == "base"


def test_apply_selects_by_flags(registry):
    def helper(x):
        return -x

    patch(
        "fake.on",
        f"{FAKE}.helper",
        reason="r",
        upstream_pr="proposed",
        flags=("--fake-on",),
        enabled=lambda a: a.fake_on,
    )(replace_with(helper))

    class Args:
        fake_on = False

    assert registry.apply(Args()) == []
    assert fake_upstream.helper(1) == 2
    Args.fake_on = True
    assert registry.apply(Args()) == ["fake.on"]
    assert registry.apply(Args()) == []
    assert fake_upstream.helper(1) == -1


def test_skip_env_leaves_named_patches_out(registry, monkeypatch, capsys):
    def helper(x):
        return -x

    patch("fake.on", f"{FAKE}.helper", reason="r", upstream_pr="proposed", flags=("--fake-on",))(
        replace_with(helper)
    )

    monkeypatch.setenv(registry.SKIP_ENV, "fake.on")
    assert registry.apply(object()) == []
    assert fake_upstream.helper(1) == 2
    assert "leaves out fake.on" in capsys.readouterr().out
    monkeypatch.setenv(registry.SKIP_ENV, "fake.on,no.such")
    with pytest.raises(registry.PatchsetError, match=r"no patch named no\.such; python -m"):
        registry.apply(object())
    monkeypatch.setenv(registry.SKIP_ENV, "fake.of")
    with pytest.raises(registry.PatchsetError, match=r"fake\.of \(did you mean fake\.on\?\)"):
        registry.apply(object())
    monkeypatch.delenv(registry.SKIP_ENV)
    assert registry.apply(object()) == ["fake.on"]
    assert fake_upstream.helper(1) == -1


def test_two_patches_on_one_target_are_refused(registry):
    patch("fake.a", f"{FAKE}.helper", reason="r", upstream_pr="proposed")(replace_with(lambda x: 0))
    patch("fake.b", f"{FAKE}.helper", reason="r", upstream_pr="proposed")(replace_with(lambda x: 1))
    with pytest.raises(registry.PatchsetError, match="already replaced by patch 'fake.a'"):
        registry.apply_patches(registry.registered())


def test_vanished_target_names_target_and_versions(registry):
    patch(
        "fake.gone",
        "megatron.core.datasets.utils.compile_helpers_v2",
        reason="r",
        upstream_pr="proposed",
    )(replace_with(None))
    with pytest.raises(registry.PatchTargetError) as err:
        registry.apply_patches(registry.registered())
    text = str(err.value)
    assert "megatron.core.datasets.utils.compile_helpers_v2" in text
    assert "0.19.2" in text and "compile_helpers_v2" in text


def test_vanished_class_in_path(registry):
    patch("fake.gone2", f"{FAKE}.Gadget.scale", reason="r", upstream_pr="proposed")(
        replace_with(None)
    )
    with pytest.raises(registry.PatchTargetError, match="has no attribute 'Gadget'"):
        registry.apply_patches(registry.registered())


def test_missing_module_is_a_target_error(registry):
    patch("fake.nomod", "megatron.core.no_such_area.fn", reason="r", upstream_pr="proposed")(
        replace_with(None)
    )
    with pytest.raises(registry.PatchTargetError, match="no_such_area"):
        registry.apply_patches(registry.registered())


def test_version_guard_refuses_other_megatron_core(registry, monkeypatch):
    monkeypatch.setattr(
        real_registry, "check_versions", lambda: versions.check_versions(mcore_version="0.20.0")
    )
    patch("fake.v", f"{FAKE}.helper", reason="r", upstream_pr="proposed")(replace_with(lambda x: 0))
    with pytest.raises(versions.PatchsetVersionError) as err:
        registry.apply_patches(registry.registered())
    assert "0.20.0" in str(err.value) and "0.19.2" in str(err.value)
    assert fake_upstream.helper(1) == 2  # nothing applied


def test_version_guard_names_where_megatron_core_came_from(monkeypatch):
    """A detected version that is not the pinned one: the error names the folder megatron.core
    was imported from (where a Megatron-LM checkout would shadow the installed package)."""
    import os

    import megatron.core

    monkeypatch.setattr(versions, "installed_mcore_version", lambda: "0.19.1")
    with pytest.raises(versions.PatchsetVersionError) as err:
        versions.check_versions(te_version=None)
    folder = os.path.dirname(os.path.abspath(megatron.core.__file__))
    assert f"megatron-core 0.19.1 is installed (megatron.core from {folder})" in str(err.value)


@pytest.mark.parametrize(
    "te, ok",
    [
        (None, True),
        ("2.20.2", True),
        ("2.20.3", True),
        ("2.21.0", False),
        ("2.19.1", False),
        ("2.20.0", False),
    ],
)
def test_version_guard_transformer_engine_range(te, ok):
    if ok:
        versions.check_versions(mcore_version="0.19.2", te_version=te)
    else:
        with pytest.raises(versions.PatchsetVersionError) as err:
            versions.check_versions(mcore_version="0.19.2", te_version=te)
        assert te in str(err.value) and "2.20.2" in str(err.value)


def test_upstream_mode_refuses_feature_patches(registry, monkeypatch):
    patch(
        "fake.feature",
        f"{FAKE}.helper",
        reason="r",
        upstream_pr="proposed",
        flags=("--fake",),
        enabled=lambda a: True,
    )(replace_with(lambda x: 0))
    monkeypatch.setenv("MEGATRON_PATCHSET", "off")
    with pytest.raises(registry.PatchsetError, match="--fake"):
        registry.apply(object())
    assert fake_upstream.helper(1) == 2


def test_upstream_mode_applies_compat_and_observe(registry, monkeypatch):
    patch("fake.compat", f"{FAKE}.helper", reason="r", upstream_pr="proposed", kind="compat")(
        replace_with(lambda x: 7)
    )
    monkeypatch.setenv("MEGATRON_PATCHSET", "off")
    assert registry.apply(object()) == ["fake.compat"]


def test_real_registry_applies_and_reverts_cleanly():
    registry = real_registry
    """The shipped patches resolve against the installed megatron-core and revert exactly."""
    import megatron.core.datasets.utils as dutils

    before = dutils.compile_helpers
    names = registry.apply_patches([registry.get("compat.compile_helpers")])
    try:
        assert names == ["compat.compile_helpers"]
        assert registry.patched_by(dutils.compile_helpers) == "compat.compile_helpers"
        dutils.compile_helpers()  # the wheel's extension imports: no make, no exit
    finally:
        registry.revert(names)
    assert dutils.compile_helpers is before


def _defined_in_source(target: str) -> bool:
    """``module.Class.method`` is defined in the module's source (for megatron's TE wrapper
    classes, which are placeholders when TransformerEngine is not installed, as on the CPU)."""
    import ast
    import importlib

    module_name, class_name, method = target.rsplit(".", 2)
    tree = ast.parse(open(importlib.import_module(module_name).__file__).read())
    return any(
        isinstance(node, ast.ClassDef)
        and node.name == class_name
        and any(isinstance(f, ast.FunctionDef) and f.name == method for f in node.body)
        for node in ast.walk(tree)
    )


def test_every_registered_target_exists_in_the_pinned_wheel():
    from unittest import mock

    registry = real_registry
    checked_in_source = []
    for declared in registry.registered():
        target = declared.target
        assert declared.reason and declared.upstream and declared.kind in registry.KINDS
        try:
            owner, attr = registry.resolve_owner(target)
        except registry.PatchTargetError:
            module_name, class_name, _ = target.rsplit(".", 2)
            placeholder = getattr(sys.modules.get(module_name), class_name, None)
            assert isinstance(placeholder, mock.Mock), target  # only TE's absence excuses it
            assert _defined_in_source(target), target
            checked_in_source.append(declared.name)
            continue
        assert hasattr(owner, attr), target
    # Only the TE wrappers' methods need the source check (and only without TE).
    assert all(name.startswith("torch_compile.te_") for name in checked_in_source), (
        checked_in_source
    )
    assert not _defined_in_source(
        "megatron.core.extensions.transformer_engine.TELinear.no_such_method"
    )


def test_a_feature_patch_takes_its_features_switches_predicate_and_pr():
    grouped = real_registry.get("grouped_mm.fc1")
    feature = features.get("grouped_mm")
    assert grouped.feature == "grouped_mm" and grouped.module.endswith(".linears")
    assert grouped.when == feature.switches and grouped.upstream == feature.upstream_pr

    class Args:
        moe_grouped_gemm_impl = "te"

    assert not grouped.wanted(Args()) and not grouped.wanted(None)
    Args.moe_grouped_gemm_impl = "torch"
    assert grouped.wanted(Args())
    splits = real_registry.get("grouped_mm.splits_on_device_dispatcher")
    assert splits.when == ("--moe-expert-splits-on-device",) and not splits.wanted(Args())


def test_every_feature_patch_lives_in_a_feature_and_every_core_patch_is_compat_or_observe():
    for declared in real_registry.registered():
        if declared.feature is None:
            assert declared.kind in ("compat", "observe"), declared.name
            assert declared.module.startswith("megatron.patchset.core."), declared.name
        else:
            assert declared.module.startswith(f"megatron.patchset.features.{declared.feature}."), (
                declared.name
            )


def declare_in(module: str, name: str, kind: str = "feature") -> None:
    """Declare a patch of fake_upstream.helper from ``module`` (the registry takes the declaring
    module from the caller's globals)."""
    namespace = {"__name__": module, "patch": patch}
    exec(
        f"@patch({name!r}, {FAKE + '.helper'!r}, reason='r', upstream_pr='proposed', kind={kind!r})"
        "\ndef factory(original):\n    return original\n",
        namespace,
    )


def test_a_feature_patch_must_be_named_after_its_folder(registry):
    declare_in("megatron.patchset.features.torch_adam.kernels", "torch_adam.fused")
    assert registry._REGISTRY["torch_adam.fused"].feature == "torch_adam"
    for name in ("optimizer.fused", "torch_adamw.fused", "torch_adam", "torch_adam.", "fused"):
        with pytest.raises(registry.PatchsetError, match=r"must be named torch_adam\.<what>"):
            declare_in("megatron.patchset.features.torch_adam.kernels", name)
    declare_in("megatron.patchset.features.paged_stash.report", "paged_stash.counts", "observe")
    with pytest.raises(registry.PatchsetError, match=r"paged_stash\.<what>"):
        declare_in("megatron.patchset.features.paged_stash.report", "observe.counts", "observe")
    assert list(registry._REGISTRY) == ["torch_adam.fused", "paged_stash.counts"]


def test_a_core_patch_must_be_a_compat_or_observe_patch_named_after_its_kind(registry):
    declare_in("megatron.patchset.core.compat", "compat.fix", "compat")
    declare_in("megatron.patchset.core.observe.metrics", "observe.count", "observe")
    with pytest.raises(registry.PatchsetError, match=r"must be named compat\.<what>"):
        declare_in("megatron.patchset.core.compat", "datasets.fix", "compat")
    with pytest.raises(registry.PatchsetError, match=r"must be named observe\.<what>"):
        declare_in("megatron.patchset.core.observe.metrics", "compat.count", "observe")
    with pytest.raises(registry.PatchsetError, match="not 'feature'"):
        declare_in("megatron.patchset.core.model_hooks", "feature.hook")
    assert list(registry._REGISTRY) == ["compat.fix", "observe.count"]


def test_every_shipped_patch_is_named_after_its_feature_or_its_kind():
    for declared in real_registry.registered():
        prefix = declared.feature if declared.feature is not None else declared.kind
        assert declared.name.startswith(prefix + "."), (declared.name, declared.module)


def _calls_patch(call) -> bool:
    import ast

    func = call.func
    if isinstance(func, ast.Name):
        return func.id == "patch"
    # registry.patch(...); not unittest.mock's patch (mock.patch) in the upstream test files
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "patch"
        and isinstance(func.value, ast.Name)
        and func.value.id == "registry"
    )


def test_every_shipped_patch_is_declared_by_the_decorator_on_a_module_level_factory():
    """One call shape: ``@patch(...)`` on a function of the declaring module; ``patch(...)``
    called anywhere else (inline on a factory, in a loop) is refused here."""
    import ast
    from pathlib import Path

    import megatron.patchset

    root = Path(megatron.patchset.__file__).parent
    elsewhere = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        decorators = {
            id(d)
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            for d in node.decorator_list
        }
        elsewhere += [
            f"{path.relative_to(root)}:{node.lineno}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and _calls_patch(node) and id(node) not in decorators
        ]
    assert not elsewhere, "patch(...) not used as a decorator: " + ", ".join(elsewhere)
    for declared in real_registry.registered():
        module = sys.modules[declared.module]
        assert getattr(module, declared.factory.__name__, None) is declared.factory, declared.name


def test_feature_descriptors_validate_themselves():
    from megatron.patchset.core.errors import PatchsetError
    from megatron.patchset.core.features import Feature

    with pytest.raises(PatchsetError, match="status 'beta'"):
        Feature(
            name="x", title="x", switches=(), enabled=bool, upstream_pr="proposed", status="beta"
        )
    with pytest.raises(PatchsetError, match="flags and add_arguments go together"):
        Feature(
            name="x",
            title="x",
            switches=(),
            enabled=bool,
            upstream_pr="proposed",
            status="stable",
            flags=("--x",),
        )
    Feature(
        name="x",
        title="x",
        switches=(),
        enabled=bool,
        upstream_pr="proposed",
        status="not yet verified on 4 GPUs",
    )
