"""``python -m megatron.patchset --list``: the patch registry as a table."""

import argparse
import sys

from megatron.patchset import __version__, patches


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron.patchset",
        description="megatron-patchset: patches over megatron-core "
        f"{patches.SUPPORTED_MCORE_VERSION}.",
    )
    parser.add_argument("--list", action="store_true", help="Print the registered patches.")
    parser.add_argument(
        "--reasons", action="store_true", help="With --list, add a column with each patch's reason."
    )
    parser.add_argument(
        "--check-versions",
        action="store_true",
        help="Check the installed megatron-core and TransformerEngine versions and exit.",
    )
    opts = parser.parse_args(argv)
    if opts.check_versions:
        try:
            patches.check_versions()
        except patches.PatchsetVersionError as exc:
            print(exc, file=sys.stderr)
            return 1
        te = patches.installed_te_version() or "not installed"
        print(f"megatron-core {patches.installed_mcore_version()}, transformer-engine {te}: OK")
        return 0
    if not opts.list:
        parser.print_help()
        return 0
    print(f"megatron-patchset {__version__} (megatron-core {patches.SUPPORTED_MCORE_VERSION})")
    print(patches.format_table(reasons=opts.reasons))
    return 0


if __name__ == "__main__":
    sys.exit(main())
