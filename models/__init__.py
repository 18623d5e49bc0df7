"""Decoder LM with explicit position ids, positional encodings and position-id schemes."""

from models.decoder import DecoderLM, ModelConfig, generate
from models.positions import ID_SCHEMES, generation_modes, inference_ids, training_ids, uses_task_ids

ENCODINGS: tuple[str, ...] = ("nope", "learned", "rope", "alibi")

__all__ = [
    "DecoderLM",
    "ModelConfig",
    "generate",
    "ENCODINGS",
    "ID_SCHEMES",
    "generation_modes",
    "inference_ids",
    "training_ids",
    "uses_task_ids",
]
