"""Build the native CPU kernels ahead of time: `python -m quantlab.kernels.cpu.build`.

Without this the library is built on the first quantized forward pass (one compiler run,
a few seconds, into `$QUANTLAB_CACHE/kernels`); images and CI can pay that once here.
"""

import argparse
import sys
from pathlib import Path

from quantlab.kernels import trusted
from quantlab.kernels.cpu import native


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, help="write the library here instead of the cache folder")
    args = parser.parse_args(argv)
    try:
        path = native.build(args.output)
    except (native.NativeBuildError, trusted.UntrustedLibraryError) as error:
        print(error, file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
