"""Device placement of the engine services (torch-free): which CUDA GPUs each child process sees.

``minedraft up --device cuda --verifier-gpus 0 --drafter-gpu 1`` puts the verifier's
tensor-parallel ranks on GPU 0 (one GPU per rank) and the drafter on GPU 1. Each engine child
gets ``CUDA_VISIBLE_DEVICES`` naming only its GPUs, so inside the child its GPUs are numbered
from 0: a TP=1 verifier and the drafter run on ``cuda:0``; TP ranks under torchrun pick
``cuda:<local_rank>`` (``verifier_svc.tp.init_distributed``). The coordinator and gateway are
torch-free and get an empty ``CUDA_VISIBLE_DEVICES`` (they never touch a GPU). On GPU hosts no
CPU core pinning is done (the cores only launch kernels; pinning is for the 2-core CPU setup,
DESIGN.md §8), and the engine dtype defaults to bfloat16 (float32 on CPU).

The drafter may share a GPU with the verifier (``--drafter-gpu 0``): that is how one standard
SD replica per GPU is built (bench/gpu/gpu_stack.py, part b), and how PSD runs on a one-GPU host; there
``--cuda-mps`` (``minedraft.cuda_mps``) lets both engines' kernels run at the same time.
"""
from __future__ import annotations

from dataclasses import dataclass

DEVICES = ("cpu", "cuda")
CPU_DTYPE = "float32"
GPU_DTYPE = "bfloat16"
NO_GPU = -1                       # sentinel: drafter GPU not given
NO_GPUS: tuple[int, ...] = ()     # sentinel: verifier GPUs not given
CUDA_ENV = "CUDA_VISIBLE_DEVICES"
HIDE_GPUS = ""                    # CUDA_VISIBLE_DEVICES value that hides every GPU
MPS_SM_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"  # an MPS client's share of the GPU's SMs (percent)
ALL_SMS = 100


def default_dtype(device: str) -> str:
    """The engine dtype when ``--dtype`` is not given: bfloat16 on cuda, float32 on cpu."""
    return GPU_DTYPE if device == "cuda" else CPU_DTYPE


def parse_gpu_list(text: str) -> tuple[int, ...]:
    """``"0,1"`` -> ``(0, 1)`` (``--verifier-gpus``); ``""`` -> ``NO_GPUS``.

    Raises:
        ValueError: naming ``--verifier-gpus`` when an entry is not a non-negative integer.
    """
    if not text.strip():
        return NO_GPUS
    try:
        gpus = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--verifier-gpus: expected comma-separated GPU indexes, got {text!r}") from None
    if any(gpu < 0 for gpu in gpus):
        raise ValueError(f"--verifier-gpus: GPU indexes must be >= 0, got {text!r}")
    return gpus


