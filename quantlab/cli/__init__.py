"""The `quantlab` command line. Each subcommand is one module listed in `quantlab.cli.main.COMMANDS`."""
