"""The installed version (a leaf module: the DataTree's attributes read it too)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pymc-gpf")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+unknown"
