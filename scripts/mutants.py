"""Named mutants of the course's central logic, each of which the unit tests must kill.

A mutant is one deliberate bug: an exact snippet of a package file replaced by a wrong one (a peak that takes the
second-highest sample, an allocator that never reuses a cached block, a closed form that drops a term), or of a
delivery file (``folder=""``: README, pyproject, the learner copies' and the site's scripts). For each
mutant this script copies the package and the tests to a temporary folder, applies the mutant there (the working
tree is never touched), runs the unit tests the mutant names with ``pytest -x -q`` on one thread, and says whether
they failed (killed: good) or passed (survived: a hole in the tests). It prints a table and the score, and exits
non-zero if any mutant survived or if a mutant's snippet is not found exactly once in the current source (the list
is kept up to date with the code: ``tests/test_mutants.py`` checks the snippets on every test run).

    python scripts/mutants.py              # every mutant (a few minutes)
    python scripts/mutants.py --list       # the names, files and tests, nothing run
    python scripts/mutants.py --only trace.peak-second-highest --only alloc.round-to-256
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = "anatomy_helpers"


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to ``folder``
    original: str  # must occur exactly once in the file
    replacement: str
    tests: tuple[str, ...]  # pytest arguments (files or node ids) that must fail with the mutant in place
    folder: str = PKG  # "": the repository root (a delivery file)

    @property
    def path(self) -> str:
        return f"{self.folder}/{self.file}" if self.folder else self.file


TRACE, ALLOC, EST = "tracking/trace.py", "prediction/allocator.py", "prediction/estimate.py"
KEPT = "prediction/kept.py"
T_TRACE = ("tests/test_trace_oracles.py",)
T_ALLOC = ("tests/test_allocator.py",)
T_EST = ("tests/test_estimate.py::test_block_terms_name_the_big_tensors_by_hand", "tests/test_closed_form_oracles.py")
T_CKPT = ("tests/test_checkpointing.py",)
T_GQA = "tests/test_tensor_parallel.py::test_the_gqa_qkv_rank_order_gives_each_rank_its_heads"

MUTANTS = [
    # ---- the trace: peaks, phase peaks, windows, moments
    Mutant(
        "trace.peak-second-highest",
        TRACE,
        "return self._peak_at(int(idx[np.argmax(self.timeline.total[idx])]))",
        'return self._peak_at(int(idx[np.argsort(self.timeline.total[idx], kind="stable")[-min(2, len(idx))]]))',
        T_TRACE,
    ),
    Mutant("trace.phase-peak-ignores-moment-before", TRACE, "first = max(start - 1, 0)", "first = start", T_TRACE),
    Mutant(
        "trace.window-phase-or-later",
        TRACE,
        "mask &= self.timeline.phase == PHASES.index(phase)",
        "mask &= self.timeline.phase >= PHASES.index(phase)",
        T_TRACE,
    ),
    Mutant(
        "trace.phase-run-ends-one-late",
        TRACE,
        "ends = np.r_[starts[1:] - 1, len(tl) - 1]",
        "ends = np.r_[starts[1:], len(tl) - 1]",
        T_TRACE,
    ),
    Mutant(
        "trace.optimizer-phase-ignores-moment-before",
        TRACE,
        "if totals.max() > sum(before.values()) else",
        "if True else",
        T_TRACE,
    ),
    Mutant(
        "trace.alive-at-one-sample-early",
        TRACE,
        "np.add.at(alive, self.alloc_ids[: index + 1], self.alloc_deltas[: index + 1])",
        "np.add.at(alive, self.alloc_ids[:index], self.alloc_deltas[:index])",
        T_TRACE,
    ),
    # ---- the caching-allocator simulator: rounding, pools, splitting, reuse, merging, the cap
    Mutant(
        "alloc.round-to-256",
        ALLOC,
        "return max(MIN_BLOCK, round_up(nbytes, MIN_BLOCK))",
        "return max(MIN_BLOCK, round_up(nbytes, 256))",
        T_ALLOC,
    ),
    Mutant(
        "alloc.1MiB-goes-to-large-pool",
        ALLOC,
        'pool = "small" if size <= SMALL_REQUEST else "large"',
        'pool = "small" if size < SMALL_REQUEST else "large"',
        T_ALLOC,
    ),
    Mutant(
        "alloc.large-remainder-of-1MiB-split",
        ALLOC,
        "(remaining > SMALL_REQUEST)",
        "(remaining >= SMALL_REQUEST)",
        T_ALLOC,
    ),
    Mutant(
        "alloc.10MiB-shares-a-20MiB-segment",
        ALLOC,
        "if rounded < MIN_LARGE_ALLOC:",
        "if rounded <= MIN_LARGE_ALLOC:",
        T_ALLOC,
    ),
    Mutant(
        "alloc.cached-blocks-never-reused",
        ALLOC,
        "i = bisect_left(free, (size, -1, -1))",
        "i = len(free)",
        T_ALLOC,
    ),
    Mutant(
        "alloc.no-merge-with-previous-block",
        ALLOC,
        "if i > 0 and blocks[i - 1].free:",
        "if False:",
        T_ALLOC,
    ),
    Mutant(
        "alloc.allocated-counts-request-not-block",
        ALLOC,
        "self.allocated += block.size  # the whole block",
        "self.allocated += size  # the whole block",
        T_ALLOC,
    ),
    Mutant(
        "alloc.cap-without-cache-flush",
        ALLOC,
        "            self.empty_cache()\n            self.cache_flushes += 1",
        "            self.cache_flushes += 1",
        T_ALLOC,
    ),
    # ---- the closed form and the textbook formulas
    Mutant(
        "estimate.out-proj-input-dropped",
        KEPT,
        'terms["attn.proj"] = 0 if fused and not y_copied else N * h * e',
        'terms["attn.proj"] = 0',
        T_EST,
    ),
    Mutant(
        "estimate.dropout-noise-halved",
        KEPT,
        'attn_noise = scores * e if dropout and cfg.attn_impl == "manual" else 0',
        'attn_noise = scores * e // 2 if dropout and cfg.attn_impl == "manual" else 0',
        T_EST,
    ),
    Mutant(
        "estimate.one-head-reshapes-copy",
        KEPT,
        "    return b == 1 or cfg.n_head == 1",
        "    return b == 1",
        ("tests/test_estimate.py::test_each_block_term_equals_what_its_module_saved",),
    ),
    Mutant(
        "estimate.flash-at-head-width-2",
        KEPT,
        '    return cfg.attn_impl == "sdpa" and (cfg.dropout > 0 or narrow)',
        '    return cfg.attn_impl == "sdpa" and cfg.dropout > 0',
        ("tests/test_estimate.py::test_each_block_term_equals_what_its_module_saved",),
    ),
    Mutant(
        "estimate.tied-sum-dropped",
        EST,
        'moments["embedding"] = G + (V * h * e + max(grad_out, V * h * e) if tied else grad_out)',
        'moments["embedding"] = G + (max(grad_out, V * h * e) if tied else grad_out)',
        T_EST,
    ),
    Mutant(
        "estimate.lm-head-moment-dropped",
        EST,
        'moments["LM head"] = activation_bytes(cfg, b) - 4 - N * V * 4 + N * V * e + V * h * e + N * h * e',
        'moments["LM head"] = 0',
        ("tests/test_estimate.py::test_the_property_tests_misses_equal_the_dry_run",),
    ),
    Mutant(
        "estimate.mlp-input-backward-dropped",
        EST,
        'inside["fc"] = recomputed + _mlp_input_backward(cfg, b)',
        'inside["fc"] = 0',
        ("tests/test_estimate.py::test_the_property_tests_misses_equal_the_dry_run",),
    ),
    Mutant(
        "estimate.recomputed-grouped-v-copied",
        EST,
        "kept = v_saved if (head_views(cfg, b) or grouped) and core_elt(cfg) == e else 0",
        "kept = v_saved if head_views(cfg, b) and core_elt(cfg) == e else 0",
        ("tests/test_estimate.py::test_the_property_tests_misses_equal_the_dry_run",),
    ),
    Mutant(
        "estimate.adam-step-counters-dropped",
        EST,
        "return 2 * n * elt(cfg) + 4 * n_param_tensors(cfg)",
        "return 2 * n * elt(cfg)",
        ("tests/test_estimate.py::test_model_states_by_hand",),
    ),
    Mutant(
        "estimate.for-loop-adam-forgets-previous-denom",
        EST,
        "return max(prev + 2 * n for prev, n in zip([0] + sizes, sizes)) * elt(cfg)",
        "return max(2 * n for n in sizes) * elt(cfg)",
        T_EST,
    ),
    Mutant(
        "formulas.korthikanti-5as-becomes-4as",
        "prediction/formulas.py",
        "return 34 * s * b * h + 5 * a * s * s * b",
        "return 34 * s * b * h + 4 * a * s * s * b",
        ("tests/test_estimate.py::test_textbook_estimates_by_hand",),
    ),
    Mutant(
        "saved.every-view-counted",
        "prediction/saved.py",
        "out.append(SavedRow(**vars(r), first=j == i, same_as=j))",
        "out.append(SavedRow(**vars(r), first=True, same_as=j))",
        ("tests/test_saved.py::test_saved_rows_mark_each_storages_first_saver",),
    ),
    Mutant(
        "saved.blocks-counted-not-numbered",
        "prediction/saved.py",
        'n_layer = max((int(k.split(".")[1]) + 1 for k in out if k.startswith("blocks.")), default=0)',
        'n_layer = len([k for k in out if k.startswith("blocks.")])',
        ("tests/test_saved.py::test_activations_by_part_is_in_forward_order_whatever_the_rows_order",),
    ),
    # ---- will it fit, and the snapshot of the simulated allocator
    Mutant(
        "fit.peak-is-the-smallest-phase",
        "prediction/fit_report.py",
        "return max(self.phases, key=lambda p: p.tensors)",
        "return min(self.phases, key=lambda p: p.tensors)",
        ("tests/test_prediction.py::test_fit_report_by_hand",),
    ),
    Mutant(
        "devices.fit-uses-the-highest-total-a-process-was-seen-with",
        "prediction/devices.py",
        "return self.process_mib[0] * MiB",
        "return self.process_mib[-1] * MiB",
        ("tests/test_prediction.py::test_devices_carry_both_totals_and_a_fit_uses_what_a_process_sees",),
    ),
    Mutant(
        "sdpa_rules.flash-gap-leaves-out-224",
        "prediction/sdpa_rules.py",
        "if low < d <= high or (d > high and dropout):",
        "if low < d < high or (d > high and dropout):",
        ("tests/test_cuda_rules.py::test_flash_head_dim_caps_and_the_sm86_to_sm89_training_gap",),
    ),
    Mutant(
        "fit.never-too-close-to-call",
        "prediction/fit.py",
        "return oom, (other is None) != (oom is None)",
        "return oom, False",
        ("tests/test_prediction.py::test_too_close_to_call_is_an_answer_that_turns_within_the_allowance",),
    ),
    Mutant(
        "ranks.zero1-optimizer-over-every-parameter",
        "distributed/ranks.py",
        "        if not zero1:\n            return cls(trains, **kw)",
        "        if True:\n            return cls(trains, **kw)",
        ("tests/test_hf_fit.py::test_a_hf_rank_holds_the_sharded_model_states_of_each_zero_stage",),
    ),
    Mutant(
        "hf_fit.fit-checked-against-the-whole-device",
        "prediction/fit.py",
        "limit = dev.usable - (max(0, int(series.sum(axis=1).max())) if series is not None else 0)",
        "limit = dev.total - (max(0, int(series.sum(axis=1).max())) if series is not None else 0)",
        ("tests/test_hf_fit.py::test_the_report_holds_the_dry_runs_peaks_and_its_verdict_follows_the_device",),
    ),
    Mutant(
        "hf_fixes.every-layer-counted-as-the-first",
        "prediction/hf_fixes.py",
        "return f1 + (cfg.num_hidden_layers - 1) * (f2 - f1)",
        "return cfg.num_hidden_layers * f1",
        ("tests/test_hf_fit.py::test_the_flop_count_from_one_and_two_layers_is_the_whole_models",),
    ),
    Mutant(
        "snapshot.blocks-at-their-segments-start",
        "prediction/snapshot.py",
        "        addr = self.address[b.segment.id] + b.offset\n",
        "        addr = self.address[b.segment.id]\n",
        ("tests/test_snapshot.py",),
    ),
    # ---- activation checkpointing
    Mutant(
        "checkpoint.selective-saves-nothing",
        "core/checkpointing.py",
        "    return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else",
        "    return CheckpointPolicy.PREFER_RECOMPUTE if func in SAVED_OPS else",
        T_CKPT,
    ),
    Mutant(
        "checkpoint.selective-announces-nothing",
        "core/checkpointing.py",
        "        if func in SAVED_OPS:",
        "        if func is None:",
        T_CKPT,
    ),
    Mutant(
        "checkpoint.every-k-segments-of-one-block",
        "core/checkpointing.py",
        'size = 1 if policy == "full" else every',
        "size = 1",
        T_CKPT,
    ),
    # ---- the dry run: fake parameters, fake kernels checked against real ones
    Mutant(
        "dryrun.shared-storages-made-twice",
        "prediction/dryrun.py",
        "if key in storages:  # a view of a storage already made",
        "if False:  # a view of a storage already made",
        ("tests/test_dryrun_modules.py::test_tied_weights_and_shared_buffers_equal_their_real_run",),
    ),
    Mutant(
        "fake_check.differences-ignored",
        "prediction/fake_check.py",
        "if error is None and real == call.outcome:",
        "if error is None:",
        ("tests/test_dryrun_modules.py::test_an_op_whose_fake_kernel_differs_is_refused_by_name",),
    ),
    # ---- distributed: the ZeRO formulas
    Mutant(
        "formulas.zero1-shards-gradients",
        "prediction/formulas.py",
        '"gradients": n_params * grad_bytes / (n if stage >= 2 else 1)',
        '"gradients": n_params * grad_bytes / (n if stage >= 1 else 1)',
        ("tests/test_closed_form_oracles.py",),
    ),
    Mutant(
        "formulas.zero3-keeps-whole-parameters",
        "prediction/formulas.py",
        '"parameters": n_params * param_bytes / (n if stage >= 3 else 1)',
        '"parameters": n_params * param_bytes / (n if stage > 3 else 1)',
        ("tests/test_closed_form_oracles.py",),
    ),
    Mutant(
        "world.rank-row-communication-low",
        "distributed/world.py",
        'communication_peak=int(result.trace.timeline.category("communication").max()),',
        'communication_peak=int(result.trace.timeline.category("communication").min()),',
        ("tests/test_closed_form_oracles.py",),
    ),
    # ---- the tracker's categories (at most a few: that code is being reworked)
    Mutant(
        "tracker.buffers-not-parameters",
        "tracking/tracker.py",
        "            self.mark(b, PARAMETERS, self._code(",
        "            self.mark(b, TEMPORARIES, self._code(",
        ("tests/test_tracker_categories.py",),
    ),
    Mutant(
        "recorder.held-frees-in-hash-order",
        "tracking/recorder.py",
        "            for alloc_id, cdata in sorted(held):",
        "            for alloc_id, cdata in held:",
        ("tests/test_recorder.py::test_frees_at_one_moment_are_recorded_oldest_allocation_first",),
    ),
    Mutant(
        "events.precedence-reversed",
        "tracking/events.py",
        "    return min(current, other, key=CATEGORY_PRECEDENCE.index)",
        "    return max(current, other, key=CATEGORY_PRECEDENCE.index)",
        ("tests/test_recorder.py",),
    ),
    # ---- the one training step and the ranks that run it
    Mutant(
        "step.micro-batch-loss-not-divided",
        "training/step.py",
        "plan.loss(model, part) if k == 1 else plan.loss(model, part) / k",
        "plan.loss(model, part)",
        ("tests/test_step.py", "tests/test_accumulation.py"),
    ),
    Mutant(
        "step.hf-micro-batch-loss-not-divided",
        "training/step.py",
        "plan.loss(model, part) if k == 1 else plan.loss(model, part) / k",
        "plan.loss(model, part)",
        ("tests/test_hf.py::test_micro_batches_of_a_hugging_face_step_average_their_gradients",),
    ),
    Mutant(
        "step.every-rank-trains-rank-0s-rows",
        "training/step.py",
        "t[plan.rank * local : (plan.rank + 1) * local].clone()",
        "t[0:local].clone()",
        ("tests/test_step.py",),
    ),
    Mutant(
        "ranks.fsdp-gradients-not-marked",
        "distributed/ranks.py",
        "                    self.mark(p.grad, GRADIENTS)",
        "                    pass",
        ("tests/test_recorder.py", "tests/test_distributed.py"),
    ),
    Mutant(
        "ranks.collective-arguments-not-communication",
        "distributed/ranks.py",
        "                self.mark(t, COMMUNICATION)\n        outs",
        "                pass\n        outs",
        ("tests/test_recorder.py", "tests/test_distributed.py"),
    ),
    Mutant(
        "events.communication-beats-gradients",
        "tracking/events.py",
        '    "gradients",\n    "communication",\n',
        '    "communication",\n    "gradients",\n',
        ("tests/test_recorder.py",),
    ),
    Mutant(
        "ranks.watched-resize-lost",
        "distributed/ranks.py",
        "                    self.resize(allocation, nbytes)",
        "                    pass",
        ("tests/test_recorder.py",),
    ),
    Mutant(
        "events.loss-outside-the-head",
        "tracking/events.py",
        '_HEAD_MODULES = ("ln_f", "lm_head", ROOT)',
        '_HEAD_MODULES = ("ln_f", "lm_head")',
        ("tests/test_trace.py::test_model_part_names_the_parts_in_forward_order",),
    ),
    # ---- lesson 10's levers: the chunked loss recomputes its chunk's logits; the step in backward frees each gradient
    Mutant(
        "model.chunked-loss-keeps-the-logits",
        "core/model.py",
        "part = checkpoint(_chunk_loss, xs, weight, ts, use_reentrant=False)",
        "part = _chunk_loss(xs, weight, ts)",
        ("tests/test_levers.py::test_loss_chunk_trains_the_same_parameters_and_never_holds_the_logits",),
    ),
    Mutant(
        "step.in-backward-keeps-each-gradient",
        "training/step.py",
        "p.grad = None  # this gradient dies now, before backward computes the next one",
        "pass",
        ("tests/test_levers.py::test_in_backward_never_holds_every_gradient_at_once",),
    ),
    # ---- a real gloo rank frees in program order (gloo_release.py)
    Mutant(
        "gloo_release.caller-goes-on-while-gloo-holds-the-tensors",
        "distributed/gloo_release.py",
        "    _wait_released(aliases, before)\n",
        "    pass\n",
        ("tests/test_gloo_release.py",),
    ),
    # ---- a fake rank of an N-rank world (fake_world.py)
    Mutant(
        "fake_world.batch-half-the-context",
        "distributed/fake_world.py",
        "lambda: GPT(cfg), lambda step: course_batch(job.batch_size, cfg.seq_len)",
        "lambda: GPT(cfg), lambda step: course_batch(job.batch_size, cfg.seq_len // 2)",
        ("tests/test_fake_world.py::test_every_fake_rank_equals_its_real_gloo_rank_byte_for_byte",),
    ),
    Mutant(
        "fake_world.fsdp-shards-unpadded",
        "distributed/fake_world.py",
        "    return max(0, min(chunk, dim0 - rank * chunk)), chunk",
        "    return max(0, min(chunk, dim0 - rank * chunk)), max(0, min(chunk, dim0 - rank * chunk))",
        ("tests/test_fake_world.py::test_dry_run_model_states_follow_the_rules_at_large_n",),
    ),
    Mutant(
        "fake_check.16bit-cpu-calls-run-at-any-size",
        "prediction/fake_check.py",
        "limit = min(max_bytes, MAX_CHECK_BYTES_16BIT_CPU) if slow else max_bytes",
        "limit = max_bytes",
        ("tests/test_dryrun_modules.py::test_16bit_calls_on_the_cpu_over_a_mib_are_checked_on_the_small_twin",),
    ),
    Mutant(
        "fake_check.16bit-cap-on-element-wise-ops-too",
        "prediction/fake_check.py",
        'slow = _MATRIX_OPS.match(getattr(call.func, "_opname", "")) and any(',
        "slow = any(",
        ("tests/test_hf_fit.py::test_cheapest_fix_hf_ranks_dry_run_candidates",),
    ),
    Mutant(
        "fake_world.fsdp-collectives-unpadded",
        "distributed/fake_world.py",
        "total += fsdp_rows(p.shape[0], world_size, 0)[1] * row",
        "total += p.numel() * p.element_size() // world_size",
        ("tests/test_fake_world.py::test_the_fsdp_collectives_rule_is_what_a_dry_run_rank_issues",),
    ),
    Mutant(
        "fake_world.fsdp-collectives-reduce-before-prefetch",
        "distributed/fake_world.py",
        """        if i > 0:
            out.append(gather("backward", blocks[i - 1]))  # prefetched before block i's backward runs
        out.append(note("backward", "_reduce_scatter_base_", blocks[i]))""",
        """        out.append(note("backward", "_reduce_scatter_base_", blocks[i]))
        if i > 0:
            out.append(gather("backward", blocks[i - 1]))""",
        ("tests/test_fake_world.py::test_the_fsdp_collectives_rule_is_what_a_dry_run_rank_issues",),
    ),
    Mutant(
        "tensor_parallel.sp-shards-only-what-tp-shards",
        "distributed/tensor_parallel.py",
        "v / t if sequence_parallel or term in TP_SHARDED_TERMS else v",
        "v / t if term in TP_SHARDED_TERMS else v",
        ("tests/test_tensor_parallel.py::test_the_terms_sum_to_the_papers_closed_forms",),
    ),
    Mutant(
        "tensor_parallel.dropout-0-keeps-masks",
        "distributed/tensor_parallel.py",
        "if not cfg.dropout and term in DROPOUT_TERMS:",
        "if False:",
        (
            "tests/test_tensor_parallel.py::test_fp32_and_dropout_0_parts_are_the_formula_plus_gaps_that_name_only_"
            "what_the_model_keeps",
        ),
    ),
    # ---- the Llama block's split (tp_plan.py): grouped-query qkv rows in rank order
    Mutant(
        "tp_plan.qkv-rows-not-interleaved",
        "distributed/tp_plan.py",
        "for r in range(t) for start, w in zip(starts, widths)]",
        "for start, w in zip(starts, widths) for r in range(t)]",
        (T_GQA,),
    ),
    Mutant(
        "tp_plan.gqa-v-after-a-q-wide-k",
        "distributed/tp_plan.py",
        "starts, widths = (0, n_embd, n_embd + kv_width),",
        "starts, widths = (0, n_embd, 2 * n_embd),",
        (T_GQA,),
    ),
    # ---- the synchronization model (sync_model.py)
    Mutant(
        "sync_model.bucket-closes-only-past-its-cap",
        "distributed/sync_model.py",
        "        if held >= limit:",
        "        if held > limit:",
        ("tests/test_timed_step.py::test_our_bucket_split_is_torchs_own",),
    ),
    Mutant(
        "sync_model.bucket-ready-when-issued",
        "distributed/sync_model.py",
        "        start = max(done, backward * produced / total)",
        "        start = done",
        ("tests/test_sync_model.py::test_backward_all_reduces_hide_behind_backward_but_the_last",),
    ),
    Mutant(
        "sync_model.tp-priced-on-the-inter-node-link",
        "distributed/sync_model.py",
        "    ranks, on = (tp, tp_link) if tensor else (n // tp, link)",
        "    ranks, on = (tp, link) if tensor else (n // tp, link)",
        ("tests/test_sync_model.py::test_tp_collectives_are_priced_on_the_node_over_nvlink_and_all_exposed",),
    ),
    Mutant(
        "sync_model.fsdp-of-2d-priced-on-all-ranks",
        "distributed/sync_model.py",
        "    ranks, on = (tp, tp_link) if tensor else (n // tp, link)",
        "    ranks, on = (tp, tp_link) if tensor else (n, link)",
        ("tests/test_sync_model.py::test_each_collective_of_a_2d_rank_is_priced_on_the_group_it_ran_on",),
    ),
    Mutant(
        "sync_model.reduce-scatter-priced-on-its-shard",
        "distributed/sync_model.py",
        '    whole = c.bytes * ranks if name == "reduce-scatter" else c.bytes',
        "    whole = c.bytes",
        ("tests/test_sync_model.py::test_tp_collectives_are_priced_on_the_node_over_nvlink_and_all_exposed",),
    ),
    Mutant(
        "sync_model.tp-overlapped-like-fsdp",
        "distributed/sync_model.py",
        "    exposed = tensor_parallel  # on the critical path",
        "    exposed = 0.0  # on the critical path",
        ("tests/test_sync_model.py::test_tp_collectives_are_priced_on_the_node_over_nvlink_and_all_exposed",),
    ),
    Mutant(
        "world.2d-batch-split-over-every-rank",
        "distributed/world.py",
        '        return check_mesh(world_size, job.tp), "the N / tp nodes"',
        '        return world_size, "the N / tp nodes"',
        ("tests/test_mesh2d.py::test_the_batch_rule_splits_rows_among_data_parallel_ranks_only",),
    ),
    # ---- the 2-D mesh (mesh2d.py, fake_world.mesh_states_rule) and the per-block scaling (fit.py)
    Mutant(
        "mesh2d.dp-rank-from-the-tp-coordinate",
        "distributed/fake_world.py",
        "    dp_rank = rank // tp",
        "    dp_rank = rank % tp",
        ("tests/test_mesh2d.py::test_the_rules_at_large_n_equal_the_shapes",),
    ),
    Mutant(
        "memo.view-made-as-new-storage",
        "prediction/fake_memo.py",
        "        if leaf[0] is VIEW:\n            empty.set_(",
        "        if leaf[0] is None:\n            empty.set_(",
        ("tests/test_fake_memo.py",),
    ),
    Mutant(
        "memo.key-without-strides",
        "prediction/fake_memo.py",
        "            meta = (a.shape, a.stride(), a.storage_offset(),",
        "            meta = (a.shape, a.storage_offset(),",
        ("tests/test_fake_memo.py",),
    ),
    Mutant(
        "memo.resizing-out-kept",
        "prediction/fake_memo.py",
        "        if kind is IN_PLACE and _key(mode, func, args, kwargs) != key:",
        "        if False:",
        ("tests/test_fake_memo.py::test_an_in_place_op_that_resizes_is_not_remembered",),
    ),
    Mutant(
        "memo-cache.line-hash-unchecked",
        "prediction/fake_memo_cache.py",
        '        return found[2] if found[0] == _digest(f"{key}\\t{found[1]}\\t{found[2]}") else None',
        "        return found[2]",
        ("tests/test_fake_memo_cache.py::test_a_line_cut_short_or_changed_is_ignored",),
    ),
    Mutant(
        "memo-cache.append-at-the-end-seen",
        "prediction/fake_memo_cache.py",
        "                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)\n",
        "                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)\n"
        "                os.lseek(fd, 0, os.SEEK_END)  # the end as this process saw it, not as the write finds it\n",
        ("tests/test_fake_memo_cache.py::test_concurrent_appenders_leave_every_line_whole",),
    ),
    Mutant(
        "memo-cache.signature-unchecked",
        "prediction/fake_memo_cache.py",
        "        if found is None or found[1] != _digest(signature):",
        "        if found is None:",
        ("tests/test_fake_memo_cache.py::test_an_answer_under_another_signature_is_not_taken",),
    ),
    Mutant(
        "memo-cache.taken-before-the-check",
        "prediction/fake_check.py",
        "        key = signature(func, args, kwargs)  # before the call: an in-place op may change its inputs'"
        " layout\n",
        "        key = signature(func, args, kwargs)\n"
        "        stored = None if layout is None else fake_memo.stored_outputs(self, layout, key, args, kwargs)\n"
        "        if stored is not None and stored is not fake_memo.MISS:\n"
        "            return stored\n",
        ("tests/test_fake_memo_cache.py::test_no_answer_for_an_op_signature_not_checked_here",),
    ),
    Mutant(
        "periodic.one-block-short",
        "prediction/periodic.py",
        "        for j in range(m):  # copy j",
        "        for j in range(m - 1):  # copy j",
        (
            "tests/test_periodic.py::test_periodic_at_twelve_layers",
            "tests/test_periodic_ranks.py::test_periodic_rank_equals_the_full_dry_run",
        ),
    ),
    # ---- the one step against torch's recipes (tests/test_step_contracts.py)
    Mutant(
        "step.clip-before-unscale",
        "training/step.py",
        "                    scaler.unscale_(optimizer)\n",
        "                    pass\n",
        (
            "tests/test_step_contracts.py::test_clipping_under_a_grad_scaler_clips_the_unscaled_gradients_like_torchs_recipe",
        ),
    ),
    Mutant(
        "step.ddp-syncs-every-micro-batch",
        "training/step.py",
        "    if last or not isinstance(model, nn.parallel.DistributedDataParallel):",
        "    if True:",
        ("tests/test_step_contracts.py::test_ddp_all_reduces_once_per_step_whatever_the_micro_batches",),
    ),
    Mutant(
        "step.in-backward-loaded-state-not-shared",
        "training/step.py",
        "        super().load_state_dict(state_dict)\n        self._share()",
        "        super().load_state_dict(state_dict)",
        ("tests/test_step_contracts.py::test_in_backward_state_dict_round_trip_continues_where_it_stopped",),
    ),
    Mutant(
        "step.in-backward-own-param-groups",
        "training/step.py",
        "        self.param_groups = [opt.param_groups[0] for opt in self.optimizers.values()]\n",
        "",
        ("tests/test_step_contracts.py::test_in_backward_learning_rate_and_schedulers_go_through_param_groups",),
    ),
    Mutant(
        "step.in-backward-steps-twice",
        "training/step.py",
        "            if p in self._stepped:",
        "            if False:",
        ("tests/test_step_contracts.py::test_in_backward_refuses_a_second_backward_in_one_step_and_add_param_group",),
    ),
    Mutant(
        "model.chunked-loss-counts-ignored-targets",
        "core/model.py",
        "    return total / counted",
        "    return total / (B * T)",
        ("tests/test_step_contracts.py::test_chunked_loss_skips_ignored_targets_like_cross_entropy",),
    ),
    Mutant(
        "estimate.unknown-optimizer-is-sgd",
        EST,
        "    if optimizer not in MODELLED_OPTIMIZERS:",
        '    if optimizer not in MODELLED_OPTIMIZERS and optimizer != "AdamW":',
        ("tests/test_estimate.py::test_every_optimizer_name_is_modelled_or_refused",),
    ),
    Mutant(
        "estimate.loss-chunk-ignored",
        EST,
        "    if cfg.loss_chunk is not None:\n        raise",
        "    if False:\n        raise",
        ("tests/test_estimate.py::test_every_optimizer_name_is_modelled_or_refused",),
    ),
    # ---- survivors of the review (issue "One engine")
    Mutant(
        "dryrun.twin-leaves-nothing-unchecked",
        "prediction/dryrun.py",
        "        unchecked = [key for key in unchecked if not op_checked(key)]",
        "        unchecked = []",
        (
            "tests/test_dryrun_modules.py::test_what_the_small_twin_cannot_check_either_is_refused",
            "tests/test_dryrun_modules.py::test_the_small_twin_checks_what_the_full_run_could_not",
        ),
    ),
    Mutant(
        "dryrun.twin-differences-dropped",
        "prediction/dryrun.py",
        "problems = {key: p for key, p in twin_problems.items() if key in unchecked}",
        "problems = {}",
        ("tests/test_dryrun_modules.py::test_the_small_twin_checks_what_the_full_run_could_not",),
    ),
    Mutant(
        "dryrun.twin-never-run",
        "prediction/dryrun.py",
        "twin_problems, _ = check_calls(small_twin())",
        "twin_problems, _ = check_calls({})",
        ("tests/test_dryrun_modules.py::test_the_small_twin_checks_what_the_full_run_could_not",),
    ),
    # ---- gradient accumulation dry-run exactly (issue #43's micro-batches)
    Mutant(
        "dryrun.micro-batches-as-steps",
        "prediction/dryrun.py",
        "kernel_scratch=kernel_scratch, accumulate=micro_batches > 1)",
        "kernel_scratch=kernel_scratch, accumulate=False)",
        ("tests/test_dryrun.py::test_dry_run_equals_measured_byte_for_byte",),  # its micro_batches cases
    ),
    Mutant(
        "dryrun.twin-without-micro-batches",
        "prediction/dryrun.py",
        "twin_batch = micro_batches * min(batch_size // micro_batches, 2)",
        "twin_batch = min(batch_size, 2)",
        ("tests/test_dryrun_modules.py::test_the_small_twin_keeps_the_micro_batches",),
    ),
    Mutant(
        "cuda_rules.first-micro-batch-only",
        "prediction/cuda_rules.py",
        "        if best is None or total[i - first] > best[0]:",
        "        if best is None:",
        ("tests/test_prediction.py::test_a_named_gpu_takes_the_highest_micro_batch_of_a_phase",),
    ),
    Mutant(
        "dryrun.no-op-calls-to-check",
        "prediction/dryrun.py",
        "    return trace, mode.calls",
        "    return trace, {}",
        (
            "tests/test_dryrun_modules.py::test_what_the_small_twin_cannot_check_either_is_refused",
            "tests/test_dryrun_modules.py::test_an_op_whose_fake_kernel_differs_is_refused_by_name",
        ),
    ),
    Mutant(
        "fake_check.signature-drops-dtype",
        "prediction/fake_check.py",
        "return (device.type, a.dtype, a.dim(), a.is_contiguous(), a.requires_grad)",
        "return (device.type, a.dim(), a.is_contiguous(), a.requires_grad)",
        ("tests/test_dryrun_modules.py::test_an_op_checked_in_float32_is_checked_again_in_bfloat16",),
    ),
    Mutant(
        "cli_hf.refused-dry-run-exits-0",
        "cli/hf.py",
        'parser.exit(1, f"dry run refused: {e}\\n")',
        'parser.exit(0, f"dry run refused: {e}\\n")',
        ("tests/test_cli_hf.py::test_predict_hf_refused_by_the_dry_run_exits_1_saying_why",),
    ),
    Mutant(
        "recipes.lora-adapters-in-the-base-dtype",
        "prediction/recipes.py",
        'trained_weight = 4 if ft.method == "lora" else weight',
        "trained_weight = weight",
        ("tests/test_hf_recipes.py::test_a_recipes_bytes_per_parameter_are_the_traces_model_states",),
    ),
    # ---- one lever catalogue (prediction/levers.py, fixes.py: issue #40's ranking rules)
    Mutant(
        "levers.saving-nothing-kept",
        "prediction/levers.py",
        "return sorted((f for f in fixes if f.report.peak.tensors < base.peak.tensors), key=rank_key)",
        "return sorted((f for f in fixes if f.report.peak.tensors <= base.peak.tensors), key=rank_key)",
        ("tests/test_prediction.py::test_a_candidate_that_saves_nothing_is_dropped",),
    ),
    Mutant(
        "fixes.fitting-step-ranked",
        "prediction/fixes.py",
        "    if base.fits:\n        return []",
        "    if False:\n        return []",
        ("tests/test_prediction.py::test_a_step_that_already_fits_ranks_no_fix",),
    ),
    Mutant(
        "levers.dominant-filter-hides-time-only",
        "prediction/levers.py",
        'return not only_dominant or lever.effect == "time only" or category in lever.acts_on',
        "return not only_dominant or category in lever.acts_on",
        ("tests/test_levers.py::test_verify_levers_on_an_optimizer_bound_step_keeps_the_levers_that_keep_the_maths",),
    ),
    Mutant(
        "levers.uncounted-recompute-ranked-free",
        "prediction/levers.py",
        "flops = math.inf if fix.extra_flops is None else round(fix.extra_flops, 3)",
        "flops = 0 if fix.extra_flops is None else round(fix.extra_flops, 3)",
        ("tests/test_prediction.py::test_a_cost_the_flop_counter_cannot_see_ranks_after_every_counted_one",),
    ),
    Mutant(
        "step.cpu-sdpa-flops-not-counted",
        "training/step.py",
        "return FlopCounterMode(display=False, custom_mapping=CPU_SDPA_FLOPS)",
        "return FlopCounterMode(display=False)",
        ("tests/test_prediction.py::test_cpu_sdpa_flops_are_torchs_sdpa_formula",),
    ),
    Mutant(
        "levers.verify-ignores-the-device",
        "prediction/levers.py",
        "device=device if capped else UNBOUNDED",
        "device=UNBOUNDED",
        (
            "tests/test_levers.py::test_verify_levers_on_a_device_ranks_what_fits_there_first_and_nothing_when_the_step_fits",
        ),
    ),
    # ---- the one will-it-fit (distributed/one_fit.py)
    Mutant(
        "one_fit.rank-batch-not-global",
        "distributed/one_fit.py",
        "batch_size=rows * world_size,  # the global batch",
        "batch_size=rows,  # the global batch",
        ("tests/test_one_fit.py::test_the_course_gpt_per_rank_is_the_dry_run_of_its_sharded_rank",),
    ),
    Mutant(
        "hf_fit.ddp-tracked-before-its-buckets-are-rebuilt",
        "distributed/hf_fit.py",
        "return 1 if zero >= 2 else 2",
        "return 1",
        ("tests/test_hf_fit.py::test_every_hf_dry_run_rank_equals_its_real_gloo_rank_byte_for_byte",),
    ),
    Mutant(
        "cli.course-world-size-ignored",
        "cli/main.py",
        "per_rank = args.world_size > 1",
        "per_rank = False",
        ("tests/test_cli.py::test_predict_per_rank_is_the_one_fits_rank_0",),
    ),
    # ---- compiled code refused (tracking/compiled.py)
    Mutant(
        "compiled.module-compile-not-seen",
        "tracking/compiled.py",
        'elif getattr(module, "_compiled_call_impl", None) is not None:',
        "elif False:",
        ("tests/test_compiled.py::test_compiled_modules_names_each_compiled_module_and_nothing_else",),
    ),
    Mutant(
        "compiled.functions-not-refused",
        "tracking/compiled.py",
        'with dynamo.set_stance("fail_on_recompile") if dynamo is not None else contextlib.nullcontext():',
        "with contextlib.nullcontext():",
        ("tests/test_compiled.py::test_the_tracker_leaves_compiling_as_it_found_it",),
    ),
    # explain (prediction/explain.py): a learner's recording cut into steps and classified from lifetimes.
    Mutant(
        "explain.data-loading-stays-in-the-last-step",
        "prediction/explain.py",
        "                step[last_busy + 1 : i] = s",
        "                pass",
        ("tests/test_explain.py::test_steps_are_cut_at_each_forward_after_backward_and_data_loading_joins_its_step",),
    ),
    Mutant(
        "explain.freed-in-backward-is-a-temporary",
        "prediction/explain.py",
        '            if f_same and ph[j] == _BWD:\n                cat[k] = _CAT["activations"]',
        '            if f_same and ph[j] == _BWD:\n                cat[k] = _CAT["temporaries"]',
        ("tests/test_explain.py::test_a_simulated_snapshot_gives_back_the_traces_phases_and_categories",),
    ),
    Mutant(
        "explain.trace-phases-from-gpu-ranges-too",
        "prediction/explain_trace.py",
        'and "ts" in e and e.get("cat") in HOST]',
        'and "ts" in e]',
        ("tests/test_explain.py::test_a_cuda_profile_by_hand_sum_before_unclassified_reserved_from_the_trace",),
    ),
    Mutant(
        "explain.reserved-from-zero",
        "prediction/explain_read.py",
        "reserved=reserved0 + np.asarray(reserved_after, dtype=np.int64)",
        "reserved=np.asarray(reserved_after, dtype=np.int64)",
        ("tests/test_explain.py::test_the_h200_snapshot_steps_and_reserved_memory_are_what_torch_measured",),
    ),
    # ---- figures: what is plotted is the number the figure claims (issue #42; tests/figure_data.py reads it back)
    Mutant(
        "plots.stack-drawn-one-event-early",
        "ui/plots.py",
        'step="post",\n        linewidth=0,',
        'step="pre",\n        linewidth=0,',
        ("tests/test_plots.py::test_the_timeline_draws_each_categorys_bytes_and_marks_the_peak_where_it_is",),
    ),
    Mutant(
        "plots.scaling-compute-forward-only",  # escaped in #42: the "compute" line drew the forward alone
        "ui/plots.py",
        "[(r.forward + r.backward) * 1e3 for r in rows]",
        "[r.forward * 1e3 for r in rows]",
        ("tests/test_sync_model.py::test_the_scaling_plot_has_one_line_per_strategy_and_units",),
    ),
    Mutant(
        "plots.legend-without-the-shading",  # the step in backward's narrow phases shaded, their shading unnamed
        "ui/plots.py",
        "    if unnamed:  # some phases were too narrow to name",
        "    if False:  # some phases were too narrow to name",
        ("tests/test_plots.py::test_phases_too_narrow_to_name_are_shaded_and_the_legend_names_the_shading",),
    ),
    Mutant(
        "plots.two-categories-one-colour",
        "ui/plots.py",
        '"gradients": "#E69F00",  # orange',
        '"gradients": "#D55E00",  # orange',
        ("tests/test_plots.py::test_every_category_has_a_colour_of_its_own_that_no_shading_uses",),
    ),
    Mutant(
        "explain_plot.unclassified-from-zero",
        "ui/explain_plot.py",
        "ax.fill_between(xs, classified / scale, tl.total / scale",
        "ax.fill_between(xs, 0 * classified, tl.total / scale",
        (
            "tests/test_explain.py::"
            "test_the_explained_figure_draws_each_categorys_bytes_the_unclassified_rest_and_reserved",
        ),
    ),
    Mutant(
        "lesson02.category-max-is-the-phases-first-value",
        "lessons/lesson02_backward.py",
        "k = x0 + int(np.argmax(values[x0 : x1 + 1]))",
        "k = x0",
        ("tests/test_backward.py::test_the_category_plot_draws_its_bytes_and_states_each_phases_maximum",),
    ),
    Mutant(
        "lesson03.bars-read-step-1s-states",
        "lessons/lesson03_optimizer.py",
        "states = trace.at(trace.optimizer_phase(2).start - 1)",
        "states = trace.at(trace.optimizer_phase(1).start - 1)",
        ("tests/test_optimizer.py::test_optimizer_bars_stack_each_optimizers_model_states_up_to_its_peak",),
    ),
    Mutant(
        "lesson03.panel-ignores-its-implementation",  # a panel control that changes nothing
        "lessons/lesson03_optimizer.py",
        "opt = build_optimizer(model, name, implementation)",
        'opt = build_optimizer(model, name, "single-tensor")',
        ("tests/test_optimizer.py::test_the_panel_shows_what_the_implementation_changes",),
    ),
    Mutant(
        "lesson04.segment-blocks-at-offset-0",
        "lessons/lesson04_first_step.py",
        "left=b.offset / MiB,",
        "left=0,",
        ("tests/test_first_step.py::test_the_segment_map_draws_every_block_at_its_offset_in_its_categorys_colour",),
    ),
    Mutant(
        "lesson06.closed-form-miss-against-the-dry-run",
        "lessons/lesson06_prediction.py",
        'misses["closed form"] = [c.peaks[2] - c.peaks[0] for c in comparisons]',
        'misses["closed form"] = [c.peaks[2] - c.peaks[1] for c in comparisons]',
        (
            "tests/test_prediction.py::test_predicted_vs_measured_puts_each_configuration_at_its_peaks_and_states_each_miss",
        ),
    ),
    Mutant(
        "lesson08.collective-marked-one-event-late",
        "lessons/lesson08_scaling.py",
        "xi = xs[min(max(c.index, 0), len(xs) - 1)]",
        "xi = xs[min(max(c.index + 1, 0), len(xs) - 1)]",
        (
            "tests/test_distributed.py::test_rank_timelines_draw_each_ranks_bytes_and_mark_each_collective_where_it_was_issued",
        ),
    ),
    Mutant(
        "lesson09.panel-clamps-seq-len",  # escaped in #42: the browser test re-measured and passed
        "lessons/lesson09_finetune.py",
        "ft = panel_fine_tune(lora_rank, batch_size, seq_len)",
        "ft = panel_fine_tune(lora_rank, batch_size, min(seq_len, 1024))",
        ("tests/test_lesson_finetune.py::test_fit_panel_hf_reports_the_settings_its_dry_run_used",),
    ),
    Mutant(
        "lesson11.timed-plot-draws-the-fastest-step",
        "lessons/lesson11_scale.py",
        "s = steps[len(steps) // 2]",
        "s = steps[0]",
        ("tests/test_timed_step.py::test_the_timeline_plot_draws_each_ranks_median_step_and_its_buckets",),
    ),
    # ---- delivery (issue #42): what a learner opens, checked without a browser or a network
    Mutant(
        "readme.colab-badge-without-blob",
        "README.md",
        "[![Open the tour in Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
        "(https://colab.research.google.com/github/training-step-anatomy/training-step-anatomy/blob/main/",
        "[![Open the tour in Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
        "(https://colab.research.google.com/github/training-step-anatomy/training-step-anatomy/main/",
        ("tests/test_course.py::test_readme_badges_open_the_tour",),
        folder="",
    ),
    Mutant(
        "learner.copies-keep-their-outputs",
        "scripts/learner_copies.py",
        'cell["outputs"] = []',
        "pass",
        ("tests/test_course.py::test_learner_copies_are_in_sync_with_the_notebooks",),
        folder="",
    ),
    Mutant(
        "learner.image-to-a-github-page",  # escaped in #42
        "scripts/learner_copies.py",
        'return f"{m.group(1)}https://raw.githubusercontent.com/{slug}/{ref}/{path})"',
        'return f"{m.group(1)}https://github.com/{slug}/blob/{ref}/{path})"',
        ("tests/test_links.py::test_a_lesson_image_stays_an_image_in_the_learner_copy_and_on_the_site",),
        folder="",
    ),
    Mutant(
        "site.image-to-a-github-page",  # escaped in #42
        "scripts/site.py",
        'return f"{m.group(1)}https://raw.githubusercontent.com/{slug}/{ref}/{path}{m.group(3)}"',
        'return f"{m.group(1)}https://github.com/{slug}/blob/{ref}/{path}{m.group(3)}"',
        ("tests/test_links.py::test_a_lesson_image_stays_an_image_in_the_learner_copy_and_on_the_site",),
        folder="",
    ),
    Mutant(
        "site.colab-link-without-blob",  # escaped in #42: Colab answers 404
        "scripts/site.py",
        'f"https://colab.research.google.com/github/{slug}/blob/{ref}/learner/{name}",',
        'f"https://colab.research.google.com/github/{slug}/{ref}/learner/{name}",',
        ("tests/test_links.py::test_every_link_and_image_of_the_sites_staged_pages_opens",),
        folder="",
    ),
    Mutant(
        "pyproject.hf-extra-without-peft",  # escaped in #42: Binder linked in the host's peft
        "pyproject.toml",
        'hf = ["transformers>=5.0", "peft>=0.18"]',
        'hf = ["transformers>=5.0"]',
        ("tests/test_layout.py::test_every_module_the_hf_path_imports_is_in_the_hf_extra",),
        folder="",
    ),
]


def check_snippets(mutants=MUTANTS, root: Path = ROOT) -> list[str]:
    """One line per mutant whose original snippet is not found exactly once (or whose file is gone)."""
    problems = []
    names = [m.name for m in mutants]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"{dup}: two mutants have this name")
    for m in mutants:
        path = root / m.path
        if not path.exists():
            problems.append(f"{m.name}: {m.path} does not exist")
            continue
        count = path.read_text(encoding="utf-8").count(m.original)
        if count != 1:
            problems.append(f"{m.name}: its original snippet occurs {count} times in {m.path}, not once")
        if m.original == m.replacement:
            problems.append(f"{m.name}: the replacement is the original")
    return problems


#: What the tests need besides the package and the tests: the delivery files the delivery mutants change and the
#: tests of them read (README's badges, the learner copies, the site's staging, the [hf] extra).
DELIVERY = ("README.md", "CONTRIBUTING.md", "LICENSE", ".github", "pyproject.toml", "requirements.txt",
            "requirements-dev.txt", "docs", "notebooks", "learner", "scripts", "site", "binder", "jupyter")  # fmt: skip


def _copy_tree(dest: Path) -> None:
    """What the unit tests need: the package, the tests, the project's configuration and delivery files."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "_build")
    for name in (PKG, "tests", *DELIVERY):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, dest / name, ignore=ignore)
        elif (ROOT / name).exists():
            shutil.copy2(ROOT / name, dest / name)


