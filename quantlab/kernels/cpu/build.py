"""Build the native CPU kernels ahead of time: `python -m quantlab.kernels.cpu.build`.

Without this the C library and the torch operator extension are built on the first quantized
forward pass (a few seconds, and about ten more for the operators) into the private cache
`$QUANTLAB_CACHE/kernels`, and each format's product at many rows is measured at its first such call
(`quantlab.kernels.cpu.tune`); images and CI can pay that once here. Prints each library's path, and the
measurement's (`--no-measure` leaves it to first use: an image built on another CPU than it runs on).
`--output` writes only the C library to a chosen path, for `QUANTLAB_CPU_KERNELS`.
"""

import argparse
import sys
from pathlib import Path

from quantlab.kernels import trusted
from quantlab.kernels.cpu import extension, native, tune


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, help="write the C library here instead of the cache folder")
    parser.add_argument("--no-measure", action="store_true", help="do not measure the products on this machine")
    args = parser.parse_args(argv)
    try:
        print(native.build(args.output))
        if args.output is None and extension.enabled():
            print(extension.build())
        lib = native.library() if args.output is None and not args.no_measure else None
        if lib is not None and tune.setting() == "measured":
            tune.settle_all(lib)
            print(tune.cache_path(lib))
    except (native.NativeBuildError, trusted.UntrustedLibraryError) as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
