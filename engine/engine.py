"""Engine: owns the model thread. submit / abort / stream from any thread; step() is the loop."""

from __future__ import annotations

import asyncio
import logging
import queue as thread_queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import torch

from engine import fused, lean, native, prepack
from engine.batch import RollingBatch, RowKV, SubBatch, row_from_cache
from engine.config import EngineConfig
from engine.decoder import TokenDecoder, fail
from engine.grammar import GrammarCompiler
from engine.job import Job, SeqStatus, Sequence
from engine.loader import LoadedModel, cache_dir, load_model
from engine.outputs import JobDelta, StepStats
from engine.radix_cache import PrefixEntry, RadixPrefixCache
from engine.runner import Chunk, GroupResult, ModelRunner
from engine.sampling_params import SamplingParams, validate_job
from engine.scheduler import PrefillChunk, Scheduler, StepPlan
from engine.step_cost import StepCost
from engine.tensor_parallel import Lockstep, RankGroup

log = logging.getLogger("seqgate.engine")

_END = None  # end-of-stream marker on a handle's queue
_STOP_JOIN_SECONDS = 30  # how long stop() waits for a step in progress


class EngineStopped(RuntimeError):
    """The engine is draining or stopped and admits no new jobs."""


class EngineUnavailable(RuntimeError):
    """The engine that was to run a job is gone (a remote replica died); retrying may succeed."""


class JobHandle:
    """A submitted job's output stream. Iterate with `async for` on the loop that submitted it,
    or with `iter_sync()` from a plain thread."""

    replica: str | None = None  # which engine replica runs the job; None: this process's

    def __init__(self, job_id: str, loop: asyncio.AbstractEventLoop | None):
        self.job_id = job_id
        self._loop = loop
        self._aq: asyncio.Queue | None = asyncio.Queue() if loop is not None else None
        self._tq: thread_queue.Queue | None = None if loop is not None else thread_queue.Queue()

    def _put(self, item: JobDelta | None) -> None:  # engine thread
        if self._aq is not None:
            try:
                self._loop.call_soon_threadsafe(self._aq.put_nowait, item)
            except RuntimeError:  # the client's loop is gone; nobody is listening
                pass
        else:
            self._tq.put(item)

    async def accepted(self) -> None:
        """Wait until the job is queued. Here `submit` has queued it already (a remote engine's
        handle waits for its replica's answer, which may be a refusal)."""

    async def __aiter__(self) -> AsyncIterator[JobDelta]:
        assert self._aq is not None, "submitted outside an event loop: use iter_sync()"
        while (item := await self._aq.get()) is not _END:
            yield item

    def iter_sync(self, timeout: float | None = None) -> Iterator[JobDelta]:
        assert self._tq is not None, "submitted inside an event loop: use async for"
        while (item := self._tq.get(timeout=timeout)) is not _END:
            yield item


@dataclass
class EngineStats:
    """Counters since start, and the last step's stats."""

    queued: int = 0
    running: int = 0
    steps: int = 0
    last_step: StepStats | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cache_hits: int = 0  # prefills that reused a cached prefix
    cache_misses: int = 0  # prefills that found none (with the cache on)
    cached_tokens: int = 0  # prompt tokens whose KV came from the cache
    prefix_cache_bytes: int = 0
    prefix_cache_entries: int = 0  # nodes of the radix tree holding KV
    prefix_cache_evictions: int = 0
    grammars_compiled: int = 0  # grammars built (not found in the compile cache)
    grammar_masked_tokens: int = 0  # tokens chosen under a grammar's mask
    grammar_mask_seconds: float = 0.0  # time spent computing and applying those masks
    kv_bytes: int = 0  # held by the rolling batch's slabs after the last step
    peak_kv_bytes: int = 0  # the most they held after any step
    finished_by_reason: Counter = field(default_factory=Counter)


def new_job(job_id: str, prompt_ids: list[int], params: SamplingParams, strategy: str,
            emit: Callable[[JobDelta | None], None]) -> Job:
    """A job with its `n` sequences, as `Engine.submit` queues it (and every rank, under
    tensor parallelism)."""
    job = Job(job_id=job_id, prompt_ids=list(prompt_ids), params=params, strategy=strategy,
              emit=emit)
    job.seqs = [Sequence(job, i) for i in range(params.n)]
    return job