def _killer(output: str) -> str:
    """The first failing test pytest names in its -q summary (or the last line, for an error)."""
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split()[1].split(" - ")[0]
    lines = [x for x in output.splitlines() if x.strip()]
    return lines[-1] if lines else "(no output)"


def run_mutant(m: Mutant, tree: Path, timeout_s: float) -> tuple[bool, str, float]:
    """Apply ``m`` in ``tree``, run its tests, restore the file: (killed, by which test, seconds)."""
    path = tree / m.path
    source = path.read_text(encoding="utf-8")
    path.write_text(source.replace(m.original, m.replacement, 1), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *m.tests]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
        seconds = time.perf_counter() - start
        if proc.returncode == 0:
            return False, "-", seconds
        if proc.returncode in (4, 5):  # usage error / nothing collected: the test list is wrong, not a kill
            raise SystemExit(f"mutant {m.name}: pytest could not run {m.tests}:\n{proc.stdout[-2000:]}")
        return True, _killer(proc.stdout), seconds
    except subprocess.TimeoutExpired:
        return True, f"(timed out after {timeout_s:.0f} s)", time.perf_counter() - start
    finally:
        path.write_text(source, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests, run nothing")
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this mutant (repeatable)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mutant (default 600)")
    args = parser.parse_args(argv)

    problems = check_snippets()
    if problems:
        print("The mutant list is stale (fix MUTANTS in scripts/mutants.py):", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        return 2
    chosen = MUTANTS
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in MUTANTS})
        if unknown:
            print(f"no mutant named {', '.join(unknown)}; --list shows them", file=sys.stderr)
            return 2
        chosen = [m for m in MUTANTS if m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name:48s} {m.path:42s} {' '.join(m.tests)}")
        return 0

    width = max(len(m.name) for m in chosen)
    print(f"{'mutant':{width}s}  {'result':8s}  {'seconds':>7s}  killed by")
    print("-" * (width + 40))
    killed = 0
    with tempfile.TemporaryDirectory(prefix="anatomy_mutants_") as tmp:
        tree = Path(tmp)
        _copy_tree(tree)
        for m in chosen:
            dead, by, seconds = run_mutant(m, tree, args.timeout)
            killed += dead
            print(f"{m.name:{width}s}  {'killed' if dead else 'SURVIVED':8s}  {seconds:7.1f}  {by}", flush=True)
    print("-" * (width + 40))
    print(f"score: {killed}/{len(chosen)} mutants killed ({100 * killed / len(chosen):.0f} %)")
    return 0 if killed == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