@dataclass(frozen=True)
class Placement:
    """Where the engines run. Defaults on cuda: verifier on GPUs ``0..tp-1``, drafter on GPU ``tp``.

    Attributes:
        device: ``cpu`` or ``cuda`` (``--device``).
        verifier_gpus: one GPU index per verifier TP rank (``--verifier-gpus``; host numbering).
        drafter_gpu: the drafter's GPU index (``--drafter-gpu``; may equal a verifier GPU).
        tensor_parallel_size: verifier ranks (``--tp``).
        cuda_mps: run the engines as clients of a private CUDA MPS daemon (``--cuda-mps``).
        verifier_sm_percent: under MPS, the share of the GPU's SMs (percent) the verifier's
            kernels may use (``--cuda-mps-verifier-sm-percent``; MPS's
            ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, see https://docs.nvidia.com/deploy/mps/): below
            100 the drafter's kernels, PSD's critical path on one GPU, always find SMs free
            instead of queueing behind the verifier's. 100: no limit.

    Raises:
        ValueError: naming the flag: GPU flags with ``--device cpu``, a GPU count that differs
            from ``--tp``, repeated or negative indexes, an unknown device.
    """

    device: str = "cpu"
    verifier_gpus: tuple[int, ...] = NO_GPUS
    drafter_gpu: int = NO_GPU
    tensor_parallel_size: int = 1
    cuda_mps: bool = False
    verifier_sm_percent: int = ALL_SMS

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"--device: must be one of {DEVICES}, got {self.device!r}")
        if not 1 <= self.verifier_sm_percent <= ALL_SMS or (self.verifier_sm_percent < ALL_SMS and not self.cuda_mps):
            raise ValueError(f"--cuda-mps-verifier-sm-percent: must be in [1, 100] (below 100 only with --cuda-mps), "
                             f"got {self.verifier_sm_percent}")
        if self.device == "cpu":
            if self.verifier_gpus != NO_GPUS:
                raise ValueError("--verifier-gpus: only with --device cuda")
            if self.drafter_gpu != NO_GPU:
                raise ValueError("--drafter-gpu: only with --device cuda")
            if self.cuda_mps:
                raise ValueError("--cuda-mps: only with --device cuda")
            return
        gpus = self.verifier_gpus or tuple(range(self.tensor_parallel_size))
        if len(gpus) != self.tensor_parallel_size:
            raise ValueError(f"--verifier-gpus: needs one GPU per TP rank (--tp {self.tensor_parallel_size}), "
                             f"got {list(gpus)}")
        if len(set(gpus)) != len(gpus) or min(gpus) < 0:
            raise ValueError(f"--verifier-gpus: GPU indexes must be distinct and >= 0, got {list(gpus)}")
        if self.drafter_gpu < NO_GPU:
            raise ValueError(f"--drafter-gpu: must be >= 0, got {self.drafter_gpu}")

    @property
    def is_cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def resolved_verifier_gpus(self) -> tuple[int, ...]:
        """The verifier's GPUs (default ``0..tp-1``); ``NO_GPUS`` on cpu."""
        if not self.is_cuda:
            return NO_GPUS
        return self.verifier_gpus or tuple(range(self.tensor_parallel_size))

    @property
    def resolved_drafter_gpu(self) -> int:
        """The drafter's GPU (default: the one after the verifier's last, ``tp``); ``NO_GPU`` on cpu."""
        if not self.is_cuda:
            return NO_GPU
        return self.drafter_gpu if self.drafter_gpu != NO_GPU else max(self.resolved_verifier_gpus) + 1

    @property
    def is_shared_gpu(self) -> bool:
        """Whether the drafter runs on one of the verifier's GPUs (their kernels take turns unless
        ``cuda_mps``)."""
        return self.is_cuda and self.resolved_drafter_gpu in self.resolved_verifier_gpus

    def verifier_env(self) -> dict[str, str]:
        """Environment of the verifier child (every TP rank inherits it): its GPUs only."""
        if not self.is_cuda:
            return {}
        return {CUDA_ENV: ",".join(map(str, self.resolved_verifier_gpus))}

    def verifier_mps_env(self) -> dict[str, str]:
        """What the verifier adds to its environment as an MPS client: its SM share, if limited."""
        return {MPS_SM_ENV: str(self.verifier_sm_percent)} if self.verifier_sm_percent < ALL_SMS else {}

    def drafter_env(self) -> dict[str, str]:
        """Environment of the drafter child: its one GPU."""
        return {CUDA_ENV: str(self.resolved_drafter_gpu)} if self.is_cuda else {}

    def torch_free_env(self) -> dict[str, str]:
        """Environment of the coordinator and gateway: no GPU (they never import torch)."""
        return {CUDA_ENV: HIDE_GPUS} if self.is_cuda else {}

    def verifier_device(self) -> str:
        """``--device`` of the verifier: ``cuda:0`` for TP = 1 (its only visible GPU); ``cuda``
        under torchrun, where each rank takes ``cuda:<local_rank>``; ``cpu`` otherwise."""
        if not self.is_cuda:
            return "cpu"
        return "cuda:0" if self.tensor_parallel_size == 1 else "cuda"

    def drafter_device(self) -> str:
        """``--device`` of the drafter: ``cuda:0`` (its only visible GPU) or ``cpu``."""
        return "cuda:0" if self.is_cuda else "cpu"
