"""An engine's setup, resolved once from its EngineConfig before any weight loads (`resolve`):
the model and drafter configs, the speculation, the settings, the device, and which graphs and
sampler modes it captures. The engine and `drafttree graphs` both take it from here; every bad
option is refused here, before the weights."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from drafttree.config import ModelConfig, parse_dtype, resolve_device, sampling_defaults
from drafttree.engine.config import GENERATION_CONFIGS, EngineConfig, parse_budget
from drafttree.engine.text import has_tokenizer
from drafttree.kernels import invariant_attn
from drafttree.models.dflash import DFlashConfig
from drafttree.models.dflash2 import drafter_config
from drafttree.parallel.group import TPGroup
from drafttree.phases import SpecConfig
from drafttree.runner.phase_table import CAPTURED_MODES
from drafttree.sampling import SampleMode, SamplingParams
from drafttree.settings import Settings, current

if TYPE_CHECKING:
    from drafttree.engine.memory_plan import Device
    from drafttree.runner.model_runner import CacheConfig

log = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parent.parent / "assets"
SHIPPED_DRAFTER = ASSETS / "drafter-smollm2"
DEFAULT_BUDGET = 32   # DDTree nodes per round, unless the drafter's config names its own
# the options that only speculation reads
SPEC_OPTIONS = ("draft_model", "block_size", "budget", "budget_schedule", "speculate_sampled", "draft_quantization")


def is_default_model(model: str | None) -> bool:
    from drafttree.loader.default_model import DEFAULT_MODEL_NAME
    return model in (None, "default") or (isinstance(model, str) and model.lower() == DEFAULT_MODEL_NAME.lower())


def resolve_drafter(cfg: EngineConfig) -> Path | None:
    """The drafter directory to load: the one given, else the shipped one for the default model,
    on every device: with the budget chosen per round (the default), speculation runs only where
    the measured cost and the predicted acceptance say it pays."""
    if cfg.spec == "none":
        return None
    if cfg.draft_model:   # a directory, else a Hugging Face repo id
        from drafttree.loader import hub
        path = Path(cfg.draft_model).expanduser()
        if not path.exists() and hub.is_repo_id(cfg.draft_model):
            return hub.snapshot(cfg.draft_model, what="draft model")
        return path
    if is_default_model(cfg.model) and (SHIPPED_DRAFTER / "config.json").is_file():
        return SHIPPED_DRAFTER
    return None


def may_choose_budget(cfg: EngineConfig) -> bool:
    """Whether the engine may time rounds to choose each one's budget (a drafter and `auto`)."""
    return cfg.spec != "none" and parse_budget(cfg.budget) is None and resolve_drafter(cfg) is not None


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
    # What the user sets wins: an explicit budget drafts every round, at every temperature and
    # batch size, unless the user also limits it (a schedule, --no-speculate-sampled); `auto`
    # chooses per round, up to the drafter config's ddtree_default_budget. A drafter config's
    # ddtree_default_budget_schedule / _speculate_sampled are not applied (`check_defaults`).
    schedule = cfg.budget_schedule
    sampled = cfg.speculate_sampled
    return SpecConfig(method, bs, budget, SpecConfig.parse_schedule(schedule, budget), sampled is not False,
                      adaptive)


def check_defaults(drafter: DFlashConfig, where: Path | None) -> None:
    """Say, once per drafter directory, that its config's schedule and sampled-round defaults are
    not applied (they were measured stand-ins for the per-round choice that `auto` now makes)."""
    keys = [k for k, v in (("ddtree_default_budget_schedule", drafter.default_schedule),
                           ("ddtree_default_speculate_sampled", drafter.default_sampled)) if v is not None]
    if keys and where not in _WARNED:
        _WARNED.add(where)
        log.warning("%s: %s not applied: --budget auto chooses each round's budget, an explicit --budget drafts "
                    "every round (--budget-schedule and --no-speculate-sampled limit it)", where, ", ".join(keys))


_WARNED: set[Path | None] = set()


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


