"""The training loop: frozen target features -> drafter blocks -> weighted CE, with AdamW,
cosine schedule, checkpoints that resume exactly, and the final published-format drafter."""
from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from drafttree.config import parse_dtype
from drafttree.models.decoder import DecoderLM
from drafttree.models.dflash2 import DFlash2Drafter
from drafttree.loader.drafter import load_drafter
from drafttree.train.curves import CURVE, plot_history
from drafttree.train.data import TrainSequence, read_sequences, regenerated, unused_token
from drafttree.train.forward import (
    LOSSES,
    FeatureExtractor,
    SelectorTerm,
    block_loss,
    check_trainable,
    drafter_train_forward,
    eager,
)
from drafttree.train.model import (
    ARCHS,
    DFLASH2_SHAPE,
    DrafterSpec,
    arch_of,
    config_from_dict,
    count_parameters,
    drafter_config_dict,
    grow_drafter,
    new_drafter,
    published_config,
    save_drafter,
    to_dflash2,
)
from drafttree.train.parallel import Group
from drafttree.train.recipe import (
    build_blocks,
    cosine_lambda,
    default_gamma,
    default_target_layer_ids,
    epoch_batches,
    position_weights,
    sample_anchors,
)

log = logging.getLogger(__name__)
# steps timed (after 5 warm-up steps) when a time limit fits the schedule to the clock: again and
# again while the schedule is young, since early steps may run slower than the rest (0.39 against
# 0.25 s/step in one GPU run, whose single fit then left 40 % of its time unused)
_FIT_AT = (20, 80, 320)


@dataclass
class TrainConfig:
    out: Path
    data: Path | list[Path] | None = None   # regenerated sequences (JSONL files, read in order: shards,
                                            # temperatures); default `data.regenerated(out)`
    target: str | None = None
    device: str | None = None
    dtype: str | None = None              # the frozen target's; the drafter trains in fp32 (+ bf16 autocast on CUDA)
    draft_layers: int = 3
    intermediate_size: int | None = None
    block_size: int | None = None         # default DrafterSpec's; with init_from_drafter: the drafter's unless given
    num_target_features: int = 5
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None      # default: the largest id absent from the data
    init_from_target: bool = False
    arch: str | None = None               # dflash | dflash2; default: init_from_drafter's, else dflash. dflash2
                                          # from a DFlash init_from_drafter: its weights, identity convolutions
                                          # and a fresh selector (model.to_dflash2)
    conv_kernel_size: int | None = None   # DFlash2's shape (default model.DFLASH2_SHAPE); a new drafter's only
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    selector_loss_weight: float = 1.0     # DFlash2: the selector's K-way cross-entropy beside the unary loss
    loss: str = "ce"                      # ce: against the sequences' tokens (the recipe); kl: distillation,
                                          # KL to the target's distribution at each label (the target alongside)
    init_from_drafter: Path | None = None  # continue from a published drafter: its shape and weights
    grow_layers: int | None = None        # with init_from_drafter: this many layers (model.grow_drafter)
    grow_intermediate: int | None = None  # with init_from_drafter: this MLP width
    attention: str = "auto"               # dense | blockwise; auto: blockwise on CUDA, dense on CPU
    anchors_per_seq: int = 512
    batch_size: int = 8
    epochs: int = 2
    max_steps: int | None = None
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float | None = None
    max_len: int = 2048
    loop_keep: int | None = None          # keep this many periods of a response's closing loop (data.read_sequences)
    save_every: int = 0
    snapshot_every: int = 0               # the drafter every N steps under OUT/snapshots, with the tokens
                                          # trained on so far: the points of the τ curve (evaluate.tau_curve)
    log_every: int = 10
    resume: bool = False
    save_dtype: str = "bf16"
    seed: int = 0
    stop_at: int | None = None            # stop (checkpointed) at this step, schedule unchanged
    time_limit: float | None = None       # seconds of training before stopping early
    progress: bool = True

    @property
    def grows(self) -> bool:
        return bool(self.grow_layers or self.grow_intermediate)

    @property
    def dflash2_shape(self) -> dict[str, int]:
        """The DFlash2 shape options given (None: not given)."""
        return {k: getattr(self, k) for k in DFLASH2_SHAPE if getattr(self, k) is not None}

    @property
    def drafter_dir(self) -> Path:
        return self.out / "drafter"

    @property
    def checkpoint(self) -> Path:
        return self.out / "checkpoints" / "last.pt"


