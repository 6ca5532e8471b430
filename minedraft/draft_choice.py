"""Which draft model a stack serves (torch-free): the one named, the distilled default when it
fits the target, else an untrained draft of the target's first layers written once to the cache."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

from specdec.models.cache import cache_root

DEFAULT_DRAFT_DIR = "drafts/smollm2-135m-instruct"  # written by `minedraft distill` (issue 4)
DEFAULT_TRUNCATED_LAYERS = (0, 1, 2, 3)  # untrained fallback draft: the target's first layers


def draft_fits_target(draft_dir: str, target_dir: str) -> bool:
    """Whether the draft's recorded target embedding shape ``[vocab, hidden]``
    (``minedraft_draft.json`` ``target_fingerprint.shape``) is the target's (its ``config.json``
    ``vocab_size``, ``hidden_size``); True when either file does not say (the drafter's load
    still checks the full fingerprint, ``specdec.models.draft_target.check_fingerprint``)."""
    try:
        with open(os.path.join(draft_dir, "minedraft_draft.json")) as f:
            shape = json.load(f)["target_fingerprint"]["shape"]
        with open(os.path.join(target_dir, "config.json")) as f:
            config = json.load(f)
        config = config.get("text_config", config)
        return list(shape) == [config["vocab_size"], config["hidden_size"]]
    except (OSError, KeyError, TypeError, ValueError):
        return True


def resolve_draft_dir(cfg, target_dir: str, cache_dir: str | None = None) -> str:
    """The draft dir of ``cfg`` (a ``minedraft.stack.StackConfig``; only its ``draft`` is read):
    ``cfg.draft``; else ``drafts/smollm2-135m-instruct`` (distilled) when it
    exists and its recorded target's embedding shape is the target's (``draft_fits_target``:
    a ``random:<preset>`` or other target gets no draft it cannot load); else an untrained draft of the target's first layers, written once to the cache
    (``$MINEDRAFT_CACHE/drafts``) by ``specdec.models.draft_format.make_truncated_draft`` in a child
    process (this module stays torch-free).

    Raises:
        RuntimeError: the truncated draft could not be written.
    """
    if cfg.draft:
        return cfg.draft
    if os.path.isdir(DEFAULT_DRAFT_DIR) and draft_fits_target(DEFAULT_DRAFT_DIR, target_dir):
        return DEFAULT_DRAFT_DIR
    root = cache_dir or cache_root()
    key = hashlib.sha1(os.path.abspath(target_dir).encode()).hexdigest()[:10]
    layers = list(DEFAULT_TRUNCATED_LAYERS)
    out_dir = os.path.join(root, "drafts", f"truncated-{key}-{'-'.join(map(str, layers))}")
    if not os.path.isfile(os.path.join(out_dir, "minedraft_draft.json")):
        code = ("import sys; from specdec.models.draft_format import make_truncated_draft; "
                "make_truncated_draft(sys.argv[1], [int(x) for x in sys.argv[2].split(',')], sys.argv[3])")
        proc = subprocess.run([sys.executable, "-c", code, target_dir, ",".join(map(str, layers)), out_dir],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"draft: cannot write a truncated draft to {out_dir}: {proc.stderr[-2000:]}")
    return out_dir
