"""Resolve the speculative setup from an EngineConfig, and describe the graph plan, weight-free."""
from __future__ import annotations

from pathlib import Path

import torch

from drafttree.config import ModelConfig
from drafttree.engine.config import EngineConfig
from drafttree.kernels import invariant_attn
from drafttree.models.dflash import DFlashConfig
from drafttree.parallel.group import TPGroup
from drafttree.phases import SpecConfig, schedule_for
from drafttree.settings import Settings, current

ASSETS = Path(__file__).resolve().parent.parent / "assets"
SHIPPED_DRAFTER = ASSETS / "drafter-smollm2"
DEFAULT_BUDGET = 32   # DDTree nodes per round, unless the drafter's config names its own


def is_default_model(model: str | None) -> bool:
    from drafttree.loader.default_model import DEFAULT_MODEL_NAME
    return model in (None, "default") or (isinstance(model, str) and model.lower() == DEFAULT_MODEL_NAME.lower())


def resolve_drafter(cfg: EngineConfig) -> Path | None:
    """The drafter directory to load: the one given, else the shipped one for the default model,
    on every device: with the budget chosen per round (the default), speculation runs only where
    the measured cost and the predicted acceptance say it pays."""
    if cfg.spec == "none":
        return None
    if cfg.draft_model:
        return Path(cfg.draft_model)
    if is_default_model(cfg.model) and (SHIPPED_DRAFTER / "config.json").is_file():
        return SHIPPED_DRAFTER
    return None


def resolve_spec(cfg: EngineConfig, drafter: DFlashConfig | None) -> SpecConfig:
    method = cfg.spec or ("ddtree" if drafter is not None else "none")
    if method != "none" and drafter is None:
        raise ValueError(f"spec={method!r} needs a draft model (draft_model=... / --draft-model)")
    if method == "none":
        return SpecConfig()
    bs = drafter.block_size if cfg.block_size is None else cfg.block_size
    adaptive = parse_budget(cfg.budget) is None
    default = drafter.default_budget or DEFAULT_BUDGET
    budget = (default if adaptive else parse_budget(cfg.budget)) if method == "ddtree" else 0
    # The drafter config's schedule and sampled-round choice were measured stand-ins for the
    # choice that `auto` makes every round; an explicit one still applies (as caps when auto).
    schedule = cfg.budget_schedule if cfg.budget_schedule is not None else \
        None if adaptive else schedule_for(method, drafter.default_schedule)
    sampled = cfg.speculate_sampled if cfg.speculate_sampled is not None else \
        True if adaptive else drafter.default_sampled
    return SpecConfig(method, bs, budget, SpecConfig.parse_schedule(schedule, budget), sampled is not False,
                      adaptive)


def parse_budget(value: int | str | None) -> int | None:
    """None for 'auto' (and None, the default), else the fixed budget (>= 1: plain decoding is
    spec 'none', and an explicit 0 must not quietly become something else)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"budget must be 'auto' or a number of tree nodes, got {value!r}") from None
    if n < 1:
        raise ValueError(f"budget must be >= 1 or 'auto' (spec 'none' decodes plainly), got {n}")
    return n


def target_config(cfg: EngineConfig) -> ModelConfig:
    """The target's config, read without its weights."""
    if cfg.random_weights:
        from drafttree.models.random_shapes import shape_config
        return shape_config(cfg.random_weights)[0]
    from drafttree.loader.default_model import resolve_model
    return ModelConfig.from_dir(resolve_model(cfg.model))


def settings_of(cfg: EngineConfig) -> Settings:
    """The settings an engine of `cfg` runs under: those in force, with the config's deterministic
    choice where it makes one (the engine's scope, `settings.scope`)."""
    s = current()
    return s if cfg.deterministic is None else s.replace(deterministic=cfg.deterministic)


def check_deterministic(tcfg: ModelConfig) -> None:
    """Refuse, before any weights load, a target deterministic mode does not cover."""
    if tcfg.sparse:
        raise ValueError(f"deterministic mode covers dense Llama, Qwen2 and Qwen3 targets; this one ({tcfg.arch}) "
                         "has MoE or MLA layers")
    if not invariant_attn.takes(tcfg.head_dim):
        raise ValueError(f"deterministic mode needs a head dim that is a power of two, at least 16; this model's is "
                         f"{tcfg.head_dim}")


