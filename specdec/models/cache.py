"""MineDraft's model cache: its root and the build-once, rename-into-place dirs under it.

``$MINEDRAFT_CACHE`` (default ``~/.cache/minedraft``) holds converted GGUF models, random-model
config dirs, exported drafts and distillation work data. A dir is written under a temporary name
and renamed into place, so processes racing on a cold cache are safe. Torch-free.
"""

from __future__ import annotations

import os
import shutil
import tempfile

CACHE_ENV = "MINEDRAFT_CACHE"
DEFAULT_CACHE_ROOT = os.path.join("~", ".cache", "minedraft")
CACHE_DIR_MODE = 0o755
CACHE_FILE_MODE = 0o644


def cache_root() -> str:
    """Root of MineDraft's caches: ``$MINEDRAFT_CACHE`` or ``~/.cache/minedraft``."""
    return os.path.expanduser(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_ROOT)


def build_cached_dir(final_dir: str, marker_file: str, build) -> str:
    """``final_dir``, built once by ``build(tmp_dir)`` in a temp dir beside it, then renamed.

    The dir counts as complete when ``marker_file`` exists in it; a concurrent builder that
    renamed first wins and its dir is used. Entries are made readable for a shared cache.

    Raises:
        OSError: the rename failed and no complete dir exists.
    """
    if os.path.isfile(os.path.join(final_dir, marker_file)):
        return final_dir
    parent = os.path.dirname(final_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(final_dir)}.tmp-", dir=parent)
    try:
        build(tmp_dir)
        _make_readable(tmp_dir)
        os.rename(tmp_dir, final_dir)
    except OSError:
        if not os.path.isfile(os.path.join(final_dir, marker_file)):
            raise
        # another process finished the same build first: use its dir
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return final_dir


def _make_readable(dir_path: str) -> None:
    """mkdtemp and safetensors create owner-only entries; a shared cache must be readable."""
    os.chmod(dir_path, CACHE_DIR_MODE)
    for name in os.listdir(dir_path):
        os.chmod(os.path.join(dir_path, name), CACHE_FILE_MODE)