def sampler_modes(names: tuple[str, ...] | None) -> tuple[SampleMode, ...]:
    """The sampler modes whose round graphs are captured (`EngineConfig.sampler_modes`)."""
    if names is None:
        return CAPTURED_MODES
    known = {m.name.lower(): m for m in CAPTURED_MODES}
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ValueError(f"sampler_modes: {bad or 'none given'}; choose from {', '.join(known)}")
    return tuple(m for m in CAPTURED_MODES if m.name.lower() in names)


@dataclass(frozen=True)
class EngineSetup:
    """What an engine is, resolved from its config once; nothing here is read again elsewhere."""
    cfg: EngineConfig
    model_dir: Path | None          # the target's directory; None for random weights
    target: ModelConfig
    drafter_dir: Path | None        # the drafter's directory; None for none or a random drafter
    drafter: DFlashConfig | None    # None when the engine does not speculate
    spec: SpecConfig
    settings: Settings
    device: torch.device
    dtype: torch.dtype
    world: int                      # tensor-parallel ranks
    cuda_graphs: bool
    prefill_graphs: bool
    sampler_modes: tuple[SampleMode, ...]   # the round graphs' modes
    structured_graphs: bool         # the constrained round's graphs captured too
    processed_graphs: bool          # the processed round's graphs captured too
    overlap: bool                   # launch each round before reading the previous one's tokens
    defer_graphs: bool = False      # the structured and processed graphs captured after start-up, while idle
    # a request's sampling defaults where it leaves them out (`resolve_sampling_defaults`)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None   # the template given in place of the model's (its text)


def resolve(cfg: EngineConfig, tp: TPGroup | None = None) -> EngineSetup:
    """The setup of an engine of `cfg` (over `tp`: this rank's), every option checked, no weights
    read (a GGUF model is converted once and cached)."""
    from drafttree.loader.default_model import resolve_model
    from drafttree.models import random_shapes

    if cfg.tensor_parallel_size != 1 and (tp is None or tp.world != cfg.tensor_parallel_size):
        raise ValueError("an engine over several ranks starts with drafttree.engine.launch.start_engine "
                         "(LLM and the command line use it)")
    if cfg.max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {cfg.max_num_seqs}")
    if cfg.page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {cfg.page_size}")
    modes = sampler_modes(cfg.sampler_modes)
    settings = settings_of(cfg)
    device = tp.device if tp is not None else resolve_device(cfg.device)
    dtype = parse_dtype(cfg.dtype, str(device))
    wants_drafter = cfg.spec not in (None, "none")
    model_dir, drafter_dir, dcfg = None, None, None
    if cfg.random_weights:
        tcfg = random_shapes.shape_config(cfg.random_weights)[0]
        if wants_drafter:
            dcfg = random_shapes.random_drafter_config(cfg.random_weights, tcfg)
    else:
        model_dir = resolve_model(cfg.model)
        tcfg = ModelConfig.from_dir(model_dir)
        drafter_dir = resolve_drafter(cfg)
        if drafter_dir is not None:
            dcfg = drafter_config(drafter_dir)   # DFlash or DFlash2, by the declared architecture
            dcfg.check_fits(tcfg)
            check_defaults(dcfg, drafter_dir)
        elif cfg.random_drafter and wants_drafter:
            dcfg = random_shapes.drafter_config_for(tcfg, cfg.block_size or 16)
    if settings.deterministic:
        check_deterministic(tcfg)
    if cfg.draft_quantization is not None:
        from drafttree.models import quant
        quant.check(cfg.draft_quantization, device)
    spec = resolve_spec(cfg, dcfg)
    if not spec.speculative:
        dcfg, drafter_dir = None, None
        unused = [n for n in SPEC_OPTIONS if getattr(cfg, n) is not None]
        if unused:   # said, not silently dropped (the same options may turn speculation on and off)
            log.warning("spec is 'none' (no speculation): %s take no effect", ", ".join(unused))
    graphs = cfg.cuda_graphs if cfg.cuda_graphs is not None else device.type == "cuda"
    if cfg.max_graph_len is not None and cfg.max_graph_len < 1:
        raise ValueError(f"max_graph_len must be >= 1 (tokens of prompt and output), got {cfg.max_graph_len}")
    if cfg.prefill_graphs and not graphs:
        raise ValueError("prefill_graphs needs CUDA graphs (a CUDA device, cuda_graphs not False)")
    if cfg.sampler_modes is not None and not graphs and not spec.adaptive:
        log.warning("sampler_modes %s take no effect: they choose the round graphs captured and the modes the "
                    "cost model times, and this engine captures no graph and has no cost model",
                    ",".join(cfg.sampler_modes))
    for name in ("structured_graphs", "processed_graphs"):
        if getattr(cfg, name) and not graphs:
            raise ValueError(f"{name} needs CUDA graphs (a CUDA device, cuda_graphs not False)")
    if cfg.defer_graphs and not graphs:
        raise ValueError("defer_graphs needs CUDA graphs (a CUDA device, cuda_graphs not False)")
    overlap = cfg.overlap if cfg.overlap is not None else device.type == "cuda"
    structured, processed = graphs and cfg.structured_graphs is not False, graphs and cfg.processed_graphs is not False
    return EngineSetup(cfg, model_dir, tcfg, drafter_dir, dcfg, spec, settings, device, dtype,
                       1 if tp is None else tp.world, graphs, graphs and cfg.prefill_graphs is not False, modes,
                       structured, processed, overlap,
                       bool(cfg.defer_graphs) and (structured or processed or cfg.prefill_graphs is not False),
                       resolve_sampling_defaults(cfg.generation_config, model_dir),
                       resolve_chat_template(cfg.chat_template, model_dir))


