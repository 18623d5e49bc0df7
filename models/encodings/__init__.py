"""Positional encodings, one module each, registered by name (ENCODINGS); see base.py for the seam.

Importing the package registers the built-in ones, in the order the schema lists them."""

from models.encodings import nope  # noqa: F401, I001  (each registers itself; the order is the registry's)
from models.encodings import learned  # noqa: F401
from models.encodings import rope  # noqa: F401
from models.encodings import alibi  # noqa: F401
from models.encodings import fire  # noqa: F401
from models.encodings import t5_bias  # noqa: F401
from models.encodings.abacus import Abacus
from models.encodings.base import ENCODINGS, PositionalEncoding, register

__all__ = ["ENCODINGS", "Abacus", "PositionalEncoding", "register"]
