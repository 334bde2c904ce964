"""``python -m varuna_cli`` runs the ``varuna`` command."""

from varuna_cli.app import main

if __name__ == "__main__":
    main()
