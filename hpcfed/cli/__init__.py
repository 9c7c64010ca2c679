"""The ``hpcfed`` command line: one module per command (`hpcfed.cli.commands` dispatches).

Nothing outside this package imports it (a contract in pyproject.toml): the commands are thin
argparse layers over the library.
"""

from hpcfed.cli.commands import main as main  # the console script's entry point (pyproject.toml)
