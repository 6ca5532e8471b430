"""The settings of ``minedraft distill`` (``DistillConfig``), shared by its data, training and
EAGLE stages; their ``--help`` texts (``FIELD_HELP``). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_DATA_DIR = "/work/shared/data"

FIELD_HELP = {
    "gguf_file": "GGUF file name inside --target (a dir)", "work_dir": "data cache + checkpoints (default $MINEDRAFT_CACHE/distill/<out name>)",
    "data_dir": "dir with arena_hard/, mt_bench/, fastchat_sample/, spec_bench/ (excluded)",
    "num_layers": "draft decoder layers", "max_prompts": "training prompts", "num_heldout": "held-out prompts",
    "max_prompt_tokens": "drop longer prompts (tokens)", "max_new_tokens": "target response length (tokens)",
    "num_samples": "sampled responses per prompt besides the greedy one", "sample_temperature": "their temperature",
    "top_k_logits": "teacher logits kept per position", "gen_batch_size": "generation batch (sequences)",
    "batch_size": "training batch (sequences)", "num_epochs": "epochs", "lr": "AdamW peak learning rate (cosine)",
    "seed": "seed of shuffling, sampling and batching", "device": "auto | cpu | cuda[:i]",
    "save_dtype": "dtype of the saved draft weights", "checkpoint_every": "steps between checkpoints",
    "record_target": "target alias written to the draft metadata (default --target)",
    "draft_vocab_size": "reduced draft head: the N most frequent target ids of the responses (0: full vocab)",
    "time_budget_s": "stop training once the whole run took this many seconds, then evaluate + save (0: none)",
    "num_task_prompts": "synthetic task prompts (distill.task_prompts: summarization, RAG, translation, math, QA, multi-turn)",
    "num_task_heldout": "held-out task prompts", "num_task_samples": "sampled responses per task prompt besides the greedy one",
    "task_corpus": "corpus JSON (.json/.json.gz) of python -m distill.task_corpus (default: collect from this system)",
    "max_task_prompt_tokens": "drop longer task prompts (tokens)", "task_new_tokens": "task response length (0: max_new_tokens)",
    "num_self_prompts": "chat prompts sampled from the target itself (distill.self_prompts, Magpie) and answered greedily",
    "max_self_prompt_tokens": "longest self-sampled query (tokens; longer ones are dropped)",
    "self_prompt_temperature": "temperature of the self-sampled queries",
    "data_budget_s": "stop sampling new self-prompt chunks once the run took this many seconds (0: none)",
    "is_data_only": "build and cache the generated data (no teacher logits, no training), then exit",
    "init_draft": "draft dir to warm-start the layers from (fewer layers: grown, see distill.tasks.warm_start)",
}


@dataclass(frozen=True)
class DistillConfig:
    """Training settings (see ``--help``). Raises ValueError naming a bad field."""

    target: str
    out_dir: str
    gguf_file: str | None = None
    work_dir: str | None = None
    data_dir: str = DEFAULT_DATA_DIR
    init_layers: tuple[int, ...] = ()
    num_layers: int = 2
    max_prompts: int = 600
    num_heldout: int = 24
    max_prompt_tokens: int = 384
    max_new_tokens: int = 128
    num_samples: int = 0
    sample_temperature: float = 0.8
    top_k_logits: int = 64
    gen_batch_size: int = 16
    batch_size: int = 8
    num_epochs: int = 3
    lr: float = 5e-4
    seed: int = 0
    device: str = "auto"
    save_dtype: str = "bfloat16"
    record_target: str | None = None
    checkpoint_every: int = 200
    draft_vocab_size: int = 0
    time_budget_s: float = 0.0
    num_task_prompts: int = 0
    num_task_heldout: int = 0
    num_task_samples: int = 0
    task_corpus: str | None = None
    max_task_prompt_tokens: int = 1024
    task_new_tokens: int = 0
    init_draft: str | None = None
    num_self_prompts: int = 0
    max_self_prompt_tokens: int = 128
    self_prompt_temperature: float = 1.0
    data_budget_s: float = 0.0
    is_data_only: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "max_prompts", "max_prompt_tokens", "max_new_tokens", "top_k_logits",
                     "gen_batch_size", "batch_size", "num_epochs", "checkpoint_every", "max_self_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_samples", "num_heldout", "draft_vocab_size", "time_budget_s", "num_task_prompts",
                     "num_task_heldout", "num_task_samples", "max_task_prompt_tokens", "task_new_tokens",
                     "num_self_prompts", "data_budget_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("lr", "sample_temperature", "self_prompt_temperature"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.init_layers and len(self.init_layers) != self.num_layers:
            raise ValueError(f"init_layers must have num_layers={self.num_layers} entries")
        if self.save_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"save_dtype must be bfloat16 or float32, got {self.save_dtype!r}")
