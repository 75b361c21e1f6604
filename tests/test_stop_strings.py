"""Where the HF engine's stop strings end a response: at the first token whose bytes complete one, as
`generate`'s `StopStringCriteria` decides, at every position of many token sequences of every tiny tokenizer,
against the bytes themselves. The zoo's tokenizers are byte-level, so a non-ASCII character can be split over
tokens that each decode to a replacement character: the case a matcher over decoded text gets wrong."""

import random

import pytest
import torch
from cohort_helpers import shipped_families
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.generation.stopping_criteria import StopStringCriteria

from vlm_corl.members.engines.hf import StopStrings

# Stops spanning tokens, inside one token, of one character, two at once, and non-ASCII ones (split into bytes)
STOPS = [("</answer>",), ("ns",), ("x",), ("\n\n",), ("ab", "</paraphrase>"), ("é",), ("€ done",), ("名前",)]
BYTE_OF = {char: byte for byte, char in bytes_to_unicode().items()}  # a byte-level token's characters: its bytes
# The zoo's tokenizers share one byte-level vocabulary and differ in their special tokens and classes: these three
# hold every difference (gemma3's own specials, the fast and the Python Qwen2 tokenizer)
FAMILIES = [f for f in ("gemma3", "qwen2_vl", "qwen2") if f in shipped_families()]
PIECES = ["a", "b", "x", "é", "€", " done", "</", "answer>", "名前", "\n", "Hello ", "<|im_end|>", "</paraphrase>"]


def _sequences(tok, rng: random.Random, stop: tuple[str, ...]) -> list[list[int]]:
    """Token sequences of random texts from PIECES and the stop strings, some ending in random tokens."""
    rows = []
    for _ in range(25):
        text = "".join(rng.choice(PIECES + list(stop)) for _ in range(rng.randint(1, 10)))
        rows.append(tok(text, add_special_tokens=False)["input_ids"] + rng.sample(range(len(tok)), rng.randint(0, 2)))
    return rows


def _completes_by_bytes(tok, ids: list[int], stop: tuple[str, ...]) -> bool:
    """The reference: a stop string's bytes occur in the bytes of `ids` and end inside the last token."""
    pieces = [
        bytes(BYTE_OF[c] for c in t) if all(c in BYTE_OF for c in t) else t.encode()
        for t in tok.convert_ids_to_tokens(ids)
    ]
    text, before = b"".join(pieces), len(b"".join(pieces[:-1]))
    return any(text.find(s.encode(), max(0, before - len(s.encode()) + 1)) != -1 for s in stop)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_stop_ends_a_row_at_the_first_token_whose_bytes_complete_it(tiny_zoo, family):
    tok = AutoTokenizer.from_pretrained(tiny_zoo[family])
    rng = random.Random(0)
    for stop in STOPS:
        ours, library = StopStrings(tok, stop), StopStringCriteria(tok, list(stop))
        rows = _sequences(tok, rng, stop) + [tok(stop[0], add_special_tokens=False)["input_ids"][:1]]  # a first token
        expected = [[_completes_by_bytes(tok, row[:k], stop) for k in range(1, len(row) + 1)] for row in rows]
        assert any(any(e) for e in expected) and not all(all(e) for e in expected)  # the cases do exercise it
        for row, want in zip(rows, expected):
            assert [bool(library(torch.tensor([row[:k]]), None)[0]) for k in range(1, len(row) + 1)] == want
            assert [ours.ends_in_last(row[:k]) for k in range(1, len(row) + 1)] == want, (stop, row)
        # the decode loop's question: each row's first stop within its own tokens (`lengths`; past them, tokens
        # that hold the stop), asked over the tokens since the last sync point, every token (a CPU) or every 8
        width, fill = max(map(len, rows)), tok(stop[0], add_special_tokens=False)["input_ids"]
        tokens = torch.tensor([row + (fill * width)[: width - len(row)] for row in rows])
        lengths, batch = torch.tensor([len(row) for row in rows]), torch.arange(len(rows))
        first = [want.index(True) + 1 if True in want else 1 << 30 for want in expected]
        for every in (1, 8):
            hits = [
                ours.first_hits(tokens, batch, lengths, s, min(s + every, width) - 1) for s in range(0, width, every)
            ]
            assert torch.stack(hits).min(dim=0).values.tolist() == first, (stop, every)
