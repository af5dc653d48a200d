"""The feature folders and ORDER: every folder under megatron/patchset/features/ loads, and every
patch and rule of a feature is declared in a module that loading imports."""

import importlib
import pkgutil
from pathlib import Path

import pytest

import megatron.patchset.features as features_package
from megatron.patchset.core import features, registry, rules
from megatron.patchset.features import ORDER


def feature_folders() -> list[str]:
    """The package directories (with an ``__init__.py``) under megatron/patchset/features/."""
    root = Path(features_package.__file__).parent
    return sorted(p.name for p in root.iterdir() if (p / "__init__.py").is_file())


def test_order_names_every_feature_folder_once():
    folders = feature_folders()
    assert len(set(ORDER)) == len(ORDER), f"ORDER names a feature twice: {ORDER}"
    not_in_order = sorted(set(folders) - set(ORDER))
    assert not not_in_order, (
        f"features/{', '.join(not_in_order)} never load: add them to "
        "megatron/patchset/features/__init__.py:ORDER"
    )
    missing = sorted(set(ORDER) - set(folders))
    assert not missing, f"ORDER names {', '.join(missing)}, which has no folder with __init__.py"


def test_every_feature_folder_loads_under_its_name():
    loaded = features.load()
    assert [f.name for f in loaded] == list(ORDER)
    for feature in loaded:
        assert feature.package == f"{features_package.__name__}.{feature.name}"
        assert features.get(feature.name) is feature


def test_no_patch_or_rule_is_declared_where_loading_does_not_import(monkeypatch):
    """Importing every module of every feature folder after load() registers nothing new: a
    module that declares a patch or a rule is imported by its feature (``Feature.modules`` or
    what they import)."""
    features.load()
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(rules, "_RULES", list(rules._RULES))
    patches, rule_names = set(registry._REGISTRY), {r.name for r in rules._RULES}
    for module in pkgutil.walk_packages(features_package.__path__, features_package.__name__ + "."):
        importlib.import_module(module.name)
    assert set(registry._REGISTRY) == patches, (
        "patches declared in modules that no feature loads: "
        + ", ".join(sorted(set(registry._REGISTRY) - patches))
    )
    assert {r.name for r in rules._RULES} == rule_names


@pytest.mark.parametrize("feature", ORDER)
def test_a_features_patches_are_declared_in_its_folder_and_named_after_it(feature):
    loaded = features.get(feature)
    for p in loaded.patches:
        assert p.module.startswith(loaded.package + "."), (p.name, p.module)
        assert p.name.startswith(feature + "."), p.name
