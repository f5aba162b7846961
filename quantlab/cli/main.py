"""The `quantlab` command: one subcommand per module of `quantlab.cli`.

A subcommand is a module listed in `COMMANDS` with two functions: `add_parser(subparsers)`
adds its parser (one or several, nested or not), `run(args) -> int` does the work. A command
that takes a quantization method calls `options.add_method_argument(parser)`; its method's flags
are then added here, once `--method` is known, before the command line is parsed for real.

User mistakes end as one line on stderr, `quantlab: error: ...`, with exit code 2 and no
traceback: `QuantlabError`s, argparse errors, and the operating-system errors a user causes
or can fix (a full disk, a read-only or forbidden folder). Anything else is a bug and keeps
its traceback. Under torchrun (`torchrun -m quantlab quantize ...`, see `quantlab.distributed`)
only rank 0 prints, and a failure is printed once, by the first rank that fails.
"""

import argparse
import contextlib
import errno
import importlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

from quantlab import distributed
from quantlab.cli import options
from quantlab.cli.console import Console, quiet_import_chatter
from quantlab.errors import QuantlabError

# Module names under quantlab.cli, in the order `quantlab --help` lists them; a new command adds its module here.
COMMANDS: list[str] = ["quantize", "evaluate", "methods", "inspect", "prune", "distill", "qat", "export", "finetune"]
# Commands that share their work between the processes torchrun starts: quantize through
# `quantlab.distributed`, the training commands through Trainer (which joins the group and prints once).
DISTRIBUTED_COMMANDS = {"quantize"}
TRAINER_COMMANDS = {"finetune", "distill", "prune", "qat"}

ERROR_PREFIX = "quantlab: error:"
EXIT_USAGE = 2
_OS_ERRORS = {
    errno.ENOSPC: "no space left on the device{where}; nothing was written: free some space or write elsewhere",
    errno.EDQUOT: "disk quota exceeded{where}; nothing was written: free some space or write elsewhere",
    errno.EACCES: "permission denied{where}",
    errno.EPERM: "operation not permitted{where}",
    errno.EROFS: "read-only file system{where}; write elsewhere",
}


class UsageError(Exception):
    """A command line argparse rejected; carries its one-line message."""


class ArgumentParser(argparse.ArgumentParser):
    """Raises `UsageError` instead of printing usage and exiting, so every error is one line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')")


def build_parser(prog: str = "quantlab") -> argparse.ArgumentParser:
    from quantlab import __version__

    parser = ArgumentParser(
        prog=prog,
        description="Pluggable weight quantization: quantize, evaluate and inspect Hugging Face models.",
    )
    parser.add_argument("--version", action="version", version=f"quantlab {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=ArgumentParser)
    for name in COMMANDS:
        module = importlib.import_module(f"quantlab.cli.{name}")
        before = set(subparsers.choices)
        module.add_parser(subparsers)
        for added in set(subparsers.choices) - before:
            subparsers.choices[added].set_defaults(command_module=module)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "quantlab") -> int:
    """Run one quantlab command; returns the exit code (0 success, 2 user error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_import_chatter()
    try:
        args = parse(argv, prog)
    except SystemExit as exit:  # --help, --version
        return exit.code if isinstance(exit.code, int) else 0
    except (UsageError, QuantlabError) as error:
        return _fail(str(error))
    return run(args)


def parse(argv: list[str], prog: str = "quantlab") -> argparse.Namespace:
    parser = build_parser(prog)
    method_parser = _method_options_parser(parser, argv)
    method = options.method_from_argv(argv) if method_parser is not None else None
    if method_parser is not None and method is not None:
        options.add_method_options(method_parser, method)
    args, extras = parser.parse_known_args(argv)
    if extras:
        raise UsageError(options.explain_unrecognized(extras, method))
    return args


class Terminated(BaseException):
    """SIGTERM, raised where the command is, so its cleanup runs (temporary folders removed) as for Ctrl-C."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While a command runs, SIGTERM raises `Terminated` instead of killing the process on the spot."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> int:
    """Run a parsed command, turning user errors into one line on stderr."""
    module: ModuleType = args.command_module
    if distributed.launched() and args.command not in DISTRIBUTED_COMMANDS | TRAINER_COMMANDS:
        return _fail(
            f"'{args.command}' runs in one process; start it without torchrun (only "
            f"{', '.join(sorted(DISTRIBUTED_COMMANDS | TRAINER_COMMANDS))} share their work between processes)"
        )
    try:
        with _sigterm_raises(), _only_rank_zero_prints(args):
            Console.from_args(args).configure_libraries()
            return module.run(args)
    except Terminated:
        _say("quantlab: terminated")
        return 128 + signal.SIGTERM
    except QuantlabError as error:
        return _fail(str(error))
    except OSError as error:
        message = os_error_message(error)
        if message is None:
            raise
        return _fail(message)
    except KeyboardInterrupt:
        _say("quantlab: interrupted")
        return 130
    finally:
        distributed.finish()


@contextlib.contextmanager
def _only_rank_zero_prints(args: argparse.Namespace) -> Iterator[None]:
    """Under torchrun: join the process group; ranks other than 0 run quietly with stdout discarded.
    Training commands are left to Trainer, which joins the group itself and reports from rank 0."""
    if not distributed.launched() or args.command in TRAINER_COMMANDS:
        yield
        return
    distributed.init()
    if distributed.is_main():
        yield
        return
    args.quiet = True
    with open(os.devnull, "w", encoding="utf-8") as devnull, contextlib.redirect_stdout(devnull):
        yield


def os_error_message(error: OSError) -> str | None:
    """One line for the OS errors a user can act on; None for the rest."""
    template = _OS_ERRORS.get(error.errno)
    if template is None:
        return None
    where = f" ({error.filename})" if error.filename and error.errno != errno.ENOSPC else ""
    return template.format(where=where)


def _fail(message: str) -> int:
    if distributed.active():
        message = f"{distributed.describe()}: {message}"
    _say(f"{ERROR_PREFIX} {message}")
    return EXIT_USAGE


def _say(line: str) -> None:
    """A line on stderr that ends the command; under torchrun only the first rank to fail prints it."""
    if distributed.claim_failure():
        print(line, file=sys.stderr, flush=True)


def _method_options_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser | None:
    """The (sub)parser of the command named in `argv`, if that command takes method options."""
    current, words = parser, [word for word in argv if not word.startswith("-")]
    for word in words:
        subcommands = _subcommands(current)
        if word not in subcommands:
            break
        current = subcommands[word]
    return current if current.get_default(options.METHOD_MARKER) else None


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


if __name__ == "__main__":
    sys.exit(main())
