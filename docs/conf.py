"""Sphinx configuration of hpcfed's documentation site (docs/).

Build it as CI does (strict: any warning, broken link or missing reference fails):

    sphinx-build -W --keep-going -n -b html docs /tmp/hpcfed-docs

Why Sphinx (with furo and MyST): the pages are Markdown and stay readable on GitHub; autodoc reads
the API reference from the docstrings; the CLI and configuration references are generated from
argparse and the config dataclasses at build time (docs/_ext/hpcfed_reference.py); and Sphinx has
been maintained for two decades (MkDocs' Material theme announces its end of life for May 2027).
Nothing is fetched from the network while building.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "hpcfed"
author = "the hpcfed developers"
copyright = "2026, the hpcfed developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "hpcfed_reference"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "**/.ipynb_checkpoints"]
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence", "deflist"]
html_theme = "furo"
html_title = "hpcfed"
html_static_path: list[str] = []
autodoc_typehints = "description"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "undoc-members": False}
# Pages link to the repository's files (configs/, tools/, tests/): those are not documents.
myst_url_schemes = ["http", "https", "mailto"]
# Type hints name numpy, pathlib, pandas ... classes: their inventories would have to be fetched
# (intersphinx), and the build fetches nothing. Every other reference must resolve.
nitpick_ignore_regex = [("py:class", r".*")]
suppress_warnings = ["myst.header"]
