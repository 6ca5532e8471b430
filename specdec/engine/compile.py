"""``torch.compile`` helpers of the engine (``ModelConfig.compile_modules`` / ``compile_layers``).

Regional compilation: norms and MLPs (``compile_modules``) or whole decoder layers for the
static path (``compile_layers``), one compiled graph per module type and shape shared by all
layers. CUDA uses inductor/Triton; other devices dynamo's ``eager`` backend (numerically
unchanged, so the CPU twin checks the wiring).
"""

from __future__ import annotations

import torch

MIN_RECOMPILE_LIMIT = 64  # dynamo recompiles per code object (shape buckets x model types)


def compile_modules(model, device: torch.device) -> int:
    """Wrap every RMSNorm and MLP submodule in ``torch.compile`` (regional compilation).

    These modules have no layer-dependent Python ints, so dynamo traces one graph per module
    type and shapes and reuses it for every layer; inductor fuses a norm's ~8 elementwise
    kernels into one and the MLP's activation and product into one (CUDA: inductor/Triton;
    other devices: dynamo's ``eager`` backend, which changes nothing numerically).

    Returns:
        number of modules wrapped.
    """
    backend = _compile_backend(device)
    _raise_recompile_limit()
    targets = [(parent, name) for parent in model.modules()
               for name, child in parent.named_children()
               if type(child).__name__.endswith(("RMSNorm", "MLP"))]
    for parent, name in targets:
        setattr(parent, name, torch.compile(getattr(parent, name), backend=backend))
    return len(targets)


def _compile_backend(device: torch.device) -> str:
    return "inductor" if device.type == "cuda" else "eager"


def _raise_recompile_limit() -> None:
    """Every (batch bucket, tokens, KV bucket) shape may need its own compiled graph."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), MIN_RECOMPILE_LIMIT))


def compile_layers(model) -> torch.nn.ModuleList:
    """``torch.compile`` of every decoder layer, for the static path only (``static_forward``
    swaps them in): a layer reads its cache through its buffers, never through a Python layer
    index, so one compiled graph per shape serves all layers (CUDA: inductor/Triton; other
    devices: dynamo's eager backend, numerically unchanged).

    Raises:
        ValueError: the model has no ``get_decoder().layers``.
    """
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError("compile_layers needs a model whose get_decoder() has .layers")
    _raise_recompile_limit()
    backend = _compile_backend(next(model.parameters()).device)
    return torch.nn.ModuleList(torch.compile(layer, backend=backend) for layer in layers)
