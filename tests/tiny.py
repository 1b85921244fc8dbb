"""Tiny random-weight mlx-lm llama models: right for mechanics, never for speed claims."""

import mlx.core as mx
from mlx_lm.models import llama


def make_tiny(seed: int, vocab: int = 64, layers: int = 2, hidden: int = 32, sharpen: float = 1.0):
    """A random llama; ``sharpen`` scales the output head so distributions are peaky."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    model = llama.Model(args)
    if sharpen != 1.0:
        model.lm_head.weight = model.lm_head.weight * sharpen
    mx.eval(model.parameters())
    return model
