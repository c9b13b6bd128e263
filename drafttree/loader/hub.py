"""Hugging Face repo ids ("org/name") to local directories, through `huggingface_hub`: the local
Hugging Face cache first (HF_HUB_CACHE; offline with HF_HUB_OFFLINE=1), else a download of the
files an engine reads (config, tokenizer, safetensors weights; never .bin or .gguf copies)."""
from __future__ import annotations

import re
from pathlib import Path

# what a target or a drafter directory needs: configs, tokenizer files (and a tokenizer's own code,
# run only with trust_remote_code) and chat templates, weights
FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja", "tokenization_*.py"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def is_repo_id(name: str) -> bool:
    """Whether `name` reads as a hub repo id: "org/name", one slash, no path of its own."""
    return bool(_REPO_ID.match(name)) and ".." not in name


def snapshot(repo_id: str, revision: str | None = None, what: str = "model") -> Path:
    """The local directory of `repo_id`'s files: cached, or downloaded where the hub is reachable.
    Raises FileNotFoundError saying why when neither works (offline and not cached, no such repo,
    a gated repo without a token)."""
    try:
        from huggingface_hub import constants, errors, snapshot_download
        from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError:   # transformers brings it; a bare install may not
        raise FileNotFoundError(f"{what} {repo_id!r} is a Hugging Face repo id, which needs huggingface_hub "
                                "(pip install huggingface_hub); or pass a local directory") from None
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=FILES))
    except GatedRepoError as e:
        raise FileNotFoundError(f"{what} {repo_id!r} is gated on the Hugging Face hub: accept its terms and log in "
                                f"(HF_TOKEN) ({e})") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{what} {repo_id!r} is neither a local path nor a repo on the Hugging Face hub") \
            from None
    except getattr(errors, "IncompleteSnapshotError", ()) as e:   # newer huggingface_hub only
        raise FileNotFoundError(f"{what} {repo_id!r}: {e}") from None
    except LocalEntryNotFoundError:
        where = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub could not be reached"
        raise FileNotFoundError(
            f"{what} {repo_id!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {where}: "
            f"download it where a network is (hf download {repo_id}), or pass its local directory") from None
