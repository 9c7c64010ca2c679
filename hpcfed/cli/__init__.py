"""The ``hpcfed`` command line: one module per command (`hpcfed.cli.main` dispatches).

Nothing outside this package imports it (a contract in pyproject.toml): the commands are thin
argparse layers over the library.
"""

from hpcfed.cli.main import main as main  # the console script's entry point (pyproject.toml)
