"""``python -m cli``: the ``kvplane`` command line without its console script."""

from cli.main import main

main()
