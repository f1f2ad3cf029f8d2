"""EngineCore: one engine step, schedule → lay out → execute → choose tokens → publish.

It owns the model's state (the runner, the rolling batch, the prefix cache, token choice) and is
driven by one thread at a time: the service's engine thread (engine.core.service), a tensor-
parallel follower, or a test that calls `step()` itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from engine.config import EngineConfig
from engine.core.handle import END
from engine.core.recorder import StepRecorder
from engine.core.sizing import Ranks, kv_budget, resolved, warm_up
from engine.errors import out_of_memory
from engine.kv.batch import SubBatch
from engine.kv.radix_cache import RadixPrefixCache
from engine.kv.rolling_batch import RollingBatch
from engine.kv.slabs import rewind
from engine.model.loader import LoadedModel
from engine.model.prepare import prepare
from engine.model.runner import Chunk, ModelRunner
from engine.outputs import EngineStats, StepStats
from engine.request.job import Job
from engine.sample.decoder import TokenDecoder, fail
from engine.sample.draft_model import DraftModel
from engine.sample.grammar import GrammarCompiler
from engine.sample.sampling import logprobs_for
from engine.sample.speculative import Speculator
from engine.sched.caching import CachePolicy
from engine.sched.plan import StepPlan
from engine.sched.preemption import lost_rows, victims
from engine.sched.scheduler import ALONE_TOKENS, Scheduler
from engine.sched.step_cost import StepCost

log = logging.getLogger("seqgate.engine")


class EngineCore:
    """The seq-scheduler's step over a loaded model (see the module docstring)."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel,
                 ranks: Ranks | None = None):
        self.config = config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        limit = getattr(loaded.model.config, "max_position_embeddings", None) or 2048
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.eos_ids = loaded.eos_ids()
        self.runner = ModelRunner(loaded.model, loaded.device, config.tensor_parallel_degree)
        prepared = prepare(loaded, config)
        self.kv_dtype = prepared.kv_dtype
        self.runner.keep_kv_in(self.kv_dtype)
        # Before the KV budget, which is what the device leaves once its weights are loaded too.
        draft_model = DraftModel.load(config, loaded, self.runner.vocab_size)
        self.packed_forward = prepared.packed_forward
        self.prepacked_layers = prepared.prepacked_layers
        self.lean_layers = prepared.lean_layers
        self.decode_kernel_layers = prepared.decode_kernel_layers
        # Paths and rows chosen on this host.
        self.linear_blocks, self.int8_layers, self.native_layers = (prepared.lowbit,
                                                                    prepared.w8a8, prepared.native)
        # Ranks in lock step cannot each undo a step alone: out of memory fails them all.
        self._lockstep = ranks is not None
        longest = min(max(config.token_budget, ALONE_TOKENS), self.max_model_len)
        self.kv_budget = kv_budget(config, loaded, self.kv_dtype, ranks, lambda: warm_up(
            self.runner, longest, self.eos_ids[0] if self.eos_ids else 0, loaded.device))
        self.config = config = resolved(config, self.kv_budget, loaded.device)
        # Set up after the KV budget's warm-up: graph memory is taken beside the budget, when
        # a bucket is first captured (engine/model/cuda_graphs.py).
        self.cuda_graphs = (loaded.device.type == "cuda" and not config.enforce_eager
                            and self.packed_forward and not self._lockstep
                            and self.runner.use_graphs(config.max_cudagraph_capture_size))
        self.prefix_cache = RadixPrefixCache(
            config.prompt_cache_bytes if self.kv_budget is None else self.kv_budget.prefix_cache)
        self.caching = CachePolicy(self.prefix_cache)
        # Ranks in lock step must plan alike: no costs read from each one's clock.
        self.scheduler = Scheduler(
            config, self.prefix_cache,
            config.chunk_attention_tokens or self.runner.attention_tokens(),
            StepCost() if ranks is None else None, self.kv_budget)
        self.batch = RollingBatch()
        self.speculator = Speculator(config, self.max_model_len, draft_model)
        self.decoder = TokenDecoder(self.runner.vocab_size, loaded.device, self.eos_ids,
                                    self.max_model_len, self.speculator)
        # Request threads compile grammars here, never the engine; they judge a mask against what
        # a decode step costs lately (a moving average over decode-only steps).
        self.decode_step_seconds = 0.0
        self.grammars = GrammarCompiler(self.tokenizer, self.runner.vocab_size, self.eos_ids,
                                        step_seconds=lambda: self.decode_step_seconds)
        self.recorder = StepRecorder()

    def add_step_listener(self, fn: Callable[[StepStats], None]) -> None:
        self.recorder.listeners.append(fn)

    def stats(self) -> EngineStats:
        s = self.recorder.totals
        s.queued = len(self.scheduler.queue)
        s.running = self.scheduler.slots_taken()
        c = self.prefix_cache  # its own counters: hits and misses per lookup at admission
        s.cache_hits, s.cache_misses, s.cached_tokens = c.hits, c.misses, c.reused_tokens
        s.prefix_cache_bytes = c.nbytes
        s.prefix_cache_entries = len(c)
        s.prefix_cache_evictions = c.evictions
        s.prefix_cache_capacity_bytes = c.capacity_bytes
        s.kv_budget_bytes = self.kv_budget.batch if self.kv_budget is not None else 0
        s.generated_tokens = self.decoder.generated_tokens
        s.grammars_compiled = self.grammars.compiled
        s.grammar_masked_tokens = self.decoder.grammar.masked_tokens
        s.grammar_mask_seconds = self.decoder.grammar.mask_seconds
        s.spec_proposed_tokens = self.speculator.proposed
        s.spec_accepted_tokens = self.speculator.accepted
        return s

    def check_when_idle(self) -> None:
        """Check the prefix cache's bookkeeping (cheap next to a step, run when there is no
        work); a tree that fails the check is emptied rather than served from."""
        try:
            self.prefix_cache.check_integrity()
        except AssertionError:
            log.exception("the prefix cache failed its integrity check; emptying it")
            self.prefix_cache.clear()

    def run_until_idle(self, max_steps: int = 100_000) -> list[StepStats]:
        """Drive the engine from the calling thread until no work is left (tests, benchmarks)."""
        out = []
        while self.scheduler.has_work and len(out) < max_steps:
            out.append(self.step())
        return out

    @torch.inference_mode()
    def step(self) -> StepStats:
        """One iteration: the scheduler's plan (who decodes in which sub-batches, which prompt
        chunks run), laid out by the runner, one forward (or one per group without the packed
        path); then tokens are chosen, finished prompts start decoding, the prefix cache takes
        what ended, and the changes are published."""
        t0 = time.perf_counter()
        captures = self.runner.graph_captures()
        plan = self.scheduler.schedule()
        changed: dict[str, Job] = {job.job_id: job for job in plan.aborted}
        self.speculator.draft(self.scheduler.running)
        try:
            chunks = self.runner.prepare_inputs(plan, self.batch)
        except Exception as exc:
            if self._lockstep or not out_of_memory(exc):
                raise
            held = (s for sb in self.batch.sub_batches for s in sb.seqs)
            self._survive_out_of_memory(plan, exc, lost_rows(plan.joined, held), changed)
        else:
            sbs = self.batch.sub_batches
            results = self._execute(sbs, chunks)
            failed = [i for i, r in enumerate(results) if self._undoable(r)]
            # The step's other work stands; a failed group's is done again next step, from the
            # columns it held before: a sub-batch's window, a chunk's start.
            held = [sb.width for sb in sbs] + [ch.start for ch in chunks]
            for i in failed:
                rewind([*sbs, *chunks][i].cache, held[i])
            self._postprocess(plan, results, changed)
            if failed:
                self._survive_out_of_memory(plan, results[failed[0]], [], changed)
        self._publish(changed)
        seconds = time.perf_counter() - t0
        # A step that captured CUDA graphs paid a one-off cost that its rows and prompt units do
        # not explain: nothing learns from its time.
        typical = self.runner.graph_captures() == captures
        self.scheduler.update_from_step(plan, seconds, learn=typical)
        if typical and plan.decode_rows and plan.groups is None and not (plan.chunks
                                                                          or plan.out_of_memory):
            last = self.decode_step_seconds
            self.decode_step_seconds = 0.9 * last + 0.1 * seconds if last else seconds
            self.speculator.step_done(plan.decode_rows, seconds)
        return self.recorder.record(plan, self.batch, self.scheduler, seconds)

    def _execute(self, sbs: list[SubBatch], chunks: list[Chunk]) -> list:
        """The step's forward: one packed forward for every group where the model allows (a
        failure there fails every group: caches may be half-written), else one per group (a
        failure fails that group alone). One result, or exception, per sub-batch then chunk."""
        hidden = [any(s.job.strategy == "contrastive" for s in sb.seqs) for sb in sbs]
        # One group alone runs packed too where the graphs would take it.
        groups = len(sbs) + len(chunks)
        alone = groups == 1 and self.runner.graphs_take(sbs, chunks)
        if self.packed_forward and (groups > 1 or alone):
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

    def _postprocess(self, plan: StepPlan, results: list, changed: dict[str, Job]) -> None:
        """Choose each decoding row's next token; advance prompts; start the finished ones."""
        sbs = self.batch.sub_batches
        for job in plan.admitted:
            if not job.preemptions:
                self.recorder.totals.prompt_tokens += len(job.prompt_ids)
        ran = []
        for sb, result in zip(sbs, results):
            changed.update((s.job.job_id, s.job) for s in sb.seqs)
            if self._undoable(result):
                continue
            if isinstance(result, Exception):
                for s in sb.seqs:
                    fail(s, f"forward failed: {result}")
                continue
            ran.append((sb, result))
        self.decoder.advance(ran)
        for chunk, result in zip(plan.chunks, results[len(sbs):]):
            job = chunk.job
            changed[job.job_id] = job
            if self._undoable(result):
                continue
            if isinstance(result, Exception):
                for s in job.seqs:
                    fail(s, f"prefill failed: {result}")
                job.release_prompt()
                continue
            job.computed = chunk.stop
            if result.prompt_logits is not None:  # the prompt's log-probabilities, asked
                targets = job.fill_ids[chunk.start + 1 : chunk.stop + 1]
                job.prompt_logprobs += logprobs_for(result.prompt_logits, targets, [
                    job.params.prompt_logprobs] * len(targets), ranks=True)
            if result.hidden is not None:
                job.hidden.append(result.hidden)
            if chunk.last:
                self._start_decoding(job, result.logits)
        self.caching.step_done(sbs)

    def _start_decoding(self, job: Job, logits: torch.Tensor) -> None:
        """The prompt is done: cache it, start its sequences (decoding from the next step)."""
        hidden = torch.cat(job.hidden) if job.hidden else None
        self.caching.prompt_done(job, hidden)
        if job.decoding:  # resumed after a preemption: its rows' next tokens are chosen
            for s in job.seqs:
                s.kv_len = len(job.fill_ids)
            return
        for s in job.seqs:
            s.start(self.tokenizer, self.loaded.device, hidden)
        self.decoder.choose(job.seqs, logits[None].expand(len(job.seqs), -1))
        if job.done:  # every sequence ended on its first token: it never joins
            job.release_prompt()

    def _undoable(self, result) -> bool:
        """Whether a group's result is an allocation failure this step survives by undoing it."""
        return isinstance(result, Exception) and not self._lockstep and out_of_memory(result)

    def _survive_out_of_memory(self, plan: StepPlan, exc: Exception, lost: list[Job],
                               changed: dict[str, Job]) -> None:
        """After an allocation failure, the step's failed work undone: the jobs that lost their
        KV, else the newest job that can be recomputed, go back to the queue with their output
        so far kept (engine.sched.preemption); where none can, the newest job fails."""
        plan.out_of_memory = True
        self.recorder.totals.out_of_memory_steps += 1
        cache = self.prefix_cache
        preempted, failed, clear_cache = victims(self.scheduler.jobs_by_age(), lost,
                                                 cache.nbytes if cache is not None else 0)
        if clear_cache:
            log.warning("out of memory: the prefix cache's %d bytes are freed", cache.nbytes)
            cache.clear()
        for job in preempted:
            log.warning("out of memory (%s): job %s goes back to the queue", exc, job.job_id)
            self.scheduler.preempt(job)
        for job in failed:
            log.warning("job %s does not fit in memory: it fails (%s)", job.job_id, exc)
            for s in job.seqs:
                fail(s, "out of memory: the request does not fit on this device beside the "
                        "running ones; retry with fewer tokens (prompt or max_tokens)")
            job.release_prompt()
        self.recorder.totals.preemptions += len(preempted)
        changed.update((job.job_id, job) for job in preempted + failed)
        self.scheduler.out_of_memory()
        if self.loaded.device.type == "cuda":
            torch.cuda.empty_cache()  # the failed step's blocks, for the next step to reuse

    def fail_all(self, message: str) -> None:
        """Fail every prefilling and running job (a step failed and left their state unknown)."""
        jobs = self.scheduler.fail_all()
        for job in jobs:
            for s in job.seqs:
                fail(s, message)
            job.release_prompt()
        self.batch.clear()
        self._publish({job.job_id: job for job in jobs})

    def end_remaining(self) -> None:
        """End every queued and running job with "abort" (on the thread that steps)."""
        aborted = self.scheduler.abort_all()
        self.batch.clear()
        self._publish({job.job_id: job for job in aborted})

    def _publish(self, changed: dict[str, Job]) -> None:
        for job in changed.values():
            if job.closed:
                continue
            for s in job.seqs:
                if s.final_sent:
                    continue
                if s.status.finished:
                    s.final_sent = True
                    self.recorder.totals.finished_by_reason[s.status.finish_reason] += 1
                    job.emit(s.take_delta())
                elif s.out_tokens:
                    job.emit(s.take_delta())
            if job.done:
                job.closed = True
                job.emit(END)
