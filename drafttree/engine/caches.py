"""What drafttree keeps between runs, all under one directory (settings.cache, DRAFTTREE_CACHE;
default ~/.cache/drafttree):

    models/               GGUF files converted to Hugging Face directories (`loader.default_model`)
    compiled/<platform>/  Triton's kernels and Inductor's compiled graphs (`kernels.compile_cache`)
    costs/<key>.json      measured cost tables (`runner.cost`)

A cost table's key is a hash of everything its timings depend on: the platform (GPU and
capability, driver, torch, Triton and CUDA versions; on the CPU its model and torch's threads),
drafttree (release and a hash of its sources), the target's and the drafter's identity (their
config files' contents and their weight files' names, sizes and modification times; a random
shape's name), the settings, and the engine's choices that change what is timed (method, block
size, budgets and schedule, dtype, device, batch buckets, the KV length timed, graphs or eager,
sampler modes, tensor-parallel ranks, the drafter's quantization). Any change misses and
measures again. `drafttree cache info | clear` shows and empties the parts.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drafttree.engine.plan import EngineSetup
from drafttree.kernels import compile_cache
from drafttree.parallel.comm import from_leader
from drafttree.runner.cost import CostTable
from drafttree.settings import Settings, current

log = logging.getLogger(__name__)

PARTS = ("models", "compiled", "costs")
_PACKAGE = Path(__file__).resolve().parent.parent
_CONFIG_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    """A hash of drafttree's Python sources: a code change is a new version for the cost tables."""
    h = hashlib.sha256()
    for f in sorted(_PACKAGE.rglob("*.py")):
        h.update(str(f.relative_to(_PACKAGE)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def model_identity(path: Path | None) -> dict[str, Any] | None:
    """A model directory as its cost depends on it: its config files' contents and its weight
    files' names, sizes and modification times (reading the weights to hash them would cost
    what the cache saves)."""
    if path is None:
        return None
    path = Path(path)
    out: dict[str, Any] = {"path": str(path.resolve())}
    for name in _CONFIG_FILES:
        f = path / name
        if f.is_file():
            out[name] = hashlib.sha256(f.read_bytes()).hexdigest()[:16]
    out["weights"] = sorted((f.name, st.st_size, st.st_mtime_ns) for f in path.glob("*.safetensors")
                            for st in (f.stat(),))
    return out


def cost_key(setup: EngineSetup, buckets: list[int], kv_len: int, graphed: bool,
             settings_in_force: Settings | None = None) -> dict[str, Any]:
    """What a cost table of this engine depends on (see the module's docstring); the settings
    those in force where it is measured (default: the setup's; a server's start runs its pieces
    as torch ops, `prepare.compiles_later`)."""
    cfg, spec = setup.cfg, setup.spec
    settings = (settings_in_force or setup.settings).as_dict()
    settings.pop("cache", None)   # where the cache lives changes no timing
    if settings.get("blocks"):    # the block shapes the file holds, not its name
        blocks = Path(settings["blocks"])
        settings["blocks"] = {"path": str(blocks.resolve()),
                              "sha256": hashlib.sha256(blocks.read_bytes()).hexdigest()[:16]}
    return {
        "platform": compile_cache.platform(setup.device),
        "drafttree": source_digest(),
        "target": model_identity(setup.model_dir) or {"random": cfg.random_weights},
        "drafter": model_identity(setup.drafter_dir) or ({"random": True} if setup.drafter is not None else None),
        "draft_quantization": cfg.draft_quantization if spec.speculative else None,
        "settings": settings,
        "spec": [spec.method, spec.block_size, spec.budget, list(spec.budgets), [list(x) for x in spec.budget_schedule],
                 spec.sampled, spec.adaptive],
        "dtype": str(setup.dtype), "device": str(setup.device), "world": setup.world,
        "buckets": list(buckets), "kv_len": kv_len, "graphed": graphed,
        "modes": [m.name for m in setup.sampler_modes],
    }


def costs_dir(root: Path | None = None) -> Path:
    return (root or current().cache) / "costs"


def cost_path(key: dict[str, Any], root: Path | None = None) -> Path:
    return costs_dir(root) / f"{compile_cache.digest(key)}.json"


def load_costs(setup: EngineSetup, key: dict[str, Any], buckets: list[int], drafter: bool,
               tp=None) -> CostTable | None:
    """The cost table kept for `key`, if any and whole (rank 0's, on every tensor-parallel rank:
    either all ranks measure or none)."""
    data = None
    if tp is None or tp.leader:
        path = cost_path(key)
        try:
            data = json.loads(path.read_text()) if path.is_file() else None
            if data is not None and (not isinstance(data, dict)
                                     or data.get("key") != json.loads(json.dumps(key, default=str))):
                data = None   # a hash collision, or a file edited by hand
        except (OSError, ValueError) as e:
            log.warning("ignoring the cost table %s: %s", path, e)
            data = None
    data = from_leader(data, tp)
    if data is None:
        return None
    try:
        table = CostTable.from_dict(setup.spec, data["table"], source=f"the cache, measured {data.get('date', '?')}")
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        log.warning("ignoring a cost table in %s: %s", costs_dir(), e)
        return None
    return table if table.covers(buckets, drafter) else None


def save_costs(table: CostTable, key: dict[str, Any]) -> Path:
    """Keep `table` for later starts under `key` (written whole, then renamed: a reader never
    finds half a file)."""
    path = cost_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "table": table.to_dict()},
                              default=str))
    tmp.replace(path)
    return path


# -- drafttree cache info | clear ----------------------------------------------------------------
@dataclass(frozen=True)
class PartInfo:
    name: str
    path: Path
    files: int
    bytes: int

    def format(self) -> str:
        return f"{self.name:<9} {self.files:>7} files {self.bytes / 2**20:>10.1f} MiB  {self.path}"


def _usage(path: Path) -> tuple[int, int]:
    files = size = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            try:
                size += os.lstat(os.path.join(dirpath, n)).st_size
                files += 1
            except OSError:
                pass
    return files, size


def info(root: Path | None = None) -> list[PartInfo]:
    """Each part of the cache: its directory, files and bytes."""
    root = root or current().cache
    return [PartInfo(name, root / name, *_usage(root / name)) for name in PARTS]


def clear(parts: tuple[str, ...] = PARTS, root: Path | None = None) -> list[PartInfo]:
    """Delete the named parts of the cache (what each held, before); ValueError for an unknown part."""
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise ValueError(f"unknown cache part {bad}: choose from {', '.join(PARTS)} (or all)")
    root = root or current().cache
    held = [p for p in info(root) if p.name in parts]
    for p in held:
        if p.path.is_symlink():
            p.path.unlink()
        elif p.path.exists():
            shutil.rmtree(p.path)
    return held
