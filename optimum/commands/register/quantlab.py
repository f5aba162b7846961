"""`optimum-cli quantlab COMMAND ...`: the quantlab command line, plugged into optimum-cli.

optimum-cli loads every module of the PEP 420 namespace `optimum.commands.register` and adds
the commands in its `REGISTER_COMMANDS`; this file is quantlab's. It hands everything after
`quantlab` to `quantlab.cli.main.main`, so `optimum-cli quantlab quantize ...` runs exactly
`quantlab quantize ...`, method flags, errors and exit codes included. quantlab itself is
imported only when the command runs, so optimum-cli starts as fast as before.

No `__init__.py` may exist in `optimum/`, `optimum/commands/` or here: they are namespace
packages shared with the `optimum` distribution.
"""

import argparse

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo


class QuantlabCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(
        name="quantlab",
        help="quantize, evaluate and inspect models with quantlab ('optimum-cli quantlab' lists the commands)",
    )

    @staticmethod
    def parse_args(parser: argparse.ArgumentParser) -> None:
        parser.description = (
            "The quantlab command line: 'optimum-cli quantlab COMMAND ...' runs 'quantlab COMMAND ...'. "
            "'optimum-cli quantlab' alone lists the commands, 'optimum-cli quantlab COMMAND --help' their options."
        )
        parser.add_argument("quantlab_args", nargs=argparse.REMAINDER, metavar="COMMAND ...", help="a quantlab command")

    def run(self) -> None:
        from quantlab.cli.main import main

        arguments = self.args.quantlab_args or ["--help"]
        # optimum-cli ignores what run() returns: exit with the command's own code.
        raise SystemExit(main(arguments, prog="optimum-cli quantlab"))


REGISTER_COMMANDS = [QuantlabCommand]
