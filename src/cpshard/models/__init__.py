"""Small example models for demos and tests: plain PyTorch, built from a config and a seed.

* :class:`TinyDecoder`: a Llama-style decoder that knows nothing about CP (its attention is a
  plain ``F.scaled_dot_product_attention``; cpshard's ``ctx()`` makes it see the global sequence).
* :class:`TinyVLM`: a pre-embedding vision-language decoder. Its hook
  ``prepare_model_inputs_for_cp`` runs a small trainable vision encoder on ``pixel_values`` and
  scatters the image features into the token embeddings: the batch's ``input_ids`` and
  ``pixel_values`` are consumed and trainable ``inputs_embeds`` take their place.
* :class:`GlobalPrefixDecoder`: a decoder that owns its CP. Its attention is block-local plus a
  fixed prefix of global tokens, and its hook returns its own :class:`cpshard.CPSharder`, which
  gives every rank a copy of the prefix and whole blocks of the rest (tokens are repositioned;
  ``sharder.input_token_stream_positions`` says where each caller token went).

Each works through :func:`cpshard.prepare_cp_forward` at every CP size (the hook runs at
``cp=1`` too, so the reference runs the same path).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from cpshard.models.decoder import TinyDecoder, TinyDecoderConfig
from cpshard.models.global_prefix import GlobalPrefixConfig, GlobalPrefixDecoder
from cpshard.models.vlm import TinyVLM, TinyVLMConfig, with_images

__all__ = [
    "GlobalPrefixConfig",
    "GlobalPrefixDecoder",
    "TinyDecoder",
    "TinyDecoderConfig",
    "TinyVLM",
    "TinyVLMConfig",
    "with_images",
]
