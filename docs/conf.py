"""Sphinx configuration: ``pip install -e '.[docs]' && sphinx-build docs docs/_build``."""

project = "pymc-gpf"
author = "pymc-gpf developers"
extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
html_theme = "pydata_sphinx_theme"
exclude_patterns = ["_build"]
nb_execution_mode = "off"
