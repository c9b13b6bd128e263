"""The engine: admits requests into cache rows, runs prefill and rounds, emits tokens."""
from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from drafttree.config import parse_dtype, resolve_device
from drafttree.engine.config import EngineConfig
from drafttree.engine.inflight import Launched, RoundOutputs
from drafttree.engine.plan import load_models, resolve_spec
from drafttree.engine.sequence import Sequence, Status
from drafttree.models.kv_cache import KVCache
from drafttree.runner.model_runner import CacheConfig, ModelRunner
from drafttree.sampling import SampleMode, SamplingParams
from drafttree.settings import Settings, current

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    rounds: int = 0
    accept_hist: Counter = field(default_factory=Counter)   # τ -> rounds (bounded, unlike a list)
    round_seconds: float = 0.0
    prefill_seconds: float = 0.0


class Engine:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.settings: Settings = current()   # DRAFTTREE_*: read from the environment once per process
        self.device = resolve_device(cfg.device)
        self.dtype = parse_dtype(cfg.dtype, str(self.device))
        self.model_dir, target, drafter = load_models(cfg, self.device, self.dtype)
        tcfg = target.cfg
        self.spec = resolve_spec(cfg, drafter.cfg if drafter is not None else None)
        if not self.spec.speculative:
            drafter = None
        self.model_cfg = tcfg
        self.max_model_len, rows = self._size_cache(tcfg, drafter)
        cache = CacheConfig(rows, self.max_model_len, self.spec.kv_headroom)
        if cfg.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {cfg.prefill_chunk}")
        if cfg.admit_min < 1:
            raise ValueError(f"admit_min must be >= 1, got {cfg.admit_min}")
        self.runner = ModelRunner(target, drafter, self.spec, cache, self.device, self.dtype, cfg.prefill_chunk)
        self.tokenizer = _load_tokenizer(self.model_dir) if self.model_dir is not None else None
        self.eos_ids = set(tcfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []     # running[i].row == i
        self.stats = EngineStats()
        self.stream_text = False    # a server streaming text sets this
        self.overlap = cfg.overlap if cfg.overlap is not None else self.device.type == "cuda"
        self._inflight: Launched | None = None
        self._last_read = 0.0
        self._outputs = RoundOutputs(rows, self.spec.max_commit, self.device)
        use_graphs = cfg.cuda_graphs if cfg.cuda_graphs is not None else self.device.type == "cuda"
        if cfg.prefill_graphs and not use_graphs:
            raise ValueError("prefill_graphs needs CUDA graphs (a CUDA device, cuda_graphs not False)")
        if use_graphs:
            from drafttree.runner.cuda_graph import GraphRunner
            self.runner.graphs = GraphRunner(self.runner)
            self.runner.graphs.capture()
        if use_graphs and cfg.prefill_graphs is not False:
            from drafttree.runner.prefill_graph import PrefillGraphs
            self.runner.prefill_graphs = PrefillGraphs(self.runner)

    def _size_cache(self, tcfg, drafter) -> tuple[int, int]:
        bpt = KVCache.bytes_per_token(tcfg.num_layers, tcfg.num_kv_heads, tcfg.head_dim, self.dtype, tcfg.v_cache_dim)
        if drafter is not None:
            dc = drafter.cfg.model
            bpt += KVCache.bytes_per_token(dc.num_layers, dc.num_kv_heads, dc.head_dim, self.dtype)
        gb = self.cfg.kv_cache_memory_gb
        if gb is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * 0.6)
                source = "the default: 60% of the free CUDA memory"
            else:
                budget = 1 << 30
                source = "the default on CPU"
        else:
            budget = int(gb * (1 << 30))
            source = "kv_cache_memory_gb"
        rows = self.cfg.max_num_seqs
        headroom = self.spec.kv_headroom
        fit = budget // (rows * bpt) - headroom
        wanted = self.cfg.max_model_len or tcfg.max_position_embeddings
        max_len = min(wanted, fit)
        fix = ("raise --kv-cache-memory-gb or lower --max-num-seqs (in Python: kv_cache_memory_gb, "
               "max_num_seqs)")
        if max_len < 16:
            raise ValueError(f"KV cache budget of {budget / 2**30:.2f} GiB holds only {max(fit, 0)} tokens "
                             f"per sequence for {rows} sequences; {fix}")
        if fit < wanted:
            whose = "the requested" if self.cfg.max_model_len else "the model's"
            kept = f" ({headroom} of each row is headroom for a round's writes)" if headroom else ""
            log.warning("max_model_len %d < %s %d: the KV cache budget of %.3g GiB (%s) holds %d rows x %d "
                        "tokens at %d bytes per token%s; %s, or pass --max-model-len %d to ask for less",
                        max_len, whose, wanted, budget / 2**30, source, rows, fit + headroom, bpt, kept, fix,
                        max_len)
        return max_len, rows

    # -- requests ----------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_dir} has no tokenizer: pass token ids instead of text")
            return self.tokenizer.encode(prompt, add_special_tokens=False), prompt
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.model_cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside the vocabulary [0, {self.model_cfg.vocab_size})")
        return ids, None

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context holds {self.max_model_len} "
                             f"(prompt plus generated tokens), so a prompt may have 1 to "
                             f"{self.max_model_len - 1} tokens")

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Sequence:
        params = params or SamplingParams()
        ids, text = self.encode(prompt)
        self.check_prompt(ids)
        seq = Sequence(ids, params, prompt=text)
        if request_id is not None:
            seq.request_id = request_id
        self.waiting.append(seq)
        self.stats.requests += 1
        self.stats.prompt_tokens += len(ids)
        return seq

    def abort(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.finish("abort")
        if seq.row >= 0:
            self._release([seq])

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[tuple[Sequence, list[int]]]:
        """Admit what fits, then one round for every running request. Returns the new tokens:
        with `overlap`, those of the round launched by the previous step (this step's round is
        launched first, so the device computes it while the host reads and emits)."""
        out = self._admit()
        self._release([s for s in self.running if s.finished])
        prev = self._inflight
        if prev is not None and (prev.abandoned or not self._may_overlap()):
            if not prev.abandoned:
                out += self._read(prev)
            self._inflight = prev = None
            self._release([s for s in self.running if s.finished])
        launched = self._launch() if self.running else None   # (sizes its attention by prev's pending commits)
        if prev is not None:
            out += self._read(prev)
        self._inflight = launched if self.overlap else None
        if launched is not None and not self.overlap:
            out += self._read(launched)
        self._release([s for s in self.running if s.finished])
        return out

    def _admit(self) -> list[tuple[Sequence, list[int]]]:
        out: list[tuple[Sequence, list[int]]] = []
        rows = self.runner.cache_cfg.max_num_seqs
        free = rows - len(self.running)
        admit = not self.running or free >= min(self.cfg.admit_min, len(self.waiting))
        while admit and self.waiting and len(self.running) < rows:
            group = self._prefill_group(rows - len(self.running))
            first_row = len(self.running)
            for i, seq in enumerate(group):
                seq.row, seq.status = first_row + i, Status.RUNNING
            self.running += group
            t0 = time.perf_counter()
            firsts = self.runner.prefill(first_row, [q.prompt_ids for q in group], [q.params for q in group],
                                         [q.seed for q in group])
            self.stats.prefill_seconds += time.perf_counter() - t0
            out += [(seq, self._emit(seq, [tok])) for seq, tok in zip(group, firsts)]
        return out

    def _pending(self) -> int:
        """Tokens the unread round may have committed per request beyond what the host knows."""
        return self.spec.max_commit if self._inflight is not None else 0

    def _may_overlap(self) -> bool:
        """Whether the next round may launch before the unread one is read: no request may reach
        its max_tokens in the unread round (the next would be wasted on it), nor come so near the
        context's end that the next round, starting up to max_commit tokens later, writes past
        the cache (whose rows hold max_model_len + kv_headroom slots)."""
        c = self.spec.max_commit
        return all(len(s.output_ids) + c < s.params.max_tokens and s.length + c <= self.max_model_len
                   for s in self.running)

    def _launch(self) -> Launched:
        """Launch one round over the running requests (no host sync)."""
        t0 = time.perf_counter()
        mode = SampleMode.of([s.params for s in self.running])
        self.runner.run_round(len(self.running), mode, max(s.length for s in self.running) + self._pending())
        return self._outputs.launch(self.runner.state, list(self.running), t0)

    def _read(self, launched: Launched) -> list[tuple[Sequence, list[int]]]:
        """Wait for a launched round's tokens (its one sync) and emit them. A request that finished
        after the launch (EOS or stop in the round before, abort) drops what this round made."""
        rows = launched.read()
        self.runner.timer.collect()
        now = time.perf_counter()
        self.stats.round_seconds += now - max(launched.t0, self._last_read)   # overlapped rounds counted once
        self._last_read = now
        self.stats.rounds += 1
        out = []
        for seq, row in zip(launched.seqs, rows):
            if seq.finished:
                continue
            k = row[0]
            seq.stats.rounds += 1
            seq.stats.accept_lengths.append(k)
            self.stats.accept_hist[k] += 1
            out.append((seq, self._emit(seq, row[1:1 + k])))
        return out

    def _prefill_group(self, free_rows: int) -> list[Sequence]:
        """Waiting requests for one padded prefill: at most `free_rows`, and at most
        max_prefill_tokens padded tokens (always at least one request)."""
        group = [self.waiting.popleft()]
        longest = len(group[0].prompt_ids)
        while self.waiting and len(group) < free_rows:
            nxt = max(longest, len(self.waiting[0].prompt_ids))
            if nxt * (len(group) + 1) > self.cfg.max_prefill_tokens:
                break
            group.append(self.waiting.popleft())
            longest = nxt
        return group

    def _emit(self, seq: Sequence, tokens: list[int]) -> list[int]:
        # the context bounds the output as max_tokens does (finish reason "length")
        kept = seq.append(tokens, self.eos_ids, self.max_model_len - len(seq.prompt_ids))
        self.stats.generated_tokens += len(kept)
        # Text is kept current every round only when something reads it mid-generation.
        if self.tokenizer is not None and (self.stream_text or seq.params.stop or seq.finished):
            self._detokenize(seq)
        return kept

    def _detokenize(self, seq: Sequence) -> None:
        """Extend seq.text by the new tokens' text: decode a short window ending at the new tokens
        (not the whole output) and hold back a trailing partial character."""
        ids = seq.output_ids
        if ids and ids[-1] in self.eos_ids and not seq.params.ignore_eos:
            ids = ids[:-1]
        prefix, read = seq.detok_offsets
        before = self.tokenizer.decode(ids[prefix:read], skip_special_tokens=True)
        after = self.tokenizer.decode(ids[prefix:], skip_special_tokens=True)
        if len(after) > len(before) and (not after.endswith("\ufffd") or seq.finished):
            old = len(seq.text)
            seq.text += after[len(before):]
            seq.detok_offsets = (max(read, len(ids) - 4), len(ids))
            for stop in seq.params.stop:
                i = seq.text.find(stop, max(0, old - len(stop) + 1))
                if i >= 0:
                    seq.text = seq.text[:i]
                    seq.finish("stop")
                    seq.finish_reason = "stop"   # a stop string in the last tokens outranks the length limit

    def _release(self, done: list[Sequence]) -> None:
        for seq in sorted(done, key=lambda s: -s.row):
            last = self.running[-1]
            if last is not seq:
                self.runner.move_row(last.row, seq.row, last.length)
                self.running[seq.row] = last
                last.row = seq.row
            self.running.pop()
            seq.row = -1


def _load_tokenizer(path: Path):
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))
