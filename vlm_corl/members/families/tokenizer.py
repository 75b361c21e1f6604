"""Offline byte-level BPE tokenizers for the tiny-model zoo, trained on a corpus that ships with the package.

Every machine trains the same tokenizer from `zoo_corpus.txt` (BPE training in `tokenizers` is deterministic for a
fixed corpus and vocabulary size), so zoo models built anywhere share token ids. Each family then appends its own
special tokens after the learned vocabulary, in the order the family lists them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = Path(__file__).with_name("zoo_corpus.txt")
BASE_VOCAB_SIZE = 768  # 256 byte symbols + ~500 merges: enough for whole words of the easy-vqa/math vocabulary

# Reasoning/answer tags of the prompt styles: single, ordinary (decoded, never suppressed) tokens, so a tiny model
# can learn the output format in a few steps.
FORMAT_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")


@functools.lru_cache(maxsize=None)
def _trained_bpe(vocab_size: int) -> str:
    """The learned byte-level BPE as tokenizer.json text (cached: training takes ~0.1 s and runs once per process)."""
    tok = Tokenizer(models.BPE())
    # Byte-level pre-tokenisation (GPT-2 regex, no prefix space) is what the Qwen, Llama-3 and Gemma tokenizers
    # approximate; every string round-trips through bytes.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(CORPUS)], trainer)
    return tok.to_str()


@dataclass(frozen=True)
class TokenizerSpec:
    """What a zoo tokenizer holds beyond the shared BPE (`tokenizer_from_spec`): `special_tokens` appended in order,
    then FORMAT_TOKENS, then the family's `ordinary_tokens` (single, decoded pieces its released tokenizer has,
    e.g. Gemma's runs of newlines).

    `bos`/`eos`/`pad` must be among `special_tokens`. `named_tokens` become attributes that processors read
    (e.g. {"image_token": "<|image_pad|>"} gives `tokenizer.image_token` and `tokenizer.image_token_id`) and are
    saved in tokenizer_config.json. `vocab_size` is the learned BPE's."""

    special_tokens: list[str]
    bos: str | None
    eos: str
    pad: str
    named_tokens: dict[str, str] | None = None
    chat_template: str | None = None
    vocab_size: int = BASE_VOCAB_SIZE
    ordinary_tokens: tuple[str, ...] = ()


def build_tokenizer(
    special_tokens: list[str],
    *,
    bos: str | None,
    eos: str,
    pad: str,
    named_tokens: dict[str, str] | None = None,
    chat_template: str | None = None,
) -> PreTrainedTokenizerFast:
    """`tokenizer_from_spec` of a tokenizer with no ordinary tokens over the shared BPE of BASE_VOCAB_SIZE (the
    zoo's generic architectures: ChatML turn tokens and the specials a processor names); see `TokenizerSpec`."""
    return tokenizer_from_spec(TokenizerSpec(special_tokens, bos, eos, pad, named_tokens, chat_template))


def tokenizer_from_spec(spec: TokenizerSpec) -> PreTrainedTokenizerFast:
    """A left-padding fast tokenizer: the shared BPE plus the spec's tokens (`TokenizerSpec`).

    No BOS/EOS is added on encode: chat templates write them, so rendering with
    `apply_chat_template(..., tokenize=False)` and then tokenizing never doubles them.
    """
    tok = Tokenizer.from_str(_trained_bpe(spec.vocab_size))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec.special_tokens])
    ordinary = FORMAT_TOKENS + tuple(spec.ordinary_tokens)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ordinary])
    named = dict(spec.named_tokens or {})
    # Control tokens that are not named attributes are "extra" specials so decode(skip_special_tokens=True) drops them.
    named_values = {spec.bos, spec.eos, spec.pad, *named.values()}
    extra = [t for t in spec.special_tokens if t not in named_values]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=spec.bos,
        eos_token=spec.eos,
        pad_token=spec.pad,
        extra_special_tokens=extra,
        model_specific_special_tokens=named,
        chat_template=spec.chat_template,
        padding_side="left",  # decoder-only batched generation; a constructor argument survives save_pretrained
        clean_up_tokenization_spaces=False,
    )
