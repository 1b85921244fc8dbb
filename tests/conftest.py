"""Shared fixtures: tiny random mlx-lm llama models saved as MLX dirs with a real tokenizer."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "import os\nfor i in range(10):\n    print(i, os.getcwd())\n",
    "class Point:\n    x: int = 0\n    y: int = 0\n",
]
SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2


def tiny_tokenizer(corpus: list[str] | None = None, extra_tokens: int = 0, vocab_size: int = 320):
    """A byte-level BPE PreTrainedTokenizerFast; `extra_tokens` appends <extra_i> tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus or CORPUS, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    if extra_tokens:
        tok.add_tokens([f"<extra_{i}>" for i in range(extra_tokens)])
    return tok


def tiny_config(vocab_size: int, **over) -> dict:
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    return config | over


def make_tiny_model(
    path: Path,
    *,
    seed: int = 0,
    corpus: list[str] | None = None,
    extra_tokens: int = 0,
    vocab_size: int | None = None,
    **config_over,
) -> Path:
    """Save a random tiny llama + tokenizer as an MLX model dir; logits width = tokenizer size."""
    from mlx_lm.models import llama
    from mlx_lm.utils import save_config, save_model

    tok = tiny_tokenizer(corpus, extra_tokens)
    config = tiny_config(vocab_size or len(tok), **config_over)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    save_model(path, model)
    save_config(dict(config), path / "config.json")
    tok.save_pretrained(str(path))
    return path


@pytest.fixture
def tiny_model_factory(tmp_path):
    """make(name, **options) -> Path of a tiny MLX model dir under tmp_path."""
    return lambda name="tiny", **kw: make_tiny_model(tmp_path / name, **kw)


@pytest.fixture
def tiny_model(tiny_model_factory) -> Path:
    return tiny_model_factory()


@pytest.fixture
def specmlx_home(tmp_path, monkeypatch) -> Path:
    """An empty $SPECMLX_HOME, and no user/$SPECMLX_MODELS registry overrides."""
    home = tmp_path / "specmlx-home"
    monkeypatch.setenv("SPECMLX_HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("SPECMLX_MODELS", raising=False)
    monkeypatch.delenv("SPECMLX_MEMORY_BUDGET", raising=False)
    return home
