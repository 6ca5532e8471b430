"""Gateway detokenizer units on the real SmolLM2 tokenizer: incremental decoding, stop strings."""
from __future__ import annotations

from gateway.detokenizer import IncrementalDetokenizer, StopStringChecker


def test_detokenizer_matches_full_decode(tokenizer):
    text = "Ünïcödé ✓ 日本語 text 🙂🙂 end"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=[1, 2])
    deltas = [detok.add_token(i) for i in ids]
    assert "".join(deltas) == tokenizer.decode(ids) == text


def test_stop_checker_holds_back_possible_stop_prefix():
    checker = StopStringChecker(("STOP",))
    assert checker.num_streamable_chars("abcST", is_finished=False) == 2
    assert checker.find("abcST", 2) is None
    match = checker.find("abcSTOP", 2)
    assert match is not None and match.text_end == 3
    assert StopStringChecker(("STOP",), include_stop_str_in_output=True).find("abcSTOP", 2).text_end == 7