def resolve_chat_template(value: str | None, model_dir: Path | None) -> str | None:
    """`EngineConfig.chat_template`'s text, checked before any weight is read."""
    if value is None:
        return None
    if not has_tokenizer(model_dir):
        raise ValueError("chat_template needs the model's tokenizer; this model has none (token ids only)")
    from drafttree.loader.chat_template import read_chat_template
    return read_chat_template(value)


def resolve_sampling_defaults(which: str, model_dir: Path | None) -> dict[str, Any]:
    """`EngineConfig.generation_config`: the model's generation_config.json sampling ("auto") or
    none ("vllm"), checked as SamplingParams checks it: a value the sampler cannot take is refused
    before any weight is read, naming it."""
    if which not in GENERATION_CONFIGS:
        raise ValueError(f"generation_config must be one of {', '.join(GENERATION_CONFIGS)}, got {which!r}")
    found = sampling_defaults(model_dir) if which == "auto" else {}
    try:
        SamplingParams(**found)
    except ValueError as e:
        raise ValueError(f"the model's generation_config.json: {e} (generation_config='vllm' leaves the file's "
                         "sampling aside)") from None
    if found:
        log.info("sampling defaults from the model's generation_config.json, where a request leaves them out: %s",
                 found)
    return found


def graph_kv_lengths(cache: CacheConfig, max_graph_len: int | None) -> list[int]:
    """The KV buckets whose round graphs an engine captures: every one, or with `max_graph_len`
    those up to the one a request of that many tokens (and a round's writes) attends over."""
    if max_graph_len is None:
        return list(cache.kv_buckets)
    last = cache.kv_bucket(max_graph_len + cache.headroom)
    return [n for n in cache.kv_buckets if n <= last]


def load_models(setup: EngineSetup, tp: TPGroup | None = None):
    """(target, drafter or None) of the setup, each checked before anything is kept. Over a
    tensor-parallel group the target is this rank's shards and the drafter whole."""
    from drafttree.loader.drafter import load_drafter
    from drafttree.loader.weights import load_target
    from drafttree.models import quant
    from drafttree.models.random_shapes import drafter_from_config, random_target

    cfg, device, dtype = setup.cfg, setup.device, setup.dtype
    if setup.model_dir is None:
        target = random_target(cfg.random_weights, device, dtype, tp)
    else:
        target, _ = load_target(setup.model_dir, dtype, device, tp)
    drafter = None
    if setup.drafter_dir is not None:
        drafter = load_drafter(setup.drafter_dir, target, dtype, device)
    elif setup.drafter is not None:
        drafter = drafter_from_config(setup.drafter, target, device, dtype)
    if drafter is not None and cfg.draft_quantization is not None:
        quant.quantize_drafter(drafter, cfg.draft_quantization)
    return target, drafter


