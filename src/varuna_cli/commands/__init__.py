"""One module per ``varuna`` subcommand; :mod:`varuna_cli.app` registers them."""