def load_models(cfg: EngineConfig, device: torch.device, dtype: torch.dtype, tp: TPGroup | None = None):
    """(model directory or None, target, drafter or None), all checked before anything is kept.
    Over a tensor-parallel group the target is this rank's shards and the drafter whole."""
    from drafttree.loader.default_model import resolve_model
    from drafttree.loader.drafter import load_drafter
    from drafttree.loader.weights import load_target
    from drafttree.models import quant
    from drafttree.models.random_shapes import drafter_for, random_drafter, random_target

    wants_drafter = cfg.spec not in (None, "none")
    if current().deterministic:
        check_deterministic(target_config(cfg))
    if cfg.draft_quantization is not None:
        quant.check(cfg.draft_quantization, device)   # before any weights load
    model_dir = None
    if cfg.random_weights:
        target = random_target(cfg.random_weights, device, dtype, tp)
        drafter = random_drafter(cfg.random_weights, target, device, dtype) if wants_drafter else None
    else:
        model_dir = resolve_model(cfg.model)
        target, _ = load_target(model_dir, dtype, device, tp)
        dpath = resolve_drafter(cfg)
        drafter = load_drafter(dpath, target, dtype, device) if dpath is not None else None
        if drafter is None and cfg.random_drafter and wants_drafter:
            drafter = drafter_for(target, device, dtype, cfg.block_size or 16)
    if drafter is not None and cfg.draft_quantization is not None:
        quant.quantize_drafter(drafter, cfg.draft_quantization)
    return model_dir, target, drafter


def describe_plan(cfg: EngineConfig) -> str:
    from drafttree.loader.default_model import resolve_model
    from drafttree.runner.cuda_graph import format_plan, graph_plan, sampler_modes
    from drafttree.runner.prefill_plan import at_offsets
    from drafttree.engine.scheduler import SchedulerConfig

    target = ModelConfig.from_dir(resolve_model(cfg.model))
    world = cfg.tensor_parallel_size
    if world != 1:
        from drafttree.parallel.shard import check_size
        check_size(target, world)
    dpath = resolve_drafter(cfg)
    dcfg = DFlashConfig.from_dir(dpath) if dpath is not None else None
    if dcfg is not None:
        dcfg.check_fits(target)
    spec = resolve_spec(cfg, dcfg)
    if cfg.draft_quantization is not None:
        from drafttree.models.quant import check
        check(cfg.draft_quantization, "cpu")   # the method's name; the device is checked at start-up
    from drafttree.runner.model_runner import CacheConfig
    cache = CacheConfig(cfg.max_num_seqs, cfg.max_model_len or target.max_position_embeddings, spec.kv_headroom,
                        cfg.page_size)
    plan = graph_plan(spec, target, dcfg.model if dcfg else None, cfg.max_num_seqs, cache.kv_buckets, world)
    prefill = SchedulerConfig(cache, spec.max_commit, cfg.prefill_chunk, cfg.max_prefill_tokens,
                              cfg.admit_min).prefill   # the engine's own rule
    shapes = prefill.shapes()
    offsets = at_offsets(shapes)
    sched = ",".join(f"{b}:{n}" for b, n in spec.budget_schedule) or "-"
    budget = f"auto(<={spec.budget}: {','.join(map(str, spec.budgets))})" if spec.adaptive else spec.budget
    head = (f"spec={spec.method} block_size={spec.block_size} budget={budget} budget_schedule={sched} "
            f"speculate_sampled={'on' if spec.sampled else 'off'} max_num_seqs={cfg.max_num_seqs}"
            + (f" draft_quantization={cfg.draft_quantization}" if cfg.draft_quantization and spec.speculative else "")
            + (f" tensor_parallel_size={world} (each rank captures every graph; memory per rank)" if world > 1 else "")
            + "\n"
            f"max_model_len={cache.max_model_len} (the KV budget may lower it at start-up); KV pages of "
            f"{cache.page_size} tokens, {cache.pages_per_row} per request at most; prefix caching "
            f"{'on' if cfg.enable_prefix_caching else 'off'}\n"
            f"widths per request at batch 1: " + ", ".join(f"{p.value}={spec.width(p)}" for p in spec.round_phases)
            + (f"; prefill graphed: {len(shapes)} graphs per (rows, length bucket, attention length) of "
               f"the scheduler's forwards (prefill_chunk={cfg.prefill_chunk}, max_prefill_tokens="
               f"{cfg.max_prefill_tokens}): {len(shapes) - offsets} from position 0, {offsets} at offsets "
               f"(prefix-cache hits, continuing chunks) over KV lengths "
               f"{','.join(map(str, prefill.offset_lengths()))}; captured at start-up\n"
               if cfg.prefill_graphs is not False
               else "; prefill runs eagerly\n")
            + f"settings: {settings_of(cfg).describe()}\n")
    return head + format_plan(plan, sampler_modes(cfg.sampler_modes))
