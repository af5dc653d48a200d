"""``python -m megatron.patchset``: the registry by feature (``--list``), the version guard,
``recipe`` (the flags of a named recipe) and ``export`` (each feature as source edits to a
Megatron-LM checkout)."""

import argparse
import sys

from megatron.patchset import __version__
from megatron.patchset.core import listing, versions


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["export"]:
        from megatron.patchset.export import cli

        return cli.main(argv[1:])
    if argv[:1] == ["recipe"]:
        from megatron.patchset.recipes import cli as recipe_cli

        return recipe_cli.main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m megatron.patchset",
        description=f"megatron-patchset {__version__}: patches over megatron-core "
        f"{versions.SUPPORTED_MCORE_VERSION}, grouped by feature. 'python -m megatron.patchset "
        "export --help': each feature as source edits to a Megatron-LM checkout; "
        "'python -m megatron.patchset recipe --help': the flags of a named recipe.",
    )
    parser.add_argument(
        "--list", action="store_true", help="Print every feature with its flags, rules and patches."
    )
    parser.add_argument(
        "--reasons", action="store_true", help="With --list, add each patch's reason."
    )
    parser.add_argument(
        "--check-versions",
        action="store_true",
        help="Check the installed megatron-core and TransformerEngine versions and exit.",
    )
    opts = parser.parse_args(argv)
    if opts.check_versions:
        try:
            versions.check_versions()
        except versions.PatchsetVersionError as exc:
            print(exc, file=sys.stderr)
            return 1
        te = versions.installed_te_version() or "not installed"
        print(f"megatron-core {versions.installed_mcore_version()}, transformer-engine {te}: OK")
        return 0
    if not opts.list:
        parser.print_help()
        return 0
    print(listing.format_list(reasons=opts.reasons))
    return 0


if __name__ == "__main__":
    sys.exit(main())
