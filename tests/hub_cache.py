"""A Hugging Face cache laid out as huggingface_hub lays it out, holding local checkpoints under
repo ids: hub resolution is tested offline (HF_HUB_CACHE pointing here, HF_HUB_OFFLINE=1)."""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path


def fake_hub_cache(root: Path, repos: dict[str, Path]) -> Path:
    """root/models--{org}--{name}/{refs/main, snapshots/<commit>/<files>} for each repo id -> a
    checkpoint directory whose files it copies."""
    for repo_id, src in repos.items():
        folder = root / ("models--" + repo_id.replace("/", "--"))
        commit = hashlib.sha1(repo_id.encode()).hexdigest()
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / "main").write_text(commit)
        shutil.copytree(src, folder / "snapshots" / commit, dirs_exist_ok=True)
    return root
