"""The semantic mutation set: plausible bugs written by hand, each one a decision made wrong.

Every entry replaces ``original`` (found exactly once in ``file``) by ``mutated``, says in one
line what the bug breaks, and names the fast tests that must fail on it (run by
``scripts/semantic_mutation.py``, in a temporary copy of the tree). A new decision in one of
these modules comes with its mutant here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    original: str
    mutated: str
    bug: str
    tests: tuple[str, ...]


SELECTOR = ("tests/test_selector_decisions.py",)
FINALISTS = ("tests/test_finalists.py",)
LADDER = ("tests/test_ladder_oracle.py",)
STRATEGY = ("tests/test_strategy_decisions.py",)
FIDELITY = ("tests/test_fidelity_classes.py",)
BACKEND = ("tests/test_estimate_backend_decisions.py",)
MEMORY = ("tests/test_estimator_memory_decisions.py",)
SPEED = ("tests/test_estimator_speed_decisions.py",)
LOSSGUARD = ("tests/test_lossguard_rules.py",)

MUTANTS: list[Mutant] = [
    # --- selector -------------------------------------------------------------------------------
    Mutant(
        "selector-contender-noise-ignored",
        "autotune/selector.py",
        "return max(NOISE_FLOOR, a.spread, b.spread)",
        "return max(NOISE_FLOOR, a.spread)",
        "a contender's own measurement noise is ignored when deciding whether it ties with the "
        "best (the margin is the best's alone)",
        SELECTOR,
    ),
    # --- ladder ---------------------------------------------------------------------------------
    Mutant(
        "ladder-fit-takes-biggest-saving",
        "autotune/ladder.py",
        "return (2.0, row.tokens_per_s, -float(row.peak_bytes))",
        "return (2.0, -float(row.peak_bytes), row.tokens_per_s)",
        "once a rung fits, the next technique is the biggest memory saving, not the fastest fit",
        LADDER,
    ),
    Mutant(
        "ladder-over-budget-ranks-as-fit",
        "autotune/ladder.py",
        "        return (2.0, row.tokens_per_s, -float(row.peak_bytes))\n"
        "    return (1.0, -float(row.peak_bytes), row.tokens_per_s)",
        "        return (2.0, row.tokens_per_s, -float(row.peak_bytes))\n"
        "    return (2.0, row.tokens_per_s, -float(row.peak_bytes))",
        "a faster candidate over the budget ranks as a fit once the rung below fits",
        LADDER,
    ),
    # --- finalists ------------------------------------------------------------------------------
    Mutant(
        "finalists-slowest-three",
        "autotune/finalists.py",
        "top = sorted(feasible, key=lambda r: (-r.tokens_per_s, r.number))[:MAX_FINALISTS]",
        "top = sorted(feasible, key=lambda r: (r.tokens_per_s, r.number))[:MAX_FINALISTS]",
        "with more than three feasible configurations the slowest three are re-measured, the "
        "fastest left out",
        FINALISTS,
    ),
    Mutant(
        "finalists-infeasible-remeasured",
        "autotune/finalists.py",
        "feasible = [r for r in rows if r.fidelity in members and r.feasible]",
        "feasible = [r for r in rows if r.fidelity in members]",
        "a configuration over the budget, rejected by the loss guard or failed is a finalist",
        FINALISTS,
    ),
    Mutant(
        "finalists-failed-run-is-zero-sample",
        "autotune/finalists.py",
        '            if result.status == "ok":\n'
        "                samples[str(n)].append(result.tokens_per_s)",
        "            samples[str(n)].append(result.tokens_per_s)",
        "a re-measurement that failed or ran out of memory counts as a 0 tokens/s sample",
        FINALISTS,
    ),
    Mutant(
        "selector-fits-strictly-under",
        "autotune/selector.py",
        'fits=status == "ok" and peak <= settings.budget_bytes,',
        'fits=status == "ok" and peak < settings.budget_bytes,',
        "a trial whose peak is exactly the budget is taken as not fitting",
        SELECTOR,
    ),
    Mutant(
        "selector-no-verdict-rejects",
        "autotune/selector.py",
        'return self.status == "ok" and self.fits and self.loss_ok is not False',
        'return self.status == "ok" and self.fits and self.loss_ok is True',
        "a trial without a loss verdict (none could be reached) is treated as rejected",
        SELECTOR,
    ),
    Mutant(
        "selector-tie-goes-to-fastest",
        "autotune/selector.py",
        "winner = min(contenders, key=lambda r: (*simplicity(r.config), -r.speed, r.number))",
        "winner = min(contenders, key=lambda r: (-r.speed, r.number))",
        "a tie within the noise goes to the fastest instead of the simplest",
        SELECTOR,
    ),
    Mutant(
        "selector-stage-before-techniques",
        "autotune/selector.py",
        'return used, int(config.get("zero_stage", 0) or 0), offloads',
        'return int(config.get("zero_stage", 0) or 0), used, offloads',
        "simplicity compares the ZeRO stage before the number of techniques",
        SELECTOR,
    ),
    Mutant(
        "selector-speed-is-the-mean",
        "autotune/selector.py",
        "return statistics.median(self.remeasured) if self.remeasured else self.tokens_per_s",
        "return statistics.mean(self.remeasured) if self.remeasured else self.tokens_per_s",
        "a configuration's speed is the mean of its re-measurements, one outlier moving it",
        SELECTOR,
    ),
    Mutant(
        "selector-stale-own-speed",
        "autotune/selector.py",
        "return statistics.median(self.remeasured) if self.remeasured else self.tokens_per_s",
        "return self.tokens_per_s",
        "the trial's own speed (another moment) is used instead of the re-measured median",
        SELECTOR,
    ),
    Mutant(
        "selector-stale-speed-among-samples",
        "autotune/selector.py",
        "return statistics.median(self.remeasured) if self.remeasured else self.tokens_per_s",
        "return statistics.median([self.tokens_per_s, *self.remeasured])",
        "the trial's own speed (another moment) is folded in with its re-measurements",
        SELECTOR,
    ),
    Mutant(
        "selector-one-remeasurement-no-noise",
        "autotune/selector.py",
        "self.remeasured if len(self.remeasured) > 1 else [self.tokens_per_s, *self.remeasured]",
        "self.remeasured if self.remeasured else [self.tokens_per_s]",
        "after one round a re-measured configuration has no noise of its own (a single sample "
        "has no range)",
        SELECTOR,
    ),
    Mutant(
        "selector-unremeasured-decide",
        "autotune/selector.py",
        "    if remeasured:\n        feasible = remeasured",
        "    if remeasured:\n        pass",
        "a configuration not re-measured (its speed from another moment) competes with the "
        "re-measured ones",
        SELECTOR,
    ),
    Mutant(
        "selector-spread-ignores-step-times",
        "autotune/selector.py",
        "return max(self.step_spread, between)",
        "return between",
        "the step-time spread within a trial no longer widens its noise",
        SELECTOR,
    ),
    Mutant(
        "selector-headline-fastest-group",
        "autotune/selector.py",
        "winner = next((c.winner for c in classes.values() if c.winner is not None), None)",
        "winner = max(\n        (c.winner for c in classes.values() if c.winner is not None),\n"
        "        key=lambda r: r.speed,\n        default=None,\n    )",
        "the headline winner is the fastest of any class, an adapter run over full training",
        SELECTOR,
    ),
    Mutant(
        "selector-predicted-most-memory",
        "autotune/selector.py",
        "best = min(feasible, key=lambda r: (-r.speed, r.peak_bytes, r.number))",
        "best = min(feasible, key=lambda r: (-r.speed, -r.peak_bytes, r.number))",
        "among equally fast predictions the one with the most memory is named",
        SELECTOR,
    ),
    Mutant(
        "selector-closest-includes-pruned",
        "autotune/selector.py",
        'if r.status in ("ok", "oom") and r.peak_bytes > 0 and not r.pruned_by_estimate',
        'if r.status in ("ok", "oom") and r.peak_bytes > 0',
        "a configuration the estimator pruned (never run) is offered as the closest miss",
        SELECTOR,
    ),
    Mutant(
        "selector-copies-decide",
        "autotune/selector.py",
        "mine = [r for r in rows if r.fidelity in members and r.duplicate_of is None]",
        "mine = [r for r in rows if r.fidelity in members]",
        "a copy of an earlier trial (another measurement of it) competes as a configuration",
        SELECTOR,
    ),
    Mutant(
        "selector-load-threshold-exclusive",
        "autotune/selector.py",
        "if load <= LOADED_PER_CORE and spread <= LOADED_SPREAD:",
        "if load < LOADED_PER_CORE and spread < LOADED_SPREAD:",
        "a machine exactly at the load thresholds is reported as loaded",
        SELECTOR,
    ),
    # --- ladder (more) --------------------------------------------------------------------------
    Mutant(
        "ladder-fits-strictly-under",
        "autotune/ladder.py",
        'return row is not None and row.status in ("ok", "oom") and 0 < row.peak_bytes <= budget',
        'return row is not None and row.status in ("ok", "oom") and 0 < row.peak_bytes < budget',
        "a rung whose peak is exactly the budget is taken as over it",
        LADDER,
    ),
    Mutant(
        "ladder-over-budget-takes-fastest",
        "autotune/ladder.py",
        "    if not _fits(current, budget):\n"
        "        return (1.0, -float(row.peak_bytes), row.tokens_per_s)",
        "    if not _fits(current, budget):\n"
        "        return (1.0, row.tokens_per_s, -float(row.peak_bytes))",
        "while the rung is over the budget, the fastest candidate is taken, not the biggest saving",
        LADDER,
    ),
    Mutant(
        "ladder-failed-ranks-first",
        "autotune/ladder.py",
        'if row is None or row.status == "failed" or row.peak_bytes <= 0:\n'
        "        return (0.0, 0.0, 0.0)",
        'if row is None or row.status == "failed" or row.peak_bytes <= 0:\n'
        "        return (3.0, 0.0, 0.0)",
        "a failed or unmeasured candidate is chosen before every measured one",
        LADDER,
    ),
    Mutant(
        "ladder-prediction-before-measurement",
        "autotune/ladder.py",
        '(r.status == "failed", r.predicted, r.duplicate_of is not None)',
        '(r.status == "failed", not r.predicted, r.duplicate_of is not None)',
        "a configuration's prediction stands for it where a measurement exists",
        LADDER,
    ),
    Mutant(
        "ladder-copy-before-original",
        "autotune/ladder.py",
        '(r.status == "failed", r.predicted, r.duplicate_of is not None)',
        '(r.status == "failed", r.predicted, r.duplicate_of is None)',
        "a copy stands for a configuration before the trial that measured it",
        LADDER,
    ),
    Mutant(
        "ladder-budget-stopped-peak-is-true",
        "autotune/ladder.py",
        'return row.status == "ok" or row.role in UNBOUNDED_ROLES or row.predicted',
        'return row.status in ("ok", "oom") or row.predicted',
        "a trial stopped by the budget (its peak is where it stopped) counts as a measured rung",
        LADDER,
    ),
    Mutant(
        "ladder-alone-saving-from-rung-below",
        "autotune/ladder.py",
        "saving = first.peak_bytes - alone_row.peak_bytes",
        "saving = (current or first).peak_bytes - alone_row.peak_bytes",
        "a technique's saving alone is measured from the rung below instead of the baseline",
        LADDER,
    ),
    Mutant(
        "ladder-asks-for-every-rung",
        "autotune/ladder.py",
        "if unmeasured and decided_up_to_here:",
        "if unmeasured:",
        "the next round measures candidates of rungs above the first undecided one, which may "
        "never be climbed",
        LADDER,
    ),
    # --- finalists (more) -----------------------------------------------------------------------
    Mutant(
        "finalists-lone-winner-remeasured",
        "autotune/finalists.py",
        "if len(top) > 1 and any(",
        "if len(top) >= 1 and any(",
        "a lone feasible configuration is re-measured (runs spent on a settled answer)",
        FINALISTS,
    ),
    Mutant(
        "finalists-wait-for-all-unmeasured",
        "autotune/finalists.py",
        "any(str(r.number) not in done for r in top)",
        "all(str(r.number) not in done for r in top)",
        "a group where one finalist was re-measured and a new one joined is not re-measured",
        FINALISTS,
    ),
    Mutant(
        "finalists-not-interleaved",
        "autotune/finalists.py",
        "    for i in range(rounds):\n"
        "        for n in numbers if i % 2 == 0 else reversed(numbers):\n"
        "            out.append((i, n))",
        "    for n in numbers:\n        for i in range(rounds):\n            out.append((i, n))",
        "each finalist's rounds run back to back (A A B B), a slow minute hitting one of them",
        FINALISTS,
    ),
    Mutant(
        "finalists-rounds-not-reversed",
        "autotune/finalists.py",
        "for n in numbers if i % 2 == 0 else reversed(numbers):",
        "for n in numbers:",
        "every round in the same order (A B C A B C), a drift over the re-measurement favouring "
        "the first",
        FINALISTS,
    ),
    Mutant(
        "finalists-stale-samples-kept",
        "autotune/finalists.py",
        ".items() if k not in stale",
        ".items()",
        "a re-measured group's earlier samples (another moment) are kept beside the new ones",
        FINALISTS,
    ),
    Mutant(
        "finalists-forget-earlier-samples",
        "autotune/finalists.py",
        "stored.update({n: s for n, s in samples.items() if s})",
        "stored = {n: s for n, s in samples.items() if s}",
        "the samples stored before for other class groups are dropped",
        FINALISTS,
    ),
    Mutant(
        "finalists-store-empty",
        "autotune/finalists.py",
        "stored.update({n: s for n, s in samples.items() if s})",
        "stored.update(samples)",
        "a finalist whose runs all failed is recorded as re-measured (with no sample)",
        FINALISTS,
    ),
    Mutant(
        "finalists-without-budget",
        "autotune/finalists.py",
        "spec = settings.spec(configs[n], settings.budget_bytes)",
        "spec = settings.spec(configs[n], None)",
        "re-measurements run without the study's budget",
        FINALISTS,
    ),
    # --- search strategy ------------------------------------------------------------------------
    Mutant(
        "strategy-offload-order-reversed",
        "trials/techniques/offload.py",
        'return {"cpu": 0.0, "none": 1.0}[v]',
        'return {"cpu": 1.0, "none": 0.0}[v]',
        "offload's memory order reversed: an OOM without offload prunes the offloaded "
        "configurations that would fit",
        STRATEGY,
    ),
    Mutant(
        "strategy-checkpointing-order-swapped",
        "trials/techniques/checkpointing.py",
        'memory_order=lambda v: {"full": 0.0, "selective": 1.0, "off": 2.0}[v],',
        'memory_order=lambda v: {"full": 1.0, "selective": 0.0, "off": 2.0}[v],',
        "selective checkpointing ordered as needing less memory than full",
        STRATEGY,
    ),
    Mutant(
        "strategy-implied-oom-inverted",
        "autotune/strategy.py",
        "at_least = (c >= o) | (absent & o_absent)",
        "at_least = (c <= o) | (absent & o_absent)",
        "an OOM prunes the configurations that need less memory, not more",
        STRATEGY,
    ),
    Mutant(
        "strategy-implied-oom-ignores-other-dimensions",
        "autotune/strategy.py",
        "ok = np.where(self._monotone, at_least, equal)",
        "ok = np.where(self._monotone, at_least, True)",
        "an OOM prunes configurations that differ in a non-monotone dimension (another optimizer)",
        STRATEGY,
    ),
    Mutant(
        "strategy-predicted-oom-prunes",
        "autotune/strategy.py",
        '            elif o.status == "oom":\n',
        '            elif o.status in ("oom", "predicted_oom"):\n',
        "an OOM the estimator predicted (never run) prunes other configurations",
        STRATEGY,
    ),
    Mutant(
        "strategy-failed-proposed-again",
        "autotune/strategy.py",
        "            done[i] = True\n",
        '            done[i] = o.status != "failed"\n',
        "a configuration that failed is proposed again",
        STRATEGY,
    ),
    Mutant(
        "strategy-none-fits-largest",
        "autotune/strategy.py",
        "best = int(np.argmin(np.where(done, np.inf, log_peak)))",
        "best = int(np.argmax(np.where(done, -np.inf, log_peak)))",
        "when nothing is predicted to fit, the largest predicted peak is tried next",
        STRATEGY,
    ),
    Mutant(
        "strategy-speed-before-loss-penalty",
        "autotune/strategy.py",
        "order = np.lexsort((-acquisition, penalty))",
        "order = np.lexsort((penalty, -acquisition))",
        "the best acquisition is proposed before candidates whose choices do not break the loss "
        "or crash",
        ("tests/test_strategy_oracles.py",),
    ),
    # --- fidelity classes -----------------------------------------------------------------------
    Mutant(
        "fidelity-int8-lora-exact",
        "trials/techniques/quantization.py",
        'fidelity={"int8": "adapters",',
        'fidelity={"int8": "exact",',
        "int8 + LoRA classed as exact (full training) instead of adapters",
        FIDELITY,
    ),
    Mutant(
        "fidelity-bf16-exact",
        "trials/techniques/precision.py",
        'fidelity={"bf16": "mixed", "fp16": "mixed"},',
        'fidelity={"bf16": "exact", "fp16": "mixed"},',
        "bf16 autocast classed as exact, judged against the fp32 reference per step",
        FIDELITY,
    ),
    Mutant(
        "fidelity-8bit-state-other-optimizer",
        "trials/techniques/optimizer.py",
        '"adamw_torchao_8bit": "reduced_state",',
        '"adamw_torchao_8bit": "other_optimizer",',
        "torchao's 8-bit AdamW classed as another optimizer instead of 8-bit state",
        FIDELITY,
    ),
    Mutant(
        "fidelity-pure-bf16-mixed",
        "trials/techniques/precision.py",
        'fidelity={"bf16": "reduced_state", "bf16_stochastic": "reduced_state"},',
        'fidelity={"bf16": "mixed", "bf16_stochastic": "reduced_state"},',
        "pure-bf16 master weights classed as mixed precision, not reduced state",
        FIDELITY,
    ),
    Mutant(
        "fidelity-most-faithful-choice",
        "trials/techniques/__init__.py",
        "worst = max(worst, FIDELITY_CLASSES.index(choice_fidelity(dimension, choice)))",
        "worst = min(worst, FIDELITY_CLASSES.index(choice_fidelity(dimension, choice)))",
        "a configuration takes its most faithful choice's class (everything reads exact)",
        FIDELITY,
    ),
    Mutant(
        "fidelity-allow-excludes-widest",
        "trials/techniques/__init__.py",
        "return FIDELITY_CLASSES[: FIDELITY_CLASSES.index(widest) + 1]",
        "return FIDELITY_CLASSES[: FIDELITY_CLASSES.index(widest)]",
        "--allow X searches the classes more faithful than X but not X itself",
        FIDELITY,
    ),
    # --- estimate backend -----------------------------------------------------------------------
    Mutant(
        "estimate-host-check-device-peak",
        "autotune/estimator/prediction_runners.py",
        "if host is not None and est.host_bytes > host * (1 + margin):",
        "if host is not None and est.peak_bytes > host * (1 + margin):",
        "the host-memory check compares the device peak with --host-memory",
        BACKEND,
    ),
    Mutant(
        "estimate-device-at-budget-over",
        "autotune/estimator/prediction_runners.py",
        "est.peak_bytes > spec.budget_bytes * (1 + margin)",
        "est.peak_bytes >= spec.budget_bytes * (1 + margin)",
        "a prediction exactly at the budget is an OOM",
        BACKEND,
    ),
    Mutant(
        "estimate-oom-keeps-speed",
        "autotune/estimator/prediction_runners.py",
        "tokens_per_s=0.0 if error else est.tokens_per_s,",
        "tokens_per_s=est.tokens_per_s,",
        "a prediction over the budget still reports its tokens/s, as if it ran",
        BACKEND,
    ),
    Mutant(
        "estimate-prescreen-without-margin",
        "autotune/estimator/prediction_runners.py",
        "why = _over(est, spec, self.margin)",
        "why = _over(est, spec)",
        "the GPU pre-screen skips trials predicted just over the budget, inside the "
        "estimator's error",
        BACKEND,
    ),
    Mutant(
        "estimate-score-host-device-peak",
        "autotune/estimator/exhaustive.py",
        "elif host_budget_bytes is not None and e.host_bytes > host_budget_bytes:",
        "elif host_budget_bytes is not None and e.peak_bytes > host_budget_bytes:",
        "scoring a space compares the device peak with --host-memory",
        BACKEND,
    ),
    Mutant(
        "estimate-class-best-most-memory",
        "autotune/estimator/exhaustive.py",
        "fitting.sort(key=lambda s: (-s.estimate.tokens_per_s, s.estimate.peak_bytes))",
        "fitting.sort(key=lambda s: (-s.estimate.tokens_per_s, -s.estimate.peak_bytes))",
        "among equally fast configurations of a class the one with the most memory is named",
        BACKEND,
    ),
    Mutant(
        "estimate-headline-exact-only",
        "autotune/estimator/exhaustive.py",
        'HEADLINE_CLASSES = ("exact", "mixed", "reduced_state")',
        'HEADLINE_CLASSES = ("exact",)',
        "the headline ignores mixed precision and pure bf16, naming a slower fp32 configuration",
        BACKEND,
    ),
    Mutant(
        "estimate-host-default-swapped",
        "autotune/estimate_backend.py",
        '    if backend == "estimate":\n        return None\n    return machine_memory()',
        '    if backend != "estimate":\n        return None\n    return machine_memory()',
        "the estimate backend limits host memory to this machine's, trial backends to none",
        BACKEND,
    ),
    # --- memory estimate ------------------------------------------------------------------------
    Mutant(
        "memory-recompute-not-at-end-of-backward",
        "autotune/estimator/analytical.py",
        "bwd_layers = n_ckpt * stream + recompute\n",
        "bwd_layers = n_ckpt * stream\n",
        "under checkpointing the layer recomputed in backward is not counted at the end of "
        "backward",
        MEMORY,
    ),
    Mutant(
        "memory-recompute-every-layer",
        "autotune/estimator/analytical.py",
        "recompute = (per_layer + layer_weight_cache) if every else 0",
        "recompute = (n_ckpt * per_layer + layer_weight_cache) if every else 0",
        "every checkpointed layer's recompute counted at once instead of one at a time",
        MEMORY,
    ),
    Mutant(
        "memory-logits-gradient-8-bytes",
        "autotune/estimator/analytical.py",
        "bwd_logits = 12 * logit_tokens * vocab",
        "bwd_logits = 8 * logit_tokens * vocab",
        "the start of backward holds one fp32 gradient of the logits instead of two and the "
        "log-softmax",
        MEMORY,
    ),
    Mutant(
        "memory-selective-as-full",
        "autotune/estimator/analytical.py",
        'every = {"off": 0, "full": 1}.get(ckpt, int(config.get("checkpoint_every", 2)))',
        'every = {"off": 0, "full": 1}.get(ckpt, 1)',
        "selective checkpointing counted as checkpointing every layer",
        MEMORY,
    ),
    Mutant(
        "memory-checkpointed-layers-kept-whole",
        "autotune/estimator/analytical.py",
        "kept += (layers - n_ckpt) * per_layer",
        "kept += layers * per_layer",
        "a checkpointed layer's activations counted as kept besides its input",
        MEMORY,
    ),
    Mutant(
        "memory-accumulation-holds-no-gradients",
        "autotune/estimator/analytical.py",
        "grads_before = grads if accum > 1 else 0",
        "grads_before = 0",
        "under gradient accumulation the earlier micro-batches' gradients are not counted",
        MEMORY,
    ),
    Mutant(
        "memory-peak-is-last-moment",
        "autotune/estimator/analytical.py",
        "            if total > peak:\n",
        "            if True:\n",
        "the peak is the step's last moment, not its largest",
        MEMORY,
    ),
    # --- speed estimate -------------------------------------------------------------------------
    Mutant(
        "speed-ddp-16-bit-gradients",
        "autotune/estimator/speed.py",
        "comm_step = max(0.0, 2 * ring * 4 * psi / link - bwd)",
        "comm_step = max(0.0, 2 * ring * wbytes * psi / link - bwd)",
        "the DDP all-reduce priced on 16-bit gradients under autocast (they are fp32)",
        SPEED,
    ),
    Mutant(
        "speed-ddp-half-the-ring",
        "autotune/estimator/speed.py",
        "comm_step = max(0.0, 2 * ring * 4 * psi / link - bwd)",
        "comm_step = max(0.0, ring * 4 * psi / link - bwd)",
        "the all-reduce priced as one reduce-scatter, without the all-gather half",
        SPEED,
    ),
    Mutant(
        "speed-offload-copy-back-free",
        "autotune/estimator/speed.py",
        "offload += wbytes * shard / pcie  # updated weights back up",
        "offload += 0.0  # updated weights back up",
        "ZeRO-Offload's copy of the updated weights back to the GPU priced as free",
        SPEED,
    ),
    Mutant(
        "speed-zero2-fp32-gradients",
        "autotune/estimator/speed.py",
        "reduce = ring * wbytes * psi / link",
        "reduce = ring * 4 * psi / link",
        "ZeRO-1/2's reduce-scatter priced on fp32 gradients under bf16",
        SPEED,
    ),
    Mutant(
        "speed-fp32-at-tensor-core-rate",
        "autotune/estimator/speed.py",
        "peak = gpu.flops_per_s(precision) * matmul_efficiency(gpu)",
        'peak = gpu.flops_per_s("bf16") * matmul_efficiency(gpu)',
        "fp32 matmuls priced at the bf16 tensor-core rate",
        SPEED,
    ),
    Mutant(
        "speed-tokens-of-one-rank",
        "autotune/estimator/speed.py",
        "est.tokens_per_s = real * max(1, nproc) / t.total",
        "est.tokens_per_s = real / t.total",
        "tokens/s counts one rank's tokens, not the whole world's",
        SPEED,
    ),
    # --- loss guard -----------------------------------------------------------------------------
    Mutant(
        "lossguard-exact-one-sided",
        "autotune/lossguard.py",
        "worst = max(abs(a - b) / abs(b) for a, b in zip(losses[:n], reference[:n], strict=True))",
        "worst = max((a - b) / abs(b) for a, b in zip(losses[:n], reference[:n], strict=True))",
        "an exact configuration whose loss drops below the reference's passes (a bug read as "
        "a gain)",
        LOSSGUARD,
    ),
    Mutant(
        "lossguard-regression-sign",
        "autotune/lossguard.py",
        "diffs.append((c - r) / abs(r) if math.isfinite(c) else math.inf)",
        "diffs.append((r - c) / abs(r) if math.isfinite(c) else math.inf)",
        "a probe whose loss is worse than fp32 AdamW's reads as an improvement",
        LOSSGUARD,
    ),
    Mutant(
        "lossguard-adapters-probed",
        "autotune/lossguard.py",
        '    if cls == "adapters":\n',
        '    if cls == "adapter":\n',
        "LoRA runs are judged by the probe against full training",
        LOSSGUARD,
    ),
    Mutant(
        "lossguard-tolerance-exclusive",
        "autotune/lossguard.py",
        'return LossVerdict("probe", regression <= tolerance, regression, tolerance, noise, note)',
        'return LossVerdict("probe", regression < tolerance, regression, tolerance, noise, note)',
        "a probe regressing exactly by the tolerance is rejected",
        LOSSGUARD,
    ),
]
