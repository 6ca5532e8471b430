"""Distillation task stage (distill.tasks): task prompts answered by a target, warm start."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from distill import run as distill
from distill import tasks as distill_tasks
from specdec.models import draft_format as fmt
from specdec.errors import IncompatibleDraftError

CORPUS = {"german": [{"de": f"Die Datei Nummer {i} konnte leider nicht gelesen werden.", "package": "x"} for i in range(20)],
          "countries": ["Norway", "Chile"], "cities": [{"city": "Oslo", "country": "Norway"}], "sources": {"german": "test"}}
DOCS = [(f"Explain topic {i}?", " ".join(f"Topic {i} sentence {j} says something useful here." for j in range(10)))
        for i in range(12)]


def test_task_stage_answers_each_task_prompt_and_holds_out(tmp_path, tiny_llama, smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    target = tiny_llama(num_layers=1, vocab_size=len(tokenizer), max_position_embeddings=2048, seed=1)
    corpus_path = tmp_path / "corpus.json"
    corpus_path.write_text(__import__("json").dumps(CORPUS))
    cfg = distill.DistillConfig(target="unused", out_dir=str(tmp_path / "o"), num_task_prompts=30, num_task_heldout=6,
                                num_task_samples=1, task_corpus=str(corpus_path), max_new_tokens=4, gen_batch_size=8,
                                max_task_prompt_tokens=2048)
    cache = {}

    def cached(name, make):
        if name not in cache:
            cache[name] = make()
        return cache[name]

    def generate(prompts, temperature):
        return distill.generate_responses(target, prompts, cfg, (tokenizer.eos_token_id,), 0, temperature)

    pairs, held, summary = distill_tasks.build_task_stage(cfg, tokenizer, DOCS, ["Explain topic 3?"], generate, cached)
    assert summary["num_task_heldout_prompts"] == 6 and len(held) <= 6
    assert summary["num_task_train_prompts"] == sum(summary["task_mix_encoded"].values()) - 6
    assert all(n > 0 for n in summary["task_mix_built"].values()), summary
    assert set(cache) == {"tasks_greedy.pt", "tasks_sampled0.pt", "tasks_heldout.pt"}
    assert len(pairs) <= 2 * summary["num_task_train_prompts"] and all(1 <= len(r) <= 4 for _, r in pairs)
    texts = [tokenizer.decode(p) for p, _ in pairs]
    assert not any("Explain topic 3?" in t for t in texts)  # the evaluation text never appears
    # length-sorted batches still return the responses in prompt order
    again = distill.generate_responses(target, [p for p, _ in pairs[:5]], cfg, (tokenizer.eos_token_id,), 0, 0.0)
    assert [p for p, _ in again] == [p for p, _ in pairs[:5]]


def test_warm_start_loads_own_weights_and_refuses_mismatches(tmp_path, tiny_llama_dir):
    target_dir = tiny_llama_dir(tmp_path / "target", num_layers=4, seed=0)
    target = LlamaForCausalLM.from_pretrained(target_dir).eval()
    init = str(tmp_path / "init")
    fmt.make_truncated_draft(target_dir, [1, 3], init)
    draft = fmt.build_draft_from_target(target, [0, 0])
    distill_tasks.warm_start(draft, init, target.model.embed_tokens.weight)
    for i, src in enumerate([1, 3]):
        for (name, p), (_, q) in zip(draft.model.layers[i].named_parameters(), target.model.layers[src].named_parameters()):
            torch.testing.assert_close(p, q, msg=name)
    with pytest.raises(ValueError, match="layers"):
        distill_tasks.warm_start(fmt.build_draft_from_target(target, [0]), init, target.model.embed_tokens.weight)
    other = LlamaForCausalLM.from_pretrained(tiny_llama_dir(tmp_path / "other", num_layers=4, seed=5))
    with pytest.raises(IncompatibleDraftError):
        distill_tasks.warm_start(draft, init, other.model.embed_tokens.weight)


def test_warm_start_grows_a_draft_function_preservingly(tmp_path, tiny_llama_dir):
    target_dir = tiny_llama_dir(tmp_path / "target", num_layers=4, seed=0)
    target = LlamaForCausalLM.from_pretrained(target_dir).eval()
    init = str(tmp_path / "init")
    fmt.make_truncated_draft(target_dir, [0, 3], init)
    small = fmt.load_draft(init, target_model=target)
    grown = fmt.build_draft_from_target(target, [0, 2, 3])
    distill_tasks.warm_start(grown, init, target.model.embed_tokens.weight, (0, 2, 3))
    ids = torch.randint(0, target.config.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(grown(ids).logits, small(ids).logits)  # the new layer is an identity block
    assert grown.model.layers[1].mlp.down_proj.weight.abs().sum() == 0
    assert grown.model.layers[1].mlp.up_proj.weight.abs().sum() > 0  # still trainable from the target layer
    assert distill_tasks.growth_slots((0, 3), (0, 2, 3), 3) == [0, 2]
    with pytest.raises(ValueError, match="ordered subset"):
        distill_tasks.growth_slots((0, 3), (0, 1, 2), 3)
    with pytest.raises(ValueError, match="growth"):
        distill_tasks.growth_slots((0, 3), None, 3)
