"""A Hugging Face causal LM measured by the analysis commands (`python -m study.loss_gap --hf PATH`,
`python -m study.sparsity --hf PATH`): the model behind the DecoderLM call signature, and its tokens.
`transformers` is an optional extra."""

from __future__ import annotations

import numpy as np
import torch


class HFCausalLM(torch.nn.Module):
    """A Hugging Face causal LM behind the DecoderLM call signature (logits first; `visible` as a
    4D mask), so the same analysis measures a real LLM. `transformers` is an optional extra."""

    def __init__(self, path: str, attention: bool = False):
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager" if attention else None)

    def forward(self, tokens, position_ids, visible=None, cache=None):
        mask = None
        if visible is not None:
            T = tokens.shape[1]
            mask = (visible & torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril())[:, None]
        return self.model(input_ids=tokens, position_ids=position_ids, attention_mask=mask).logits, None, None

    @torch.no_grad()
    def attention_mass(self, window: torch.Tensor) -> torch.Tensor:
        context = window[:-1][None]
        out = self.model(input_ids=context, output_attentions=True)
        return sum(a[0, :, -1].mean(0) for a in out.attentions)


def hf_tokens(path: str, text_tokens_fallback: np.ndarray) -> np.ndarray:
    """Token ids for a Hugging Face model: its tokenizer when the folder has one, else the corpus's
    byte ids (a byte-level model, e.g. the tiny test model)."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return text_tokens_fallback
    from tasks.lm import decode_text

    text = decode_text(text_tokens_fallback).replace("<eos>", "\n")
    return np.asarray(tokenizer(text)["input_ids"], dtype=np.int64)
