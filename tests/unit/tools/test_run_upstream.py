"""tools/bench/run_upstream.py runs a Megatron-LM checkout's script against the installed
megatron-core, not against the checkout's own ``megatron/``."""

import os
import subprocess
import sys

from tests.unit.conftest import ROOT

ENTRY = os.path.join(ROOT, "tools", "bench", "run_upstream.py")
SCRIPT = """\
import megatron.core
import megatron.legacy
import megatron.training
import model_provider

print("core", megatron.core.__file__)
print("training", megatron.training.__file__)
print("legacy", megatron.legacy.__file__)
print("sibling", model_provider.VALUE)
"""


def checkout(tmp_path):
    """A stand-in Megatron-LM checkout: a script, a sibling module, and its own megatron/ as a
    namespace portion (as Megatron-LM has it: no megatron/__init__.py) with core and training,
    which the installed package has too, and legacy, which it has not."""
    for package in ("core", "training", "legacy"):
        folder = tmp_path / "megatron" / package
        folder.mkdir(parents=True)
        (folder / "__init__.py").write_text("__version__ = '0.19.1'\n")
    (tmp_path / "model_provider.py").write_text("VALUE = 7\n")
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(SCRIPT)
    return script


def launch(argv, folder=None):
    """``argv`` in a fresh interpreter, ``folder`` first on PYTHONPATH (None: no PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_PATCHSET")}
    if folder is None:
        env.pop("PYTHONPATH", None)
    else:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=300
    )


def run(argv, folder):
    done = launch(argv, folder)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    return dict(line.split(" ", 1) for line in lines if line.split(" ")[0].isalpha()), lines


def test_the_checkout_s_megatron_does_not_replace_the_installed_one(tmp_path):
    script = checkout(tmp_path)
    # The same script run directly, its folder first on PYTHONPATH: the checkout's package wins.
    direct, _ = run([str(script)], tmp_path)
    assert direct["core"].startswith(str(tmp_path))
    out, lines = run([ENTRY, str(script)], tmp_path)
    assert not out["core"].startswith(str(tmp_path)), out
    assert not out["training"].startswith(str(tmp_path)), out
    assert out["legacy"].startswith(str(tmp_path)), out  # only the checkout has it
    assert out["sibling"] == "7"
    assert any(line.startswith(f"> run_upstream: {script} with patches:") for line in lines)


def test_the_checkout_under_another_name_moves_too(tmp_path):
    """PYTHONPATH names the checkout only through a link, the script through its real path: both
    are the same folder, accepted as on the path, and it still goes behind the installed
    packages."""
    real = tmp_path / "real"
    real.mkdir()
    script = checkout(real)
    link = tmp_path / "link"
    link.symlink_to(real)
    out, _ = run([ENTRY, str(script)], str(link))
    assert not out["core"].startswith(str(tmp_path)), out
    assert out["sibling"] == "7"


def test_a_folder_off_the_path_is_refused(tmp_path):
    done = launch([ENTRY, str(checkout(tmp_path))])
    assert done.returncode != 0
    assert "is not on PYTHONPATH" in done.stderr
