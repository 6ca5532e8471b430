"""Loader: model resolution, GGUF conversion cache, draft-format delegation, vocab checks."""

from __future__ import annotations

import os
import shutil
import sys
import time
import types

import pytest
import torch

from specdec.models import cache, loader
from specdec.models import gguf as gguf_dirs
from specdec.config import CacheConfig, ModelConfig
from specdec.errors import IncompatibleDraftError
from specdec.kv.kv_cache import SLOT_ATTENTION_NAME
from specdec.models.resolve import resolve_model_dir


def save_word_level_tokenizer(path, vocab: dict[str, int]) -> str:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(str(path))
    return str(path)


# SmolLM2 logits reach ~20; float32 rounding over 30 layers differs by up to ~1.4e-4 between a
# masked ragged batch and a single causal forward (the same check in float64 agrees to 1e-13).
REAL_FLOAT32_TOLERANCE = 2e-4
BASE_VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "draft": 5}


def test_resolve_and_load_local_hf_dir_round_trips(tiny_llama, tiny_llama_dir, tmp_path):
    model_dir = tiny_llama_dir(tmp_path / "tiny", seed=3)
    cfg = ModelConfig(model=model_dir, dtype="float64")
    assert resolve_model_dir(cfg) == os.path.abspath(model_dir)
    model = loader.load_model(cfg)
    assert not model.training and model.dtype == torch.float64
    assert model.config._attn_implementation == SLOT_ATTENTION_NAME
    original = tiny_llama(seed=3, dtype=torch.float64)
    tokens = torch.tensor([[1, 9, 27, 4]])
    with torch.no_grad():
        assert (model(tokens).logits - original(tokens).logits).abs().max() < 1e-10


