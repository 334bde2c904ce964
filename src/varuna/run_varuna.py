"""``python -m varuna.run_varuna``: the original launcher's command line (see :mod:`varuna_cli.legacy`)."""

from varuna_cli.legacy import main

if __name__ == "__main__":
    main()
