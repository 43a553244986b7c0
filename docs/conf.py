"""Sphinx configuration of the elastic-runner documentation (``docs/``).

Build: ``python3 -m sphinx -W -b html docs docs/_build/html`` (the ``docs`` extra; the tests
build it the same way, warnings as errors). The reference pages are generated from the code at
build time (``_ext/er_reference.py``); the examples are included from ``examples/``.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))  # the checkout's elastic_runner, also when not installed

import elastic_runner  # noqa: E402

project = "elastic-runner"
author = "elastic-runner developers"
copyright = "2026, elastic-runner developers"
release = version = elastic_runner.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinxarg.ext",
    "sphinx_copybutton",
    "er_reference",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "_tools", "bench/*.json", "**/.ipynb_checkpoints"]
root_doc = "index"
# commands and options are copied from these pages: ``--`` must stay two hyphens, not become
# an en dash, and quotes must stay straight
smartquotes = False
copybutton_prompt_text = r"\$ "  # a leading "$ " is not copied
copybutton_prompt_is_regexp = True

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # links to a page's sections: page.md#section-title

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"elastic-runner {release}"
html_static_path = ["_static"]
html_css_files = ["er.css"]
