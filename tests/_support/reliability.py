"""Helpers of the reliability and fault tests (tests/numerics/test_reliability.py, test_faults.py): a tiny saved
Llama with a byte-level tokenizer, random-word corpora, the CLI's tiny budget, a results directory's one record."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from rope_quant.sweep import records
from rope_quant.sweep.manifest import read_manifest

TINY = ["--seqlen", "64", "--calib-windows", "2", "--eval-windows", "2", "--weights", "rtn", "--no-w-mse",
        "--seeds", "0", "--no-figures", "--quiet"]
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "
         "tau upsilon phi chi psi omega rotation quantise angle pair head key value query model").split()


def corpus_text(seed: int, n_words: int = 6000) -> str:
    """Random words in paragraphs (blank lines), different for each seed."""
    rng = random.Random(seed)
    paragraphs = [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(n_words // 60)]
    return "\n\n".join(paragraphs) + "\n"



def save_tiny_model(directory: Path, seed: int = 0) -> Path:
    """A 2-layer random Llama (head_dim 16, GQA 4/2) and a byte-level BPE tokenizer, saved for ``--model``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([corpus_text(0, 600)], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).eval().save_pretrained(directory)
    fast.save_pretrained(directory)
    return directory



def only_record(out: Path) -> dict:
    (entry,) = read_manifest(out)["cells"]
    return records.read_record(out / entry["path"])
