"""``python -m sdpa_cli``."""

from sdpa_cli.cli import main

if __name__ == "__main__":
    main(prog_name="sdpa")
