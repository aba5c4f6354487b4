"""A small GPT-2-style causal language model built from a config, and a word-level tokenizer trained at run time.

Used by the synthetic TOFU (:mod:`scrubnet.data.tofu`): nothing is downloaded. The tokenizer is a
``tokenizers`` WordLevel model over the words of the benchmark's *vocabulary text* (templates, value pools,
names), so every record encodes without an unknown token and forgetting a person never changes it. The model is
``transformers.GPT2LMHeadModel`` from a ``GPT2Config`` of one of the :data:`LM_SIZES`:

======  =====================================  =====================================================
size    (n_embd, n_layer, n_head)              use
======  =====================================  =====================================================
ci      (64, 2, 4)        ≈ 0.1 M parameters   the test suite (seconds of CPU)
small   (128, 4, 4)       ≈ 0.9 M parameters   the CPU benchmark (minutes)
gpu     (256, 6, 8)       ≈ 5 M parameters     a GPU when one is lent
======  =====================================  =====================================================

(parameter counts with the ≈ 1 k-word vocabulary of the default benchmark; embeddings are tied).
``transformers`` and ``tokenizers`` come with the ``hf`` / ``tofu`` extras and are imported when used.
"""
from __future__ import annotations

import torch

#: name → (n_embd, n_layer, n_head)
LM_SIZES = {"ci": (64, 2, 4), "small": (128, 4, 4), "gpu": (256, 6, 8)}
PAD, UNK, EOS = "[PAD]", "[UNK]", "[EOS]"
#: the longest sequence (prompt + answer) the benchmark writes, with margin
MAX_POSITIONS = 64


def train_word_tokenizer(lines: list[str]):
    """A ``tokenizers.Tokenizer`` (WordLevel, whitespace-and-punctuation pre-tokenizer) whose vocabulary is every
    word of ``lines``, ids in sorted order after ``[PAD]`` (0), ``[UNK]`` (1), ``[EOS]`` (2): the same lines give
    the same ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=[PAD, UNK, EOS], min_frequency=1)
    tok.train_from_iterator(sorted(set(lines)), trainer=trainer)
    # the trainer orders words by frequency (ties by first sight): re-number alphabetically so that the ids
    # depend on the set of words only
    vocab = tok.get_vocab()
    words = sorted(w for w in vocab if w not in (PAD, UNK, EOS))
    ordered = {PAD: 0, UNK: 1, EOS: 2, **{w: i + 3 for i, w in enumerate(words)}}
    out = Tokenizer(models.WordLevel(vocab=ordered, unk_token=UNK))
    out.pre_tokenizer = pre_tokenizers.Whitespace()
    return out


def make_lm(vocab_size: int, size: str = "ci", seed: int = 0):
    """A freshly initialised ``GPT2LMHeadModel`` of ``LM_SIZES[size]`` (dropout 0, so that training and scoring
    are deterministic functions of the seed), ids ``pad=0``, ``eos=2``."""
    if size not in LM_SIZES:
        raise ValueError(f"size {size!r}: choose one of {', '.join(LM_SIZES)}")
    from transformers import GPT2Config, GPT2LMHeadModel

    d, n_layer, n_head = LM_SIZES[size]
    cfg = GPT2Config(vocab_size=vocab_size, n_positions=MAX_POSITIONS, n_embd=d, n_layer=n_layer, n_head=n_head,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=2, eos_token_id=2,
                     pad_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(int(seed))
    model = GPT2LMHeadModel(cfg)
    model.eval()
    return model
