"""Sphinx configuration of the fedparity documentation (Sphinx + MyST + furo).

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html``. The API reference is
generated at build time from each package's ``__all__`` (``docs/_ext/api_reference.py``); no
generated file is committed and nothing is fetched from the network.
"""

from __future__ import annotations

import sys
from importlib.metadata import version as _version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "fedparity"
author = "fedparity contributors"
copyright = "2026, fedparity contributors"
release = _version("fedparity")
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "numpydoc",
    "sphinx.ext.mathjax",
    "api_reference",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "Thumbs.db", ".DS_Store"]

# MyST: $...$ math, definition lists, heading anchors for links like page.md#section.
myst_enable_extensions = ["dollarmath", "deflist", "colon_fence"]
myst_heading_anchors = 3

# Every cross-reference must resolve (the papers page links functions by name).
nitpicky = True
# Except one name: the node modules load torch only in the handlers that use a model (a
# deployed SuperNode starts a process for every message), so ``torch`` is imported for type
# checkers only there. autodoc then cannot evaluate those signatures and shows them as
# written; the handler type alias ``Handler`` (``Callable[[Message, Context], Message]``) in
# them is no documented class.
nitpick_ignore = [("py:class", "Handler")]

# autodoc + numpydoc: the docstrings' numpydoc sections; type hints in the signatures.
# numpydoc renames each docstring's "[1]" citations so that many on one page do not collide.
autodoc_typehints = "signature"
autodoc_member_order = "bysource"
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_validation_checks: set[str] = set()
autosummary_generate = False

html_theme = "furo"
html_title = f"fedparity {release}"
html_static_path: list[str] = []