# Sequences whose prompt and answer go into the prefix cache when they end (not aborted or failed
# ones: a client that gave up is unlikely to send the history back).
_CACHED_ENDINGS = frozenset({SeqStatus.EOS, SeqStatus.STOP_TOKEN, SeqStatus.STOP_STRING,
                             SeqStatus.LENGTH, SeqStatus.GRAMMAR})


class Engine:
    """The seq-scheduler. One thread owns the model and runs `step()` while there is work."""

    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 ranks: RankGroup | None = None):
        self.config = config or EngineConfig()
        # Tensor parallelism: rank 0 starts the other ranks before loading its share.
        if ranks is None and self.config.tensor_parallel_degree > 1:
            ranks = RankGroup.lead(self.config)
        self.ranks = ranks
        self.loaded = loaded or load_model(self.config)
        self.tokenizer = self.loaded.tokenizer
        self.model_name = self.loaded.name
        model_cfg = self.loaded.model.config
        limit = getattr(model_cfg, "max_position_embeddings", None) or 2048
        self.max_model_len = min(self.config.max_model_len or limit, limit)
        self.eos_ids = self._eos_ids()
        self.runner = ModelRunner(self.loaded.model, self.loaded.device,
                                  self.config.tensor_parallel_degree)
        self.fused = self.config.fuse_sub_batches and fused.install(self.loaded.model)
        # Exact (engine.prepack, engine.lean); tensor parallelism's layers go through hooks and
        # keep their own.
        single = self.config.tensor_parallel_degree == 1
        self.prepacked_layers = prepack.install(self.loaded.model) if single else 0
        self.lean_layers = lean.install(self.loaded.model) if single else 0
        kernel = self._decode_kernel()
        self.decode_kernel_layers = fused.use_decode_kernel(self.loaded.model, kernel)
        if kernel is not None and not self.decode_kernel_layers:
            log.info("decode attention kernel: this model's head shape is not one it "
                     "vectorises; using PyTorch's SDPA")
        self.prefix_cache = RadixPrefixCache(self.config.prompt_cache_bytes)
        # Ranks in lock step must plan alike: no costs read from each one's clock.
        self.scheduler = Scheduler(
            self.config, self.prefix_cache,
            self.config.chunk_attention_tokens or self.runner.attention_tokens(),
            StepCost() if ranks is None else None)
        self.batch = RollingBatch()
        self.decoder = TokenDecoder(self.runner.vocab_size, self.loaded.device, self.eos_ids,
                                    self.max_model_len)
        # Request threads compile grammars here (GrammarCompiler.compile), never the engine.
        self.grammars = GrammarCompiler(self.tokenizer, self.runner.vocab_size, self.eos_ids)
        self._stats = EngineStats()
        self._listeners: list[Callable[[StepStats], None]] = []
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._running = False
        self.draining = False
        self._admit_lock = threading.Lock()
        self.lockstep = Lockstep(self) if ranks is not None else None

    def _decode_kernel(self):
        """engine.native's decode-attention kernel where it applies (bf16 on the CPU, one
        process, the packed forward, not turned off) and builds; None: PyTorch's SDPA."""
        if (self.config.decode_attention != "auto" or not self.fused
                or self.config.tensor_parallel_degree != 1
                or self.loaded.device.type != "cpu" or self.runner.dtype != torch.bfloat16):
            return None
        return native.decode_attention_kernel(cache_dir(self.config))

    def _eos_ids(self) -> list[int]:
        ids = set()
        for src in (self.loaded.model.generation_config, self.loaded.model.config):
            eos = getattr(src, "eos_token_id", None)
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)

    # -- public API (any thread) ------------------------------------------------------------
    def start(self, background: bool = True) -> None:
        """Start admitting jobs; with `background`, run the loop in the engine thread.

        Without it the caller drives the engine with `step()` (tests that control timing do).
        """
        if self._running:
            return
        if self.lockstep is not None and not background:
            raise RuntimeError("tensor parallelism needs the engine thread: start(background=True)")
        self._running = True
        if background:
            self._thread = threading.Thread(target=self._loop, name="seqgate-engine", daemon=True)
            self._thread.start()

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop admitting; with `drain`, let running and queued jobs finish first (for up to
        `timeout` seconds). Jobs still unfinished then end with finish reason "abort" (the API
        answers 503 service_unavailable), never silently.

        Only the engine thread touches jobs: if a step is still running when the join gives up,
        the loop ends the remaining jobs itself when that step returns.
        """
        with self._admit_lock:
            self.draining = True
        if drain and self._thread is not None:  # only the engine thread can drain the work
            deadline = None if timeout is None else time.monotonic() + timeout
            while self.scheduler.has_work and (deadline is None or time.monotonic() < deadline):
                time.sleep(0.02)
        self._running = False
        self._wake.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=_STOP_JOIN_SECONDS)
            if thread.is_alive():
                log.warning("an engine step is still running after %ss; it ends the remaining "
                            "jobs when it returns", _STOP_JOIN_SECONDS)
                return
            self._thread = None
        self._end_remaining()

    def _end_remaining(self) -> None:
        """End every queued and running job with "abort" (the engine thread, or no thread)."""
        aborted = self.scheduler.abort_all()
        self.batch.sub_batches = []
        self._publish({job.job_id: job for job in aborted})

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        job_id: str | None = None,
    ) -> JobHandle:
        """Queue a job; its output arrives on the returned handle. Raises QueueFull, InvalidParams,
        ContextLengthExceeded or EngineStopped."""
        strategy = validate_job(prompt_ids, params, self.config, self.runner.vocab_size,
                                self.max_model_len)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        handle = JobHandle(job_id or f"job-{uuid.uuid4().hex}", loop)
        job = new_job(handle.job_id, prompt_ids, params, strategy, handle._put)
        with self._admit_lock:  # stop() cannot slip between this check and the push
            if self.draining or not self._running:
                raise EngineStopped("the engine is not accepting new jobs (draining or stopped)")
            if self.lockstep is not None:  # every rank queues it at the next iteration
                self.lockstep.submit(job)
            else:
                self.scheduler.submit(job)
        self._wake.set()
        return handle

    def abort(self, job_id: str) -> None:
        """Cancel a job; its slot is free at the next step and its stream ends with 'abort'."""
        if self.lockstep is not None:
            self.lockstep.abort(job_id)
        else:
            self.scheduler.request_abort(job_id)
        self._wake.set()

    @property
    def alive(self) -> bool:
        """The engine thread is running (a replica's health check asks)."""
        return self._thread is not None and self._thread.is_alive()

    def add_step_listener(self, fn: Callable[[StepStats], None]) -> None:
        self._listeners.append(fn)

    def stats(self) -> EngineStats:
        s = self._stats
        s.queued = len(self.scheduler.queue)
        s.running = self.scheduler.slots_taken()
        cache = self.prefix_cache  # its own counters: hits and misses per lookup at admission
        s.cache_hits, s.cache_misses, s.cached_tokens = cache.hits, cache.misses, \
            cache.reused_tokens
        s.prefix_cache_bytes = cache.nbytes
        s.prefix_cache_entries = len(cache)
        s.prefix_cache_evictions = cache.evictions
        s.generated_tokens = self.decoder.generated_tokens
        s.grammars_compiled = self.grammars.compiled
        s.grammar_masked_tokens = self.decoder.grammar.masked_tokens
        s.grammar_mask_seconds = self.decoder.grammar.mask_seconds
        return s

    # -- engine thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_num_threads(self.config.threads)
        while self._running:
            try:
                if self.lockstep is not None:  # every rank takes the same jobs and aborts
                    self.lockstep.lead()
                if not self.scheduler.has_work:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self.step()
            except Exception:  # a bug in the step must not kill the server: fail what ran
                if self.lockstep is not None:  # ranks out of step cannot be brought back
                    log.exception("tensor-parallel engine failed; it stops (new jobs refused)")
                    self._fail_all("internal engine error (tensor-parallel ranks out of step)")
                    with self._admit_lock:
                        self.draining = True
                    break
                log.exception("engine step failed; failing the running jobs")
                self._fail_all("internal engine error")
        self._end_remaining()  # stopped: whatever is left ends here, on this thread
        if self.lockstep is not None:
            self.lockstep.stop()

    def follow(self) -> None:
        """A rank other than 0: run rank 0's iterations until it stops (tensor_parallel.py)."""
        torch.set_num_threads(self.config.threads)
        self.lockstep.follow()

    def run_until_idle(self, max_steps: int = 100_000) -> list[StepStats]:
        """Drive the engine from the calling thread until no work is left (tests, benchmarks)."""
        out = []
        while self.scheduler.has_work and len(out) < max_steps:
            out.append(self.step())
        return out

    @torch.inference_mode()
    def step(self) -> StepStats:
        """One iteration: schedule, execute, postprocess, publish.

        The scheduler's plan says who decodes (in which sub-batches) and which prompt chunks are
        computed; the batch is laid out as planned; one forward (or one per group, for models
        without the packed path) runs it; then tokens are chosen, stops applied, finished
        prompts start decoding and the prefix cache takes what ended.
        """
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        touched: dict[str, Job] = {job.job_id: job for job in plan.aborted}
        self._lay_out(plan)
        chunks = [self._chunk_input(c) for c in plan.chunks]
        results = self._execute(self.batch.sub_batches, chunks)
        self._postprocess(plan, results, touched)
        self._publish(touched)
        return self._record(plan, time.perf_counter() - t0)

    def _lay_out(self, plan: StepPlan) -> None:
        """Drop aborted prompts' KV and regroup the batch to the plan's partition; jobs that
        joined bring their prompt's KV as new rows."""
        for job in plan.aborted:
            job.release_prompt()
        if plan.groups is None:
            return
        new_rows: dict[Sequence, RowKV] = {}
        for job in plan.joined:
            row = row_from_cache(job.kv)
            new_rows.update((s, row) for s in job.seqs)
            job.release_prompt()
        self.batch.regroup(plan.groups, new_rows)

    def _chunk_input(self, chunk: PrefillChunk) -> Chunk:
        job = chunk.job
        want_hidden = job.strategy == "contrastive"
        if job.kv is None:  # the first chunk: start from the cached prefix, if any
            job.kv = self.runner.prompt_cache(job.prefix, len(job.prompt_ids))
            if want_hidden and job.prefix is not None:
                job.hidden = [job.prefix.hidden]
            job.prefix = None
        return Chunk(job.kv, job.prompt_ids[chunk.start : chunk.stop], chunk.start, chunk.last,
                     want_hidden)

    def _execute(self, sbs: list[SubBatch], chunks: list[Chunk]) -> list:
        """The step's forward: one packed forward for every group where the model allows (a
        failure there fails every group: caches may be half-written), else one per group (a
        failure fails that group alone). One result, or exception, per sub-batch then chunk."""
        hidden = [any(s.job.strategy == "contrastive" for s in sb.seqs) for sb in sbs]
        if self.fused and len(sbs) + len(chunks) > 1:
            try:
                return self.runner.packed(sbs, chunks, hidden)
            except Exception as exc:
                log.exception("step forward failed")
                return [exc] * (len(sbs) + len(chunks))
        results: list = []
        for work in [*zip(sbs, hidden), *chunks]:
            try:
                if isinstance(work, Chunk):
                    results.append(self.runner.prefill_chunk(work))
                else:
                    results.append(self.runner.decode(*work))
            except Exception as exc:
                log.exception("forward failed")
                results.append(exc)
        return results

    def _postprocess(self, plan: StepPlan, results: list, touched: dict[str, Job]) -> None:
        """Choose each decoding row's next token; advance prompts; start the finished ones."""
        sbs = self.batch.sub_batches
        for job in plan.admitted:
            self._stats.prompt_tokens += len(job.prompt_ids)
        for sb, result in zip(sbs, results):
            touched.update((s.job.job_id, s.job) for s in sb.seqs)
            if isinstance(result, Exception):
                for s in sb.seqs:
                    fail(s, f"forward failed: {result}")
                continue
            self._advance_rows(sb, result)
        for chunk, result in zip(plan.chunks, results[len(sbs):]):
            job = chunk.job
            touched[job.job_id] = job
            if isinstance(result, Exception):
                for s in job.seqs:
                    fail(s, f"prefill failed: {result}")
                job.release_prompt()
                continue
            job.computed = chunk.stop
            if result.hidden is not None:
                job.hidden.append(result.hidden)
            if chunk.last:
                self._start_decoding(job, result.logits)
        self._cache_finished()

    def _advance_rows(self, sb: SubBatch, result: GroupResult) -> None:
        """After a sub-batch's forward: contrastive rows choose among the candidates they fed and
        keep that one's K/V, hidden state and logits; then every row still running chooses (or
        proposes) its next token from its kept logits."""
        slots = self.decoder.pick(sb.seqs, result.hidden, result.first)
        sb.keep_slots(slots)
        kept = (result.first + torch.tensor(slots, device=result.first.device)).tolist()
        for s, at in zip(sb.seqs, kept):
            s.kv_len += 1
            if result.hidden is not None and s.hidden is not None:
                s.hidden = torch.cat([s.hidden, result.hidden[at : at + 1]])
        live = [i for i, s in enumerate(sb.seqs) if not s.status.finished]
        if live:
            rows = [kept[i] for i in live]
            # Every row fed one token and runs on (the usual step): its logits as they are,
            # not a copy of [rows, vocab].
            logits = result.logits if rows == list(range(len(result.logits))) else \
                result.logits[rows]
            self.decoder.choose([sb.seqs[i] for i in live], logits)

    def _start_decoding(self, job: Job, logits: torch.Tensor) -> None:
        """The prompt is done: cache it, set up its sequences, choose their first tokens. They
        join the decode set at the next step."""
        hidden = torch.cat(job.hidden) if job.hidden else None
        if self.config.prompt_cache_bytes:
            row = row_from_cache(job.kv)
            self.prefix_cache.insert(job.prompt_ids,
                                     PrefixEntry(row.keys, row.values, hidden, row.length))
        for s in job.seqs:
            s.start(self.tokenizer, self.loaded.device, hidden)
        n = len(job.seqs)
        self.decoder.choose(job.seqs, logits[None].expand(n, -1))
        if job.done:  # every sequence ended on its first token: it never joins
            job.release_prompt()

    def _cache_finished(self) -> None:
        """Insert every sequence that ended this step normally, its prompt and its answer, into
        the prefix cache (RadixAttention caches finished requests too): a chat client sends the
        answer back as history in its next turn. Its KV is still in the batch until the next
        step's regroup drops the row."""
        if not self.config.prompt_cache_bytes:
            return
        for sb in self.batch.sub_batches:
            for i, s in enumerate(sb.seqs):
                if s.status not in _CACHED_ENDINGS or s.kv_len <= len(s.job.prompt_ids):
                    continue
                ids = (s.job.prompt_ids + s.generated)[: s.kv_len]
                hidden = s.hidden if s.hidden is not None and len(s.hidden) == s.kv_len else None
                row = sb.row(i)
                self.prefix_cache.insert(ids, PrefixEntry(row.keys, row.values, hidden,
                                                          row.length))

    def _fail_all(self, message: str) -> None:
        touched = {}
        prefilling = [s for job in self.scheduler.prefilling for s in job.seqs]
        for s in self.scheduler.running + prefilling:
            fail(s, message)
            touched[s.job.job_id] = s.job
        for job in self.scheduler.prefilling:
            job.release_prompt()
        self.scheduler.running, self.scheduler.prefilling, self.scheduler.layout = [], [], []
        self.batch.sub_batches = []
        self._publish(touched)

    def _publish(self, touched: dict[str, Job]) -> None:
        for job in touched.values():
            if job.closed:
                continue
            for s in job.seqs:
                if s.final_sent:
                    continue
                if s.status.finished:
                    s.final_sent = True
                    self._stats.finished_by_reason[s.status.finish_reason] += 1
                    job.emit(s.take_delta())
                elif s.out_tokens:
                    job.emit(s.take_delta())
            if job.done:
                job.closed = True
                job.emit(_END)

    def _record(self, plan: StepPlan, seconds: float) -> StepStats:
        sbs = self.batch.sub_batches
        real = sum(sum(sb.lengths()) for sb in sbs)
        padded = self.batch.padded_tokens()
        stats = StepStats(
            step=plan.step,
            running=self.scheduler.slots_taken(),
            queued=len(self.scheduler.queue),
            admitted=len(plan.admitted),
            finished=sum(1 for sb in sbs for s in sb.seqs if s.status.finished),
            sub_batches=len(sbs),
            sub_batch_sizes=[sb.size for sb in sbs],
            sparsity=padded / real if real else 0.0,
            padded_tokens=padded,
            kv_bytes=self.batch.kv_bytes(),
            regrouped=plan.groups is not None,
            decode_rows=plan.decode_rows,
            prefill_tokens=plan.prefill_tokens,
            prefill_chunks=len(plan.chunks),
            cached_prompt_tokens=sum(j.cached_tokens for j in plan.admitted),
            seconds=seconds,
            abort_free_steps=plan.abort_delays,
        )
        # Steps that laid the batch out anew carry a cost of their own (copies of KV) that
        # neither rows nor prompt units explain.
        if self.scheduler.cost is not None and plan.groups is None:
            self.scheduler.cost.observe(plan.decode_rows, plan.prefill_units, seconds)
        self._stats.steps = plan.step
        self._stats.last_step = stats
        self._stats.kv_bytes = stats.kv_bytes
        self._stats.peak_kv_bytes = max(self._stats.peak_kv_bytes, stats.kv_bytes)
        for fn in self._listeners:
            try:
                fn(stats)
            except Exception:
                log.exception("step listener failed")
        return stats
