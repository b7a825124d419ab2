"""Custom generation methods from Hub repos and local directories: resolve, check requirements, gate on
trust, import as a package, then run (a whole loop) or register for one call (hook implementations)."""

from .method import LoadedMethod, bind_to_model, load, load_method
from .requirements import check_requirements, parse_requirements, unmet_requirements
from .source import MethodSource, from_directory, resolve
from .trust import UntrustedCodeError, trusted_revision

__all__ = [
    "LoadedMethod",
    "MethodSource",
    "UntrustedCodeError",
    "bind_to_model",
    "check_requirements",
    "from_directory",
    "load",
    "load_method",
    "parse_requirements",
    "resolve",
    "trusted_revision",
    "unmet_requirements",
]
