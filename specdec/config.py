"""Engine configuration: model source and KV-cache capacity (frozen, validated dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DEFAULT_MODEL = "smollm2-135m-instruct"
ONE_PROMPT_PER_PREFILL = 0          # max_prefill_tokens: every prompt in its own forward
CUDA_MAX_PREFILL_TOKENS = 8192      # max_prefill_tokens resolved on CUDA (None)
CUDA_GRAPH_PREFILL_TOKENS = 1024    # max_graph_prefill_tokens resolved with CUDA graphs on (None)


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and how.

    Attributes:
        model: alias (``"smollm2-135m-instruct"``), local HF dir, or path of a ``.gguf`` file.
        gguf_file: GGUF file name inside ``model`` (a dir); converted once to an HF dir.
        dtype: parameter and KV-cache dtype, one of ``SUPPORTED_DTYPES``.
        device: torch device string, e.g. ``"cpu"`` or ``"cuda:0"``.
        num_threads: if set, ``torch.set_num_threads(num_threads)`` when the runner starts.
        cuda_graphs: replay CUDA graphs captured per (batch-size bucket, tokens per row, KV-length
            bucket) for steps of at most ``max_static_tokens`` tokens per row
            (``specdec.engine.cuda_graphs``). None: on iff ``device`` is CUDA. True needs a CUDA device.
        static_shapes: run those steps through the static-shape path (buckets, device-side
            mask and KV writes) even without graphs: the CPU twin of the graph path. None: same
            as the resolved ``cuda_graphs``. Must not be False while graphs are on.
        max_static_tokens: most tokens per row a static step takes (k + 1 for verify steps);
            longer rows (prefill) run the dynamic path.
        compile_modules: ``torch.compile`` every RMSNorm and MLP module (regional compilation:
            one graph shared by all layers) so their elementwise kernels fuse; Triton/inductor
            on CUDA, dynamo's eager backend elsewhere. Off by default.
        compile_layers: run static steps through ``torch.compile``'d decoder layers (one graph
            per shape shared by all layers; needs the static path). Off by default.
        cuda_graph_precapture: with graphs on, capture every (batch bucket, 1..max_static_tokens,
            KV bucket) shape at start-up instead of on first use (``StaticStepper.precapture``).
        max_prefill_tokens: prompts added together are prefilled in one forward while their
            padded size (number of prompts x longest prompt, tokens) stays within this; a longer
            prompt gets a forward of its own. ``ONE_PROMPT_PER_PREFILL`` (0): one forward per
            prompt. None: 0 while one-prompt graph prefills are on (``max_graph_prefill_tokens``;
            ``ModelRunner.prefill_token_budget``), else ``CUDA_MAX_PREFILL_TOKENS`` on CUDA, where a prefill of a few hundred
            tokens is launch-bound (an H200 prefilled one ~300-token SmolLM2-135M prompt in
            26-31 ms, about what a batch of them costs), 0 elsewhere (on CPU a prefill is
            compute-bound and padding would be wasted work).
        max_graph_prefill_tokens: a forward of ONE prompt (an admission of one request) of more
            than ``max_static_tokens`` and at most this many tokens runs the static path too,
            the prompt padded to a power-of-two length bucket (16, 32, ..., this value), so
            with graphs on it is one replayed CUDA graph per bucket instead of ~1200 kernel
            launches; only the last token's logits are computed. Capped at ``max_model_len``.
            None: ``CUDA_GRAPH_PREFILL_TOKENS`` while the runner's CUDA graphs are on and
            ``max_prefill_tokens`` is None or 0, else 0 (off: on a CPU, or eager in a
            tensor-parallel group, padding is wasted work). A value > 0 needs the static path
            (``static_shapes``) and excludes ``max_prefill_tokens`` > 0: a prompt's KV would
            then depend on whether it was admitted alone (graph) or with others (batched).

    Raises:
        ValueError: naming the invalid field.
    """

    model: str = DEFAULT_MODEL
    gguf_file: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    num_threads: int | None = None
    cuda_graphs: bool | None = None
    static_shapes: bool | None = None
    max_static_tokens: int = 8
    compile_modules: bool = False
    compile_layers: bool = False
    cuda_graph_precapture: bool = True
    max_prefill_tokens: int | None = None
    max_graph_prefill_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        if self.gguf_file is not None and not str(self.gguf_file).endswith(".gguf"):
            raise ValueError(f"gguf_file must name a .gguf file, got {self.gguf_file!r}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(SUPPORTED_DTYPES)}, got {self.dtype!r}")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device is not a valid torch device: {self.device!r}") from exc
        if self.num_threads is not None and (
            not isinstance(self.num_threads, int) or self.num_threads < 1
        ):
            raise ValueError(f"num_threads must be a positive int or None, got {self.num_threads!r}")
        if self.cuda_graphs and torch.device(self.device).type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA device, got device={self.device!r}")
        if self.cuda_graphs and self.static_shapes is False:
            raise ValueError("static_shapes must not be False when cuda_graphs is True")
        if self.compile_layers and not self.use_static_shapes:
            raise ValueError("compile_layers needs static_shapes (the static path)")
        if not isinstance(self.max_static_tokens, int) or self.max_static_tokens < 1:
            raise ValueError(f"max_static_tokens must be a positive int, got "
                             f"{self.max_static_tokens!r}")
        if self.max_prefill_tokens is not None and (
            not isinstance(self.max_prefill_tokens, int) or self.max_prefill_tokens < 0
        ):
            raise ValueError(f"max_prefill_tokens must be an int >= 0 or None, got {self.max_prefill_tokens!r}")
        self._check_graph_prefill()

    def _check_graph_prefill(self) -> None:
        value = self.max_graph_prefill_tokens
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"max_graph_prefill_tokens must be an int >= 0 or None, got {value!r}")
        if value and not self.use_static_shapes:
            raise ValueError("max_graph_prefill_tokens > 0 needs static_shapes (the static path)")
        if value and self.max_prefill_tokens:
            raise ValueError("max_graph_prefill_tokens > 0 and max_prefill_tokens > 0 exclude each other: "
                             "a prompt prefilled alone (graph) and in a batch would get different KV")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The ``torch.dtype`` named by ``dtype``."""
        return SUPPORTED_DTYPES[self.dtype]

    @property
    def use_cuda_graphs(self) -> bool:
        """``cuda_graphs`` resolved: None means on iff ``device`` is CUDA."""
        if self.cuda_graphs is None:
            return torch.device(self.device).type == "cuda"
        return self.cuda_graphs

    @property
    def prefill_token_budget(self) -> int:
        """``max_prefill_tokens`` resolved: None means ``CUDA_MAX_PREFILL_TOKENS`` on CUDA, else 0."""
        if self.max_prefill_tokens is not None:
            return self.max_prefill_tokens
        is_cuda = torch.device(self.device).type == "cuda"
        return CUDA_MAX_PREFILL_TOKENS if is_cuda else ONE_PROMPT_PER_PREFILL

    @property
    def use_static_shapes(self) -> bool:
        """``static_shapes`` resolved: None follows ``use_cuda_graphs``."""
        return self.use_cuda_graphs if self.static_shapes is None else self.static_shapes


@dataclass(frozen=True)
class CacheConfig:
    """KV-cache capacity, fixed at start-up.

    Attributes:
        max_num_seqs: number of slots (concurrent sequences) in the slot KV cache.
        max_model_len: maximum tokens per slot (prompt + output + draft tokens).

    Raises:
        ValueError: naming the invalid field.
    """

    max_num_seqs: int = 16
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be a positive int, got {self.max_num_seqs!r}")
        if not isinstance(self.max_model_len, int) or self.max_model_len < 2:
            raise ValueError(f"max_model_len must be an int >= 2, got {self.max_model_len!r}")
