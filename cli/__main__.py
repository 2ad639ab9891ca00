"""``python -m api.cli``: the ``kvplane`` command line without its console script."""

from api.cli.main import main

main()
