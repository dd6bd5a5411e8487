"""Tiny, random-weight LFM2 models and an LFM2.5-style tokenizer, built locally (no download).

The real checkpoint cannot be fetched here. These keep the real architecture
(`Lfm2ForCausalLM` with short-conv and attention layers, tied embeddings, the
real module names) and the real LFM2.5 chat template shipped with TRL, at a size
that trains on a CPU in seconds.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import Lfm2Config, Lfm2ForCausalLM, PreTrainedTokenizerFast
from trl.chat_template_utils import lfm2_2_5_chat_template

SPECIAL_TOKENS = [
    "<|pad|>", "<|startoftext|>", "<|im_end|>", "<|im_start|>",
    "<|tool_call_start|>", "<|tool_call_end|>", "<|tool_list_start|>", "<|tool_list_end|>",
    "<|tool_response_start|>", "<|tool_response_end|>", "<think>", "</think>",
]
# Layer pattern of the real model family, shortened: conv, conv, attention, conv, attention, conv.
LAYER_TYPES = ["conv", "conv", "full_attention", "conv", "full_attention", "conv"]


def tiny_tokenizer(vocab_size: int | None = None, corpus: list[str] | None = None) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (256 byte tokens + LFM2.5 special tokens) with the LFM2.5 chat template.

    With `vocab_size`, BPE merges up to that many tokens, learned from `corpus` (default: the bundle's own text,
    ENGLISH_CORPUS): the real chain's rows are OpenCode's whole prompt (English instructions and JSON tool schemas,
    ~26k bytes), which then take ~3 bytes a token, so the tiny model trains and scores them ~3x shorter (attention
    ~9x cheaper). Words are split as GPT-2 does (the regex pre-tokenizer), so text between special tokens tokenizes
    the same wherever it is rendered, and a re-rendered turn still extends its prompt (no forks).
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size is None:
        vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
        for ch in sorted(alphabet):
            vocab[ch] = len(vocab)
        backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    else:
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.train_from_iterator(corpus or english_corpus(), trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=sorted(alphabet),
            show_progress=False))
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|startoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
    )
    tokenizer.chat_template = lfm2_2_5_chat_template
    return tokenizer


# The bundle's own English, scripts and code: text like OpenCode's prompt, the same on every machine for a commit.
ENGLISH_CORPUS = ("*.md", "docs/*.md", "tests/README.md", "*.py", "*.sh")


def english_corpus() -> list[str]:
    root = Path(__file__).resolve().parents[1]
    return [path.read_text() for pattern in ENGLISH_CORPUS for path in sorted(root.glob(pattern))]


def tiny_config(vocab_size: int, **overrides: object) -> Lfm2Config:
    """An Lfm2Config with both layer kinds, small enough for CPU tests."""
    kwargs: dict[str, object] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=list(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        block_auto_adjust_ff_dim=False,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(overrides)
    # vLLM's Lfm2ForCausalLM reads the short conv's and the FFN block's width under their original config names, which
    # a config built in code does not write (the real checkpoint's config.json has them).
    kwargs.setdefault("conv_dim", kwargs["hidden_size"])
    kwargs.setdefault("block_dim", kwargs["hidden_size"])
    return Lfm2Config(**kwargs)


def tiny_model(seed: int = 0, vocab_size: int | None = None,
               **overrides: object) -> tuple[Lfm2ForCausalLM, PreTrainedTokenizerFast]:
    """A random-weight tiny Lfm2ForCausalLM (fp32, eval mode) and its tokenizer (tiny_tokenizer(vocab_size))."""
    tokenizer = tiny_tokenizer(vocab_size)
    torch.manual_seed(seed)
    model = Lfm2ForCausalLM(tiny_config(len(tokenizer), **overrides))
    return model.eval(), tokenizer


def save_tiny_model(path: Path, seed: int = 0, vocab_size: int | None = None, **overrides: object) -> Path:
    """Save a tiny model + tokenizer to `path` so code that takes a model id can load it."""
    model, tokenizer = tiny_model(seed, vocab_size, **overrides)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)
