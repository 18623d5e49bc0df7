"""Decoder LM with explicit position ids, positional encodings and position-id schemes."""

from models.decoder import DecoderLM, ModelConfig, generate
from models.positions import (
                              ENCODINGS,
                              ID_SCHEMES,
                              PositionalScheme,
                              generation_modes,
                              inference_ids,
                              training_ids,
                              uses_task_ids,
)

__all__ = [
    "DecoderLM",
    "ModelConfig",
    "PositionalScheme",
    "generate",
    "ENCODINGS",
    "ID_SCHEMES",
    "generation_modes",
    "inference_ids",
    "training_ids",
    "uses_task_ids",
]