def test_resolve_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an alias"):
        resolve_model_dir(ModelConfig(model=str(tmp_path / "missing")))
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_dir(ModelConfig(model=str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        resolve_model_dir(ModelConfig(model=str(tmp_path), gguf_file="x.gguf"))


def fake_gguf(tmp_path, monkeypatch):
    """A fake .gguf file, a private cache root, and a conversion double that counts calls."""
    gguf = tmp_path / "src" / "fake-model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF-test")
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    calls = []

    def convert(gguf_path, out_dir):
        calls.append((gguf_path, out_dir))
        with open(os.path.join(out_dir, gguf_dirs.HF_CONFIG_FILE), "w") as f:
            f.write("{}")

    monkeypatch.setattr(gguf_dirs, "_convert_gguf", convert)
    return str(gguf), calls


def test_gguf_is_converted_once_into_the_cache(tmp_path, monkeypatch):
    gguf, calls = fake_gguf(tmp_path, monkeypatch)
    first = resolve_model_dir(ModelConfig(model=gguf))
    second = resolve_model_dir(ModelConfig(model=str(tmp_path / "src"), gguf_file="fake-model.gguf"))
    assert first == second and len(calls) == 1
    assert first.startswith(str(tmp_path / "cache" / "models" / "fake-model-"))
    assert os.listdir(os.path.dirname(first)) == [os.path.basename(first)]  # temp dir gone


def test_gguf_cache_is_keyed_on_content_not_path(tmp_path, monkeypatch):
    gguf, calls = fake_gguf(tmp_path, monkeypatch)
    copy = tmp_path / "other-venv" / "fake-model.gguf"
    copy.parent.mkdir()
    shutil.copyfile(gguf, copy)
    os.utime(copy, ns=(1, 1))  # another install: other path, other mtime, same bytes
    first = resolve_model_dir(ModelConfig(model=gguf))
    assert resolve_model_dir(ModelConfig(model=str(copy))) == first and len(calls) == 1
    copy.write_bytes(b"GGUF-other")  # other content: its own conversion
    assert resolve_model_dir(ModelConfig(model=str(copy))) != first and len(calls) == 2


def test_gguf_conversion_race_uses_the_winners_dir(tmp_path, monkeypatch):
    gguf, _ = fake_gguf(tmp_path, monkeypatch)
    final = resolve_model_dir(ModelConfig(model=gguf))  # learn the cache dir name
    shutil.rmtree(final)

    def convert_but_lose_the_race(gguf_path, out_dir):
        os.makedirs(final)  # another process renames its finished dir into place first
        with open(os.path.join(final, gguf_dirs.HF_CONFIG_FILE), "w") as f:
            f.write('{"winner": true}')
        with open(os.path.join(out_dir, gguf_dirs.HF_CONFIG_FILE), "w") as f:
            f.write("{}")

    monkeypatch.setattr(gguf_dirs, "_convert_gguf", convert_but_lose_the_race)
    assert resolve_model_dir(ModelConfig(model=gguf)) == final
    with open(os.path.join(final, gguf_dirs.HF_CONFIG_FILE)) as f:
        assert "winner" in f.read()
    assert os.listdir(os.path.dirname(final)) == [os.path.basename(final)]  # loser's temp removed


def test_load_model_delegates_draft_format(tiny_llama, tmp_path, monkeypatch):
    (tmp_path / gguf_dirs.DRAFT_FORMAT_MARKER).write_text("{}")
    seen = []

    def load_draft(model_dir, cfg):
        seen.append((model_dir, cfg))
        return tiny_llama()

    monkeypatch.setitem(sys.modules, "specdec.models.draft_format", types.SimpleNamespace(load_draft=load_draft))
    cfg = ModelConfig(model=str(tmp_path))
    model = loader.load_model(cfg)
    assert seen == [(str(tmp_path), cfg)]
    assert model.config._attn_implementation == SLOT_ATTENTION_NAME


def test_check_vocab_compat(tmp_path):
    target = save_word_level_tokenizer(tmp_path / "target", BASE_VOCAB)
    same = save_word_level_tokenizer(tmp_path / "same", dict(BASE_VOCAB))
    smaller = save_word_level_tokenizer(
        tmp_path / "smaller", {t: i for t, i in BASE_VOCAB.items() if i < 5}
    )
    swapped = save_word_level_tokenizer(tmp_path / "swapped", {**BASE_VOCAB, "hello": 4, "world": 3})
    foreign = save_word_level_tokenizer(tmp_path / "foreign", {**BASE_VOCAB, "other": 6})
    loader.check_vocab_compat(target, same)
    loader.check_vocab_compat(target, smaller)
    with pytest.raises(IncompatibleDraftError, match="2 of 6 draft tokens.*'hello': draft id 4, target id 3"):
        loader.check_vocab_compat(target, swapped)
    with pytest.raises(IncompatibleDraftError, match="'other': draft id 6, target id None"):
        loader.check_vocab_compat(target, foreign)


def test_cli_resolve_prints_the_dir(tiny_llama_dir, tmp_path, capsys):
    model_dir = tiny_llama_dir(tmp_path / "tiny")
    assert loader.main(["resolve", model_dir]) == 0
    assert capsys.readouterr().out.strip() == os.path.abspath(model_dir)
    assert loader.main(["resolve", str(tmp_path / "missing")]) == 2


def test_real_smollm2_alias_conversion_and_slot_cache_decoding(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.engine.runner import ModelRunner

    started = time.perf_counter()
    assert resolve_model_dir(ModelConfig()) == smollm2_dir
    assert time.perf_counter() - started < 5.0  # cached: no second conversion
    assert os.path.isfile(os.path.join(smollm2_dir, "model.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a colour."}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    assert prompt[0] == 1 and prompt[-1] == 198  # <|im_start|> ... "assistant\n"
    runner = ModelRunner(ModelConfig(num_threads=1), CacheConfig(max_num_seqs=2, max_model_len=128))
    assert runner.vocab_size == 49152 and 2 in runner.eos_token_ids
    slots = [runner.allocate_slot(), runner.allocate_slot()]
    seqs = [list(prompt), list(prompt[:-9])]  # ragged: two prompt lengths
    last = runner.prefill(slots, [list(s) for s in seqs])
    for i in range(2):
        seqs[i].append(int(last[i].argmax()))
    got = [[last[0]], [last[1]]]
    for q_lens in ([1, 1], [1, 3], [2, 1]):  # decode steps, then verify-like multi-token rows
        rows = [seqs[i][-1:] + [(seqs[i][-1] * 7 + j) % 49152 for j in range(q - 1)] for i, q in enumerate(q_lens)]
        logits = runner.forward(slots, rows)
        for i, row in enumerate(rows):
            seqs[i] += row[1:]
            got[i] += list(logits[i, : len(row)])
            seqs[i].append(int(logits[i, len(row) - 1].argmax()))
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    for i, prompt_len in enumerate([len(prompt), len(prompt) - 9]):
        with torch.no_grad():
            expected = reference(torch.tensor([seqs[i][:-1]])).logits[0, prompt_len - 1 :]
        assert (torch.stack(got[i]) - expected).abs().max() < REAL_FLOAT32_TOLERANCE


def test_specdec_loader_names_the_packaged_gguf_and_the_loading_entry_points():
    from specdec import loader

    path = loader.packaged_gguf_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert loader.resolve_model_dir is resolve_model_dir and callable(loader.load_model)