def describe_plan(cfg: EngineConfig, device: Device | None = None) -> str:
    """The settings, the CUDA graph plan and the memory plan per GPU (for `device`, a
    `memory_plan.Device`; None: an assumed H200), from the configs alone."""
    from drafttree.engine.scheduler import SchedulerConfig
    from drafttree.runner.cuda_graph import first_sets, format_plan, graph_keys, graph_plan, set_keys
    from drafttree.runner.model_runner import CacheConfig
    from drafttree.runner.prefill_plan import at_offsets

    world = cfg.tensor_parallel_size
    if world != 1:
        from drafttree.parallel.shard import check_size
        check_size(target_config(cfg), world)
    setup = resolve(cfg if world == 1 else _one_rank(cfg))
    spec, target, dcfg = setup.spec, setup.target, setup.drafter
    cache = CacheConfig(cfg.max_num_seqs, cfg.max_model_len or target.max_position_embeddings, spec.kv_headroom,
                        cfg.page_size)
    kv_lengths = graph_kv_lengths(cache, cfg.max_graph_len)
    structured, processed = cfg.structured_graphs is not False, cfg.processed_graphs is not False
    plan = graph_plan(spec, target, dcfg.model if dcfg else None, cfg.max_num_seqs, kv_lengths, world,
                      setup.sampler_modes, structured, processed)
    n_plain, n_all = (len(graph_keys(spec, cfg.max_num_seqs, kv_lengths, setup.sampler_modes, dcfg is not None,
                                     c, c)) for c in (False, True))
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
               f"{','.join(map(str, prefill.offset_lengths()))}; captured "
               + ("after start-up, while idle (defer_graphs)\n" if cfg.defer_graphs else "at start-up\n")
               if cfg.prefill_graphs is not False
               else "; prefill runs eagerly\n")
            + f"settings: {setup.settings.describe()}\n")
    off = [n for n, on in (("structured_graphs", structured), ("processed_graphs", processed)) if not on]
    text = head + format_plan(plan, setup.sampler_modes) + (
        f"\nround graphs for rounds with neither structured output nor logits processing: {n_plain}; with both "
        f"kinds captured: {n_all}" + (f"; not captured: {', '.join(off)}" if off else "")
        + (f"; the {n_all - n_plain} more are captured after start-up, while idle (defer_graphs)"
           if cfg.defer_graphs and len(off) < 2 else ""))
    if cfg.defer_graphs and not setup.settings.deterministic:   # `prepare.first_sets_only`
        n_first = len(set_keys(spec, first_sets(cache.batch_buckets, kv_lengths, setup.sampler_modes),
                               dcfg is not None, False, False))
        text += (f"\nbefore /ready (defer_graphs): the first sets' {n_first} round graphs; the others' rounds "
                 "replay them until theirs are captured, while idle"
                 + ("; a cost table still to be measured is timed in them, and in its own modes after those"
                    if spec.adaptive else ""))

    # -- the memory plan of each GPU (engine/memory_plan.py), from the same setup
    if setup.model_dir is None:   # a random shape: no checkpoint config to plan from
        return text
    from drafttree.engine.memory_plan import plan_for
    return text + "\n" + plan_for(cfg, setup.model_dir, target, dcfg, spec, device).format()


def _one_rank(cfg: EngineConfig) -> EngineConfig:
    """The config as one rank resolves it (a plan needs no process group: every rank's setup is alike)."""
    from dataclasses import replace
    return replace(cfg, tensor_parallel_size=1)