class Trainer:
    def __init__(self, cfg: TrainConfig, target: DecoderLM | None = None,
                 sequences: list[TrainSequence] | None = None, group: Group | None = None) -> None:
        from drafttree.loader.default_model import resolve_model
        from drafttree.loader.weights import load_target

        if cfg.grows and cfg.init_from_drafter is None:
            raise ValueError("growing a drafter (grow_layers / grow_intermediate) needs init_from_drafter")
        if cfg.loop_keep is not None and cfg.loop_keep < 0:
            raise ValueError(f"loop_keep must be a number of periods >= 0, got {cfg.loop_keep}")
        if cfg.snapshot_every < 0 or cfg.save_every < 0:
            raise ValueError(f"snapshot_every and save_every are step counts >= 0 (0: off), "
                             f"got {cfg.snapshot_every} and {cfg.save_every}")
        if cfg.arch not in (None, *ARCHS):
            raise ValueError(f"arch must be one of {ARCHS}, got {cfg.arch!r}")
        if cfg.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {cfg.loss!r}")
        self.cfg, self.group = cfg, group or Group()
        self.device = self.group.device(cfg.device)
        if target is None:
            target, _ = load_target(resolve_model(cfg.target), parse_dtype(cfg.dtype, str(self.device)),
                                    self.device)
        self.target = target.eval().requires_grad_(False)
        tcfg = target.cfg
        data = cfg.data or regenerated(cfg.out)
        files = [Path(f) for f in data] if isinstance(data, (list, tuple)) else [Path(data)]
        self.seqs = sequences if sequences is not None else \
            [s for f in files for s in read_sequences(f, cfg.max_len, loop_keep=cfg.loop_keep)]
        if not self.seqs:
            raise ValueError(f"no training sequences with a response in {', '.join(map(str, files))}")
        ckpt = torch.load(cfg.checkpoint, map_location="cpu", weights_only=False) \
            if cfg.resume and cfg.checkpoint.is_file() else None
        warm = cfg.init_from_drafter if ckpt is None else None
        upgrade = False   # a DFlash init_from_drafter trained as DFlash2
        if ckpt is not None:
            self.config_dict = ckpt["drafter_config"]
            self._check_arch(arch_of(self.config_dict), "the checkpoint's drafter", False,
                             same=self.config_dict["dflash_config"])
        elif warm is not None:
            self.config_dict = published_config(warm)
            if cfg.block_size is not None:    # the weights hold no block size: a drafter drafts any width
                self.config_dict["block_size"] = cfg.block_size
            has = arch_of(self.config_dict)
            upgrade = has == "dflash" and cfg.arch == "dflash2"
            self._check_arch(has, f"the drafter {warm}", upgrade)
        else:
            arch = cfg.arch or "dflash"
            self._check_arch(arch, "a new drafter", arch == "dflash2")
            ids = cfg.target_layer_ids or default_target_layer_ids(tcfg.num_layers, cfg.num_target_features)
            mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else unused_token(self.seqs, tcfg.vocab_size)
            spec = DrafterSpec(cfg.draft_layers, cfg.intermediate_size, cfg.block_size or DrafterSpec.block_size,
                               mask_id, tuple(ids), arch, cfg.dflash2_shape)
            self.config_dict = drafter_config_dict(tcfg, spec)
        self.dcfg = config_from_dict(self.config_dict)
        self.dcfg.check_fits(tcfg)
        torch.manual_seed(cfg.seed)
        if warm is not None:   # the published weights, as a trainable fp32 copy
            self.drafter = load_drafter(Path(warm), target, torch.float32, self.device)
            if upgrade:
                self.drafter, self.config_dict = to_dflash2(self.drafter, self.config_dict, target, cfg.dflash2_shape)
                self.dcfg = config_from_dict(self.config_dict)
                self.dcfg.check_fits(tcfg)
            if cfg.grows:
                self.drafter, self.config_dict = grow_drafter(self.drafter, self.config_dict, target,
                                                              cfg.grow_layers, cfg.grow_intermediate)
                self.dcfg = config_from_dict(self.config_dict)
            self.drafter.train().requires_grad_(True)
        else:
            self.drafter = new_drafter(self.dcfg, target, init_from_target=cfg.init_from_target).train()
        check_trainable(self.drafter)
        self.selector = SelectorTerm(self.drafter.candidate_selector, self.dcfg.selector_top_k,
                                     cfg.selector_loss_weight) if isinstance(self.drafter, DFlash2Drafter) else None
        self.group.broadcast_module(self.drafter)
        self.features = FeatureExtractor(target, self.dcfg.target_layer_ids, cfg.batch_size,
                                         max(len(s.ids) for s in self.seqs))
        self.attention = cfg.attention if cfg.attention != "auto" else \
            ("blockwise" if self.device.type == "cuda" else "dense")
        bs = self.dcfg.block_size
        self.pos_weights = position_weights(bs, cfg.gamma or default_gamma(bs)).to(self.device)
        self.steps_per_epoch = self.group.steps_per_epoch(math.ceil(len(self.seqs) / cfg.batch_size))
        total = cfg.epochs * self.steps_per_epoch
        self.total_steps = min(total, cfg.max_steps) if cfg.max_steps is not None else total
        fused = {"fused": True} if self.device.type == "cuda" else {}
        self.opt = torch.optim.AdamW(self.drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, **fused)
        self.warm = max(1, round(cfg.warmup * self.total_steps))
        # the schedule reads self.total_steps at each step: a time limit may shorten it (see run)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: cosine_lambda(self.total_steps, self.warm)(s))
        self.anchor_gen = torch.Generator().manual_seed(cfg.seed + self.group.rank)
        self.step = 0
        self.tokens = 0          # response tokens trained on, all ranks (each rank's count x ranks)
        self.history: list[dict[str, Any]] = []
        if ckpt is not None:
            self._restore(ckpt)

    def _check_arch(self, arch: str, what: str, shapes: bool, same: dict[str, Any] | None = None) -> None:
        """The drafter trained is DFlash2 or DFlash as `arch` says (`what`'s); refuse options that
        would be ignored: another arch (DFlash becomes DFlash2 only where `shapes`), DFlash2 shape
        options where they shape nothing (`shapes`: a new DFlash2 drafter or one made from DFlash;
        a resumed run may repeat its own, `same`), a selector weight without a selector."""
        cfg = self.cfg
        if cfg.arch is not None and cfg.arch != arch and not (shapes and cfg.arch == "dflash2"):
            raise ValueError(f"arch={cfg.arch!r}, but {what} is {arch!r}"
                             + (" (a DFlash2 drafter does not become DFlash)" if arch == "dflash2" else ""))
        given = {k: v for k, v in cfg.dflash2_shape.items() if same is None or same.get(k) != v}
        if given and not shapes:
            raise ValueError(f"{', '.join(given)} shape a new DFlash2 drafter (arch='dflash2'); {what} is {arch!r}"
                             + (" with its own shape" if arch == "dflash2" else ""))
        if cfg.selector_loss_weight != 1.0 and arch != "dflash2" and not shapes:
            raise ValueError(f"selector_loss_weight is DFlash2's; {what} is {arch!r}")

    # -- checkpoints -------------------------------------------------------------------------
    def _restore(self, ckpt: dict[str, Any]) -> None:
        if ckpt["num_sequences"] != len(self.seqs) or ckpt["batch_size"] != self.cfg.batch_size \
                or ckpt.get("world", 1) != self.group.world:
            raise ValueError("the checkpoint was made with other data, batch size or number of ranks; "
                             "cannot resume")
        self.drafter.load_state_dict(ckpt["drafter"])
        self.opt.load_state_dict(ckpt["optimizer"])
        self.sched.load_state_dict(ckpt["scheduler"])
        self.step, self.history = ckpt["step"], ckpt["history"]
        self.tokens = ckpt.get("tokens", 0)
        self.total_steps = ckpt.get("total_steps", self.total_steps)
        states = ckpt["rng"]["anchors"]
        self.anchor_gen.set_state(states[self.group.rank] if isinstance(states, list) else states)
        torch.set_rng_state(ckpt["rng"]["torch"])
        log.info("resumed from %s at step %d", self.cfg.checkpoint, self.step)

    def save_checkpoint(self) -> Path:
        """Collective: every rank calls it (each one's anchor sampler state is kept); rank 0 writes."""
        path = self.cfg.checkpoint
        anchors = self.group.gather(self.anchor_gen.get_state())
        if not self.group.main:
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {"drafter": self.drafter.state_dict(), "optimizer": self.opt.state_dict(),
                 "scheduler": self.sched.state_dict(), "step": self.step, "history": self.history,
                 "tokens": self.tokens,
                 "total_steps": self.total_steps,
                 "drafter_config": self.config_dict, "num_sequences": len(self.seqs),
                 "batch_size": self.cfg.batch_size, "world": self.group.world,
                 "rng": {"anchors": anchors, "torch": torch.get_rng_state()}}
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
        plot_history(self.history, self.cfg.out / CURVE)   # the curve so far, with every checkpoint
        return path

    def save_snapshot(self) -> Path:
        """The drafter as it is now, in the published format, under OUT/snapshots/stepNNNNNN, with
        snapshot.json (step, tokens trained on): one point of the τ curve."""
        path = self.cfg.out / "snapshots" / f"step{self.step:06d}"
        if self.group.main:
            save_drafter(self.drafter, self.config_dict, path, parse_dtype(self.cfg.save_dtype))
            (path / "snapshot.json").write_text(json.dumps({"step": self.step, "tokens": self.tokens}))
        return path

    # -- one step ----------------------------------------------------------------------------
    def _collate(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
        seqs = [self.seqs[i] for i in idx]
        lengths = [len(s.ids) for s in seqs]
        ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, :len(s.ids)] = torch.tensor(s.ids)
        return ids, torch.tensor(lengths), lengths, [s.prompt_len for s in seqs]

    def train_step(self, idx: list[int]):
        with eager():
            return self._train_step(idx)

    def _train_step(self, idx: list[int]):
        ids, lens, lengths, prompt_lens = self._collate(idx)
        anchors, valid = sample_anchors(prompt_lens, lengths, self.cfg.anchors_per_seq, self.anchor_gen)
        dev = self.device
        ids, lens = ids.to(dev, non_blocking=True), lens.to(dev, non_blocking=True)
        blocks = build_blocks(ids, lens, anchors.to(dev), valid.to(dev), self.dcfg.block_size,
                              self.dcfg.mask_token_id)
        feats, final = self.features.with_final(ids)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            hidden = drafter_train_forward(self.drafter, feats, blocks, self.attention)
            out = block_loss(hidden, blocks, self.target.lm_head, self.pos_weights,
                             teacher=final if self.cfg.loss == "kl" else None, input_ids=ids, selector=self.selector)
        out.loss.backward()
        self.group.average_grads(self.drafter.parameters())
        gnorm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return out, gnorm

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        lengths = [len(s.ids) for s in self.seqs]
        end = min(self.total_steps, cfg.stop_at) if cfg.stop_at is not None else self.total_steps
        cap, planned = end, self.total_steps
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step",
                   disable=not (cfg.progress and self.group.main))
        acc = self._zero_acc()
        t0, start_step = time.perf_counter(), self.step
        out_of_time = lambda: cfg.time_limit is not None and bool(self.group.decide(
            int(time.perf_counter() - t0 > cfg.time_limit), self.device))
        while self.step < end and not out_of_time():
            epoch, first = divmod(self.step, self.steps_per_epoch)
            for idx in self.group.shard(epoch_batches(lengths, cfg.batch_size, cfg.seed, epoch))[first:]:
                out, gnorm = self.train_step(idx)
                self.tokens += sum(self.seqs[i].response_len for i in idx) * self.group.world
                for k, v in (("loss", out.loss.detach()), ("correct", out.correct), ("count", out.count),
                             ("accepted", out.accepted), ("blocks", out.blocks), ("gnorm", gnorm.detach()),
                             ("selector", out.selector if out.selector is not None else acc["selector"] * 0)):
                    acc[k] = acc[k] + v
                acc["n"] += 1
                bar.update(1)
                if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                    rec = self._log_record(acc, epoch)
                    self.history.append(rec)
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", acc1=f"{rec['acc'][0]:.2f}",
                                    tau=f"{rec['tau_train']:.2f}")
                    acc = self._zero_acc()
                if cfg.save_every and self.step % cfg.save_every == 0:
                    self.save_checkpoint()
                if cfg.snapshot_every and self.step % cfg.snapshot_every == 0:
                    self.save_snapshot()
                if self.step - start_step == 5:
                    t5 = time.perf_counter()
                # an explicit max_steps fixes the schedule: the time limit then only stops (resumable)
                if cfg.time_limit is not None and cfg.max_steps is None \
                        and self.step - start_step - 5 in _FIT_AT:
                    end = self._fit_schedule(cap, planned, t0, t5, self.step - start_step - 5, bar)
                if self.step >= end or out_of_time():
                    break
        if self.step < end:
            log.warning("time limit reached at step %d of %d", self.step, self.total_steps)
        if acc["n"]:   # steps since the last record (a time limit stops between records)
            self.history.append(self._log_record(acc, epoch))
        if cfg.snapshot_every and self.step % cfg.snapshot_every:   # the curve ends at the last step
            self.save_snapshot()
        bar.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        saved = cfg.save_every or cfg.stop_at is not None or self.step < self.total_steps
        if saved:
            self.save_checkpoint()   # draws the curve too
        if self.group.main:
            save_drafter(self.drafter, self.config_dict, cfg.drafter_dir, parse_dtype(cfg.save_dtype))
        summary = {"step": self.step, "tokens": self.tokens, "total_steps": self.total_steps,
                   "steps_per_epoch": self.steps_per_epoch,
                   "sequences": len(self.seqs), "train_seconds": seconds,
                   "seconds_per_step": seconds / max(1, self.step - start_step),
                   "parameters": count_parameters(self.config_dict), "drafter_config": self.config_dict,
                   "train_config": {k: _plain(v) for k, v in asdict(cfg).items()},
                   "history": self.history}
        if self.group.main:
            write_log(cfg.out, summary)
            if not saved:
                plot_history(self.history, cfg.out / CURVE)
        return summary

    def _fit_schedule(self, cap: int, planned: int, t0: float, t5: float, timed: int, bar: tqdm) -> int:
        """Fit the cosine schedule's length to the time limit (a schedule cut off by the clock
        would stop at a high learning rate), never past the planned steps; refitted while it is
        in its first half, so the learning rate moves little when it changes."""
        if self.step > self.total_steps // 2:
            return min(cap, self.total_steps)
        now = time.perf_counter()
        rate = (now - t5) / timed
        fits = self.group.decide(self.step + int((self.cfg.time_limit - (now - t0)) / rate * 0.97), self.device)
        fits = min(max(self.step + 1, fits), planned)
        if fits != self.total_steps:
            log.info("time limit: the schedule now ends at step %d (%.3f s/step)", fits, rate)
            self.total_steps = fits
            self.warm = min(self.warm, max(1, round(self.cfg.warmup * self.total_steps)))
            bar.total = self.total_steps
        return min(cap, self.total_steps)

    def _zero_acc(self) -> dict[str, Any]:
        bs, dev = self.dcfg.block_size, self.device
        z = torch.zeros((), device=dev)
        return {"loss": z, "correct": torch.zeros(bs, dtype=torch.long, device=dev),
                "count": torch.zeros(bs, dtype=torch.long, device=dev), "accepted": z.long(), "blocks": z.long(),
                "gnorm": z, "selector": z, "n": 0}

    def _log_record(self, acc: dict[str, Any], epoch: int) -> dict[str, Any]:
        n = max(acc["n"], 1)
        per_pos = (acc["correct"][1:].float() / acc["count"][1:].clamp_min(1)).tolist()
        extra = {} if self.selector is None else {"selector_loss": float(acc["selector"]) / n}
        return {"step": self.step, "epoch": epoch, "lr": self.sched.get_last_lr()[0],
                "loss": float(acc["loss"]) / n, **extra, "grad_norm": float(acc["gnorm"]) / n,
                "acc": [round(a, 4) for a in per_pos],
                # drafted tokens right before the first miss, per block at uniform anchors, + 1:
                # above the decoded τ, whose rounds start after a miss, at harder positions
                "tau_train": 1.0 + float(acc["accepted"]) / max(int(acc["blocks"]), 1)}


def write_log(out: Path, updates: dict[str, Any]) -> Path:
    """Merge `updates` into out/train_log.json."""
    path = out / "train_log.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.update(updates)
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def _plain(value: Any) -> Any:
    """A config value as JSON holds it (paths as strings)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value) if isinstance(value, Path) else value
