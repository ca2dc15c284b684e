"""``python -m opsched``: the opsched command (:mod:`opsched.cli`)."""

from opsched.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
