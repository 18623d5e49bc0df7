"""nope: no positional signal; causal masking alone."""

from models.encodings.base import PositionalEncoding, register


@register
class NoPE(PositionalEncoding):
    name = "nope"
