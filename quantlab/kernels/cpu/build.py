"""Build the native CPU kernels ahead of time: `python -m quantlab.kernels.cpu.build`.

Without this the C library and the torch operator extension are built on the first quantized
forward pass (a few seconds, and about ten more for the operators) into the private cache
`$QUANTLAB_CACHE/kernels`; images and CI can pay that once here. Prints each library's path.
`--output` writes only the C library to a chosen path, for `QUANTLAB_CPU_KERNELS`.
"""

import argparse
import sys
from pathlib import Path

from quantlab.kernels import trusted
from quantlab.kernels.cpu import extension, native


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, help="write the C library here instead of the cache folder")
    args = parser.parse_args(argv)
    try:
        print(native.build(args.output))
        if args.output is None and extension.enabled():
            print(extension.build())
    except (native.NativeBuildError, trusted.UntrustedLibraryError) as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
