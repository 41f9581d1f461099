"""A tiny OpenOneRec model: a random Qwen3 with a byte-level tokenizer that knows `<think>` and
`</think>`, its vocabulary expanded with OpenOneRec's SID tokens.

Two expansions, the same facts: `expand_vocab` here (the tokenizer's add_tokens of
`<s_a_0>..`, `<s_b_0>..`, ..., `<|sid_begin|>`, `<|sid_end|>` in that order, then the model's
embeddings resized to the next multiple of 256), and `expand_with_openonerec`, which runs
OpenOneRec's own pretrain/tools/model_converter/expand_qwen3_vocab.py from a snapshot of its
repository (tests/support/peers.py; the test skips without one).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tests.support.checkpoints import write_checkpoint
from tests.support.peers import extract

OPENONEREC = "Kuaishou-OneRec/OpenOneRec"
EXPAND_SCRIPT = "pretrain/tools/model_converter/expand_qwen3_vocab.py"
BASE_VOCAB = 264  # 256 bytes and 3 added tokens, a few rows spare (Qwen3's are too)


def write_base(path: Path, seed: int = 0) -> Path:
    """A tiny random Qwen3 whose tokenizer spells text as bytes (Qwen3's byte-level alphabet,
    no merges), with `<|endoftext|>` (EOS), `<think>` and `</think>` as added tokens."""
    write_checkpoint(path, seed=seed, vocab_size=BASE_VOCAB)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"eos_token": "<|endoftext|>"})
    fast.add_tokens(["<think>", "</think>"])
    assert len(fast) <= BASE_VOCAB
    fast.save_pretrained(path)
    return path


def sid_tokens(levels: int, codes: int) -> list[str]:
    """OpenOneRec's SID tokens in its order: every code of level a, then b, ..., then the
    two delimiters."""
    letters = [chr(ord("a") + d) for d in range(levels)]
    return [f"<s_{x}_{c}>" for x in letters for c in range(codes)] + [
        "<|sid_begin|>",
        "<|sid_end|>",
    ]


def expand_vocab(src: Path, dst: Path, levels: int, codes: int) -> Path:
    """The expansion as OpenOneRec describes it, done here: add the SID tokens, resize the
    embeddings to a multiple of 256, save model, tokenizer and config."""
    tok = transformers.AutoTokenizer.from_pretrained(src)
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    tok.add_tokens(sid_tokens(levels, codes))
    target = -(-len(tok) // 256) * 256
    model.resize_token_embeddings(target)
    model.config.vocab_size = target
    tok.save_pretrained(dst)
    model.save_pretrained(dst)
    return dst


def expand_with_openonerec(src: Path, dst: Path, levels: int, codes: int, work: Path) -> str:
    """Run OpenOneRec's own expansion script (from its snapshot) on `src`; returns the
    snapshot's commit. Skips the calling test without a snapshot."""
    commit = extract(OPENONEREC, EXPAND_SCRIPT, work)
    argv = [sys.executable, str(work / EXPAND_SCRIPT), "--hf_model_dir", str(src)]
    argv += ["--output_model_dir", str(dst), "--itemic_layer_n", str(levels)]
    argv += ["--vocab_size_per_layer", str(codes)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return commit


def spread_sid_rows(path: Path, seed: int, first: int) -> Path:
    """Give the rows from `first` on (the added tokens) distinct random values, as training
    would: the expansion starts them all near the old embeddings' mean, so every item scores
    alike to 1e-6 and a beam order would be decided by rounding."""
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
            rows = weight[first:]
            rows.add_(torch.randn(rows.shape, generator=gen) * 2 * rows.std())
    model.save_pretrained(path)
    return path
