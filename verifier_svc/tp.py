"""Tensor parallelism of the verifier: model loading per rank and the rank-0 command channel.

Under ``torchrun --nproc-per-node N -m verifier_svc`` (WORLD_SIZE = N > 1) every rank loads the
target model with transformers' ``tp_plan="auto"`` (attention heads and MLP columns sharded,
all-reduce after the row-parallel projections; DESIGN.md §5). Rank 0 runs the gRPC server and
broadcasts every engine command to the other ranks; all ranks then run the same worker code on
the same inputs (seeds fixed by rank 0 at add time), so their sampled tokens agree.

Command wire format (never pickled), all by ``torch.distributed.broadcast`` from rank 0:
1. header ``int64[3] = [kind, payload_len, probs_dtype_code]`` (code ``NO_PROBS`` = -1);
2. payload ``uint8[payload_len]``: the serialized protobuf of the command
   (ADD: ``AddRequestsRequest``, VERIFY: ``VerifyRequest`` without its probs, RELEASE:
   ``ReleaseRequest``; SHUTDOWN has no payload);
3. VERIFY with draft probs: on CUDA (NCCL) the tensor ``dtype[b, k, V]`` itself, broadcast from
   rank 0's GPU (no host copy); on CPU (gloo) its raw bytes ``uint8[b*k*V*itemsize]``
   (b, k from the payload). Either way every rank gets the exact dtype.

Slot KV cache under TP: each rank's attention sees ``num_heads / N`` query heads and
``num_kv_heads / N`` key/value heads, while transformers leaves the model config at the global
counts. ``shard_head_counts`` gives the rank's model config its per-rank counts, so
``specdec.engine.runner.ModelRunner`` sizes the cache to the local heads (N times less memory).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

CMD_ADD = 1
CMD_VERIFY = 2
CMD_RELEASE = 3
CMD_SHUTDOWN = 4
NO_PROBS = -1
_HEADER_LEN = 3
PROBS_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class TPContext:
    """This process's place in the tensor-parallel world (from torchrun's env variables).

    Raises ValueError naming the field.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_driver(self) -> bool:
        """Rank 0: runs the gRPC server and broadcasts commands."""
        return self.rank == 0

    @classmethod
    def from_env(cls) -> "TPContext":
        return cls(rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)),
                   local_rank=int(os.environ.get("LOCAL_RANK", 0)))


def init_distributed(ctx: TPContext, device: str) -> str:
    """Initialise the TP process group (gloo on CPU, nccl on CUDA); returns the rank's device."""
    if not ctx.is_distributed:
        return device
    is_cuda = torch.device(device).type == "cuda"
    if is_cuda:
        torch.cuda.set_device(ctx.local_rank)
        device = f"cuda:{ctx.local_rank}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if is_cuda else "gloo")
    return device


def check_tp_divides_heads(config, world_size: int) -> None:
    """Raises ValueError unless ``world_size`` divides the attention and key/value head counts."""
    text = config.get_text_config()
    num_heads = text.num_attention_heads
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    for name, count in (("num_attention_heads", num_heads), ("num_key_value_heads", num_kv_heads)):
        if count % world_size:
            raise ValueError(f"tensor_parallel_size={world_size} must divide {name}={count}")


def shard_head_counts(model, world_size: int) -> None:
    """Set the model config's head counts to the per-rank counts (see module docstring)."""
    text = model.config.get_text_config()
    check_tp_divides_heads(model.config, world_size)
    if getattr(text, "head_dim", None) is None:
        text.head_dim = text.hidden_size // text.num_attention_heads
    num_kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    text.num_attention_heads //= world_size
    text.num_key_value_heads = num_kv_heads // world_size


def load_tp_model(model_cfg, ctx: TPContext):
    """Load ``model_cfg.model`` sharded over the TP world (``tp_plan="auto"``), eval mode.

    Rank 0 resolves (and, for GGUF, converts) the model dir first; the others wait at a barrier.

    Raises:
        ValueError: the TP size does not divide the head counts.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, DistributedConfig

    from specdec.models.resolve import resolve_model_dir

    if ctx.is_driver:
        model_dir = resolve_model_dir(model_cfg)
    dist.barrier()
    if not ctx.is_driver:
        model_dir = resolve_model_dir(model_cfg)
    check_tp_divides_heads(AutoConfig.from_pretrained(model_dir, local_files_only=True), ctx.world_size)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=model_cfg.torch_dtype, local_files_only=True,
        distributed_config=DistributedConfig(tp_plan="auto"),
    )
    shard_head_counts(model, ctx.world_size)
    return model.eval()


class CommandChannel:
    """Rank 0 -> all ranks broadcast of engine commands (format in the module docstring)."""

    def __init__(self, device: str) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.device(device).type == "cuda" \
            else torch.device("cpu")

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to(self.device)
        dist.broadcast(tensor, src=0)
        return tensor.cpu()

    def send(self, kind: int, payload: bytes = b"", probs: torch.Tensor | None = None) -> None:
        """Rank 0: broadcast one command (and the draft probs of a VERIFY)."""
        code = NO_PROBS if probs is None else PROBS_DTYPES.index(probs.dtype)
        self._broadcast(torch.tensor([kind, len(payload), code], dtype=torch.int64))
        if payload:
            self._broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        if probs is not None and probs.numel():
            if self.device.type == "cuda":
                dist.broadcast(probs.detach().to(self.device).contiguous(), src=0)
            else:
                self._broadcast(probs.detach().cpu().contiguous().reshape(-1).view(torch.uint8))

    def receive(self) -> tuple[int, bytes, int]:
        """Ranks > 0: the next command's ``(kind, payload, probs_dtype_code)``."""
        kind, length, code = self._broadcast(torch.zeros(_HEADER_LEN, dtype=torch.int64)).tolist()
        payload = b""
        if length:
            payload = self._broadcast(torch.empty(length, dtype=torch.uint8)).numpy().tobytes()
        return kind, payload, code

    def receive_probs(self, code: int, shape: tuple[int, int, int]) -> torch.Tensor | None:
        """Ranks > 0: the draft probs announced by a VERIFY header (None for ``NO_PROBS``)."""
        if code == NO_PROBS:
            return None
        dtype = PROBS_DTYPES[code]
        num_bytes = shape[0] * shape[1] * shape[2] * torch.empty((), dtype=dtype).element_size()
        if not num_bytes:
            return torch.empty(shape, dtype=dtype)
        if self.device.type == "cuda":
            probs = torch.empty(shape, dtype=dtype, device=self.device)
            dist.broadcast(probs, src=0)
            return probs
        return self._broadcast(torch.empty(num_bytes, dtype=torch.uint8)).view(dtype).reshape(shape)
