"""`megacompile plan`: a model planned from its config.json, or a run from its run.yaml, without
weights, data or a GPU (docs/planning.md); --stage, a post-training step part by part."""
from __future__ import annotations

import argparse
import math
import sys

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DOES_NOT_FIT = 3     # `megacompile plan`'s exit status when the model does not fit (2: an error)


# The flags a run.yaml decides with --run, and its key for each (given after it as key=value).
RUN_FLAGS = (("--config", "config", "model"), ("--hbm-budget", "hbm_budget", "hbm_budget"),
             ("--batch", "batch", "batch"), ("--global-batch", "global_batch", "global_batch"),
             ("--seq", "seq", "seq"), ("--dtype", "dtype", "compute_dtype"), ("--updates", "updates", "updates"),
             ("--host-budget", "host_budget", "host_budget"), ("--nvme-budget", "nvme_budget", "nvme_budget"),
             ("--lora-rank", "lora_rank", "lora_rank"), ("--lora-target", "lora_target", "lora_target"),
             ("--stage", "stage", "stage"))


def _from_run(args: argparse.Namespace) -> None:
    """--run run.yaml [key=value ...]: the model and the settings as the run resolves them
    (train/run_plan.py), laid into the flags they stand for."""
    from ..errors import ArgumentError
    given = [(flag, key) for flag, attr, key in RUN_FLAGS + tuple((f, k, k) for f, k in STAGE_FLAGS)
             if getattr(args, attr) is not None]
    if given:
        raise ArgumentError(f"{', '.join(flag for flag, _ in given)}: with --run the run.yaml says "
                            f"{'it' if len(given) == 1 else 'them'}; give {' '.join(f'{key}=...' for _, key in given)} "
                            "after the run.yaml to plan another value")
    from ..train import load
    from ..train.run_plan import resolve
    c = load(args.run_yaml, args.overrides)
    run = resolve(c)
    for note in run.notes:
        print(note, flush=True)
    from ..train.run_images import heaviest, held_beside
    if not args.images_per_row and args.image_size is None:    # a vision-language run: its data's images
        found = heaviest(c, run.model)
        if found is not None:
            print(found.describe(), flush=True)
            args.images_per_row, args.image_size = found.per_row, found.size
    held = held_beside(c, run.model, args.images_per_row, args.image_size, run.global_batch or run.batch) \
        if args.images_per_row or args.image_size is not None else []
    args.config, args.batch, args.seq, args.global_batch = run.model, run.batch, run.seq, run.global_batch
    args.grad_accum, args.accumulation, args.dtype, args.updates = (run.grad_accum, run.accumulation,
                                                                    run.compute_dtype, run.updates)
    args.hbm_budget, args.host_budget, args.nvme_budget = run.hbm_budget, run.host_budget, run.nvme_budget
    if args.hardware is None and c.device == "cpu":      # the run's own device: the cpu backend
        args.hardware = "cpu"
    if args.hardware == "cpu" and run.hbm_budget is None:    # a budget of the weights, as the run takes it there
        from ..train.run_plan import cpu_budget
        args.hbm_budget = cpu_budget(c, run, args.images_per_row, args.image_size)
        print(f"  note           hbm_budget not given: {args.hbm_budget:.4g} GiB, as a run on the cpu backend takes "
              f"it (budget_fraction {c.budget_fraction:g} of the weights, or its smallest plan if more)", flush=True)
    args.host_source = "the run's host_budget"
    if held:        # as the run does: the engine's state is placed in what its pixels leave
        from ..train.beside import host_for_engine
        total = args.host_budget if args.host_budget is not None else _host_budget(args)[0]
        args.host_budget = host_for_engine(total, held)
        args.host_source = "the run's host_budget, less what the run holds beside the engine's state"
    args.run_steps, args.run_epochs = run.steps, run.epochs
    # The run computes the gradients' norm every step (to clip at max_grad_norm, or to log it at inf)
    args.max_grad_norm = math.inf if c.max_grad_norm is None else c.max_grad_norm
    args.trained, args.trained_inputs = run.trained, run.inputs     # stage rm: its reward model
    if run.stage in ("sft", "pt") and run.trained is not None:      # the routers' whole term: the module trained
        if run.global_batch is None and not args.images_per_row and args.image_size is None:
            args.config, args.row_inputs = run.trained, run.inputs
        else:
            print("  note           the plan is of the model's own loss: the routers' term whole in each micro-batch "
                  "(and the attention_mask its rows carry) is planned on rows of batch x seq tokens without images, "
                  "given batch and grad_accum", flush=True)
    if run.stage not in ("sft", "pt"):
        args.stage = run.stage
        if run.stage == "grpo":     # its rows and width are its generation keys
            args.batch = args.seq = None
        for key, value in run.stage_keys.items():
            setattr(args, key, value)


def plan(args: argparse.Namespace) -> int:
    import json
    from ..settings import Settings
    if args.run_yaml is not None:
        _from_run(args)
    elif args.overrides:
        from ..errors import ArgumentError
        raise ArgumentError(f"{' '.join(args.overrides)}: key=value settings are a run.yaml's, laid over it: give "
                            "--run run.yaml before them")
    args.hardware = args.hardware or "h100"
    args.dtype = args.dtype or "bfloat16"
    args.updates = args.updates or Settings.updates
    args.lora_target = args.lora_target or "all"
    if args.stage is not None:
        return _plan_stage(args)
    given = [flag for flag, key in STAGE_FLAGS if getattr(args, key) is not None]
    if given:
        from ..errors import ArgumentError
        raise ArgumentError(f"{', '.join(given)} plan{'s' if len(given) == 1 else ''} a post-training step: give "
                            "--stage dpo or --stage grpo with it")
    args.batch = 1 if args.batch is None else args.batch
    args.seq = 2048 if args.seq is None else args.seq

    from ..errors import ArgumentError, BudgetTooSmallError, HostMemoryError
    from ..ir.printer import fmt_bytes
    from ..planner.from_config import hardware_profile, minimum_budget, plan, plan_global_batch
    from ..report.outputs import check_outputs, write_plan_views
    check_outputs(trace=args.trace, plot_dir=args.plot)
    # The flags that are settings, checked as compile() checks them (megacompile/settings.py).
    host_budget, host_source = _host_budget(args)
    # The profile, resolved here once (measured for --hardware cpu when not cached yet).
    hardware = hardware_profile(args.hardware, args.nvme_bandwidth, args.host, args.host_cores)
    if args.hbm_budget is None:     # the card's memory, as compile() takes a GPU's (settings.DEVICE_SHARE)
        from ..settings import DEVICE_SHARE
        args.hbm_budget = DEVICE_SHARE * hardware.device_bytes / 2**30
    # The flags that are settings, as one Settings (the door plan() and compile() take); the rest
    # say what is planned and for which hardware.
    if args.updates != Settings.updates and args.global_batch is not None:
        raise ArgumentError(f"--updates {args.updates} needs one micro-batch per step: give --batch, "
                            "not --global-batch")
    accumulation = args.accumulation or ("auto" if args.global_batch is not None else Settings.accumulation)
    settings = Settings(hbm_budget=args.hbm_budget, compute_dtype=DTYPES[args.dtype], host_budget=host_budget,
                        nvme_budget=args.nvme_budget, updates=args.updates, grad_accum=args.grad_accum,
                        accumulation=accumulation)
    given_bytes = settings.budget_bytes
    kwargs = dict(hardware=hardware, seq=args.seq)
    if getattr(args, "max_grad_norm", None) is not None:       # --run: the run's AdamW clips
        from ..optim import AdamW
        kwargs["optimizer"] = AdamW(max_grad_norm=args.max_grad_norm)
    if args.images_per_row or args.image_size is not None:    # a vision-language model's rows hold images
        kwargs.update(images_per_row=args.images_per_row, image_size=args.image_size)
    row_inputs = getattr(args, "row_inputs", None)      # --run: the rows of the module the run trains
    if row_inputs is not None:
        ids = torch.empty(args.batch, args.seq, dtype=torch.long, device="meta")
        kwargs["inputs"] = row_inputs({"input_ids": ids, "labels": ids}, True)
    host_line = f"  host budget    {fmt_bytes(host_budget * 2**30)} checked: {host_source}"
    model = args.config
    if args.lora_rank is not None:      # the base frozen, LoRA adapters on it (train/methods/lora.py)
        from ..planner.from_config import model_from_config
        from ..train.methods.lora import lora_for_plan
        said: list[str] = []
        model = lora_for_plan(model_from_config(args.config), args.lora_rank, args.lora_target, DTYPES[args.dtype],
                              said)
        for note in said:
            print(f"  note           {note}", flush=True)
    accumulate, splits = args.grad_accum, []
    if args.gpus > 1 or args.nodes > 1:     # one rank's plan: its share of the host state, the node's budget
        from ..distributed.cost import check_gpus
        check_gpus(args.gpus, args.nodes)
        kwargs["ranks"] = (args.gpus, args.gpus // args.nodes)
    try:
        if args.global_batch is not None:   # the split is chosen, and with it the accumulation
            from ..planner.from_config import split_fields, split_line

            def heard(*split) -> None:
                # Each split as it is planned (a 7B model's global batch takes minutes): on stderr,
                # so that the summary and --json on stdout stay as they are; the JSON lists them.
                print(split_line(*split), file=sys.stderr, flush=True)
                splits.append(split_fields(*split))
            result, accumulate = plan_global_batch(model, global_batch=args.global_batch, settings=settings,
                                                   accumulation=settings.accumulation, **kwargs, on_split=heard)
        else:
            result = plan(model, settings=settings, batch=args.batch, **kwargs)
        refused = False
        if args.smallest:
            micro = args.global_batch // accumulate if args.global_batch else args.batch
            lowest = minimum_budget(model, settings=settings.replace(grad_accum=accumulate), batch=micro, **kwargs)
            result = result.revised(minimum_budget_bytes=min(result.minimum_budget_bytes, int(lowest * 2**30)),
                                    minimum_over_chunks=True)
    except HostMemoryError as e:    # the masters alone do not fit the host: the plan where they would
        print(host_line)
        print(f"  verdict        does NOT fit: {e}")
        one = args.global_batch is None and "ranks" not in kwargs      # one plan, one process
        room = _with_room(model, settings, kwargs, args.batch, e.facts, host_budget) if one else None
        lora = _with_lora(args, settings, kwargs, e.facts, host_budget) if one else None
        if args.json:
            print(json.dumps({"fits": False, "host_budget_bytes": int(host_budget * 2**30),
                              "host_budget_source": _host_source(args), "error": str(e), **e.facts,
                              **({"with_room": room} if room else {}), **({"with_lora": lora} if lora else {})}),
                  file=args.json_out)
        return DOES_NOT_FIT
    except BudgetTooSmallError as e:
        # Show the smallest plan, so the reader sees what it would take. The refusal names the
        # smallest budget any plan fits (megacompile.minimum_budget's figure: planning at it fits).
        batch = 1 if args.global_batch else args.batch
        result = plan(model, settings=settings.replace(hbm_budget=e.minimum_bytes / 2**30,
                                                       grad_accum=args.global_batch // batch if args.global_batch
                                                       else args.grad_accum),
                      batch=batch, **kwargs)
        result = result.revised(minimum_budget_bytes=e.minimum_bytes, minimum_over_chunks=True,
                                given_budget_bytes=given_bytes)
        refused = True
    fits = not refused and result.fits_card     # a budget above the card does not make a plan fit the card
    print(result.summary())
    print(host_line)
    scaled = None
    if args.gpus > 1 or args.nodes > 1:      # data parallelism: per rank memory and the throughput of all
        from ..distributed.cost import scale_out
        bw = args.network_bandwidth * 1e9 if args.network_bandwidth is not None else None
        scaled = scale_out(result, args.gpus, args.nodes, bw)
        print(scaled.summary())
    if args.global_batch and fits:
        micro = args.global_batch // accumulate
        print(f"  micro-batch    {micro} x {accumulate} accumulated = {args.global_batch} "
              f"(compile(..., grad_accum={accumulate}"
              + (", accumulation='layer'" if result.micro_batches_per_run > 1 else "") + ")), the fastest split that fits")
    run_s = _run_line(args, result.prediction.step_s * max(1, accumulate // result.micro_batches_per_run)) \
        if fits else None
    print(f"  verdict        {_verdict(result, refused, given_bytes)}")
    peak = result.peak_breakdown(5, described=True)
    print("  at the peak    " + "; ".join(f"{what} {fmt_bytes(b)}" for what, b in peak))
    write_plan_views(result, trace=args.trace, plot_dir=args.plot)
    if args.json:
        summary = {k: v for k, v in result.to_json().items() if k not in ("schedule", "values", "arena_tensors")}
        summary["fits"] = fits
        summary["budget_bytes"] = given_bytes
        summary["host_budget_bytes"] = int(host_budget * 2**30)
        summary["host_budget_source"] = _host_source(args)
        if refused:
            summary["shortfall_bytes"] = result.minimum_budget_bytes - given_bytes
        summary["card_bytes"] = result.card_bytes
        summary["grad_accum"] = accumulate
        if args.global_batch is not None:
            summary["splits"] = splits
        summary["weight_h2d_bytes_per_optimizer_step"] = result.weight_h2d_bytes_per_optimizer_step
        summary["weight_bytes"] = result.weight_bytes
        if scaled is not None:
            summary["data_parallel"] = scaled.to_json()
        if run_s is not None:
            summary["run_steps"], summary["run_predicted_s"] = args.run_steps, run_s
        print(json.dumps(summary), file=args.json_out)
    return 0 if fits else DOES_NOT_FIT


def _with_room(model, settings, kwargs: dict, batch: int, facts: dict, host_budget: float,
               label: str = "with room", flags: str = "") -> dict | None:
    """After a host refusal: the plan at the host and disk budgets its advice leads to (the disk
    beside the host given, else the smallest host that fits), printed in a line, so the reader
    sees whether the device fits and how fast a step runs before buying RAM or a drive; its
    figures, or None."""
    from ..errors import HostMemoryError
    from ..planner.host_advice import fitting_budgets
    budgets = fitting_budgets(facts, host_budget, settings.nvme_budget)
    if budgets is None:
        return None
    host, nvme = budgets
    flags += f"--host-budget {host:.10g}" + (f" --nvme-budget {nvme}" if nvme else "")
    changes = {}
    if nvme and settings.updates == "as_gradients_land":   # the disk tier takes updates at commit alone
        flags, changes = flags + " --updates at_commit", {"updates": "at_commit"}
    try:
        planned = _planned_line(label, flags, model, settings.replace(host_budget=host, nvme_budget=nvme, **changes),
                                kwargs, batch)
    except HostMemoryError:
        return None
    return {"host_budget_gib": host, "nvme_budget_gib": nvme, **planned}


# The rank a run's lora_rank defaults to (LlamaFactory's), planned when a refusal names LoRA.
LORA_RANK = 8


def _with_lora(args: argparse.Namespace, settings, kwargs: dict, facts: dict, host_budget: float) -> dict | None:
    """After a host refusal that names LoRA (a full fine-tune's): LoRA of rank 8 on the --lora-target
    modules planned whole, its adapters' state and offloaded activations with its base, at the
    budgets given, or where they do not hold it at the budgets its own refusal leads to; printed in
    a `with LoRA` line, so that the alternative named is one whose fit the reader sees; its
    figures, or None (a run.yaml's model: the run says how it trains)."""
    import os

    from ..errors import HostMemoryError
    from ..planner.from_config import model_from_config
    from ..train.methods.lora import lora_for_plan
    if "lora_base_bytes" not in facts or args.run_yaml is not None or not isinstance(args.config, (str, os.PathLike)):
        return None
    model = lora_for_plan(model_from_config(args.config), LORA_RANK, args.lora_target, DTYPES[args.dtype])
    flags = f"--lora-rank {LORA_RANK}"
    try:
        planned = _planned_line("with LoRA", flags, model, settings, kwargs, args.batch)
        planned = {"host_budget_gib": host_budget, "nvme_budget_gib": settings.nvme_budget, **planned}
    except HostMemoryError as e:
        planned = _with_room(model, settings, kwargs, args.batch, e.facts, host_budget, "with LoRA", flags + " ")
        if planned is None:
            print(f"  with LoRA      {flags}: does NOT fit the host either: {e}")
            return {"lora_rank": LORA_RANK, "fits": False, "error": str(e)}
    return {"lora_rank": LORA_RANK, **planned}


def _planned_line(label: str, flags: str, model, settings, kwargs: dict, batch: int) -> dict:
    """The plan at `settings`, in one line after `label` and the flags that ask for it: its device
    peak and step, or the smallest budget its device needs; its figures. A host refusal is raised."""
    from ..errors import BudgetTooSmallError
    from ..ir.printer import fmt_bytes, fmt_need, fmt_seconds
    from ..planner.from_config import plan
    from ..planner.step_bound import bound
    head = f"  {label:<15}{flags}: "
    try:
        result = plan(model, settings=settings, batch=batch, **kwargs)
    except BudgetTooSmallError as e:
        print(f"{head}the device does NOT fit either, its smallest budget {fmt_need(e.minimum_bytes)} of the "
              f"{fmt_bytes(settings.budget_bytes)} given")
        return {"fits": False, "smallest_budget_bytes": e.minimum_bytes}
    p = result.prediction
    bound_by = "".join(f"; bound by {what}" for what, _ in filter(None, [bound(result)]))
    print(f"{head}device peak {fmt_bytes(result.predicted_peak_bytes)} of the {fmt_bytes(result.budget_bytes)} "
          f"budget, host memory {fmt_need(result.host_bytes + result.stash_bytes)}, {fmt_seconds(p.step_s)} per "
          f"step, {p.tokens_per_s:,.0f} tok/s{bound_by}")
    return {"fits": result.fits_card, "device_peak_bytes": result.predicted_peak_bytes,
            "host_bytes": result.host_bytes + result.stash_bytes, "predicted_step_s": p.step_s,
            "predicted_tokens_per_s": p.tokens_per_s}


def _run_line(args: argparse.Namespace, step_s: float) -> float | None:
    """--run: the run's steps (its epochs' where it gives epochs) at `step_s` seconds an optimizer
    step, printed; the seconds (None without --run)."""
    if args.run_yaml is None:
        return None
    from ..ir.printer import fmt_seconds
    epochs = "" if args.run_epochs is None else f"{args.run_epochs:g} epoch{'s' * (args.run_epochs != 1)} = "
    print(f"  run            {epochs}{args.run_steps:,} optimizer step{'s' * (args.run_steps != 1)} x "
          f"{fmt_seconds(step_s)} = {fmt_seconds(args.run_steps * step_s)} predicted (evaluations and checkpoints "
          "besides)")
    return args.run_steps * step_s


def _verdict(result, refused: bool, given_bytes: int) -> str:
    """Whether the plan fits: the budget given, then the card's memory (a budget may be set above it)."""
    from ..ir.printer import fmt_bytes, fmt_need
    card = result.card_bytes
    if refused:
        need = result.minimum_budget_bytes
        verdict = (f"does NOT fit: needs {fmt_need(need)} of device memory, {fmt_bytes(given_bytes)} given: "
                   f"{fmt_need(need - given_bytes)} short")
        if card is not None and need > card:
            verdict += (f"; that is more than the {fmt_bytes(card)} of the {result.hardware.name}: it fits that card "
                        "at no budget")
        return verdict
    if result.fits_card:
        return "fits"
    need, name = result.device_bytes_needed, result.hardware.name
    from ..settings import DEVICE_SHARE
    # A named card's profile holds what torch reports on a current driver (cost/hardware.py); one's own
    # card, its driver and ECC setting, may leave a little more or less.
    measure = ("" if name.endswith("(measured)") else ", or plan with a profile measured on the card (`megacompile "
               "calibrate`), which counts the memory torch sees under its own driver and ECC setting")
    return (f"does NOT fit the {name}: the plan needs {fmt_need(need)} of device memory (its peak and reserve), the "
            f"card has {fmt_bytes(card)}: {fmt_need(need - card)} short; the budget given is "
            f"more than the card: give one within it (without --hbm-budget, {DEVICE_SHARE:.0%} of it: "
            f"{DEVICE_SHARE * card / 2**30:.2f} GiB){measure}")


# --stage's keys: (flag, the key of megacompile.plan_stage, TRL's name where TRL has it)
STAGE_FLAGS = (("--prompts", "prompts"), ("--num-generations", "num_generations"),
               ("--max-prompt-length", "max_prompt_length"), ("--max-completion-length", "max_completion_length"),
               ("--num-iterations", "num_iterations"), ("--steps-per-generation", "steps_per_generation"),
               ("--beta", "beta"), ("--generator", "generator"),
               ("--precompute-ref-log-probs", "precompute_ref_log_probs"), ("--loss-type", "loss_type"),
               ("--sync-ref-model", "sync_ref_model"))


def _plan_stage(args: argparse.Namespace) -> int:
    """--stage: the predicted step of a post-training stage, part by part (planner/posttrain_step.py)."""
    import json

    from ..errors import ArgumentError, BudgetTooSmallError, HostMemoryError
    from ..planner import plan_stage
    refused = [flag for flag, given in (("--global-batch", args.global_batch is not None), ("--gpus", args.gpus != 1),
                                        ("--nodes", args.nodes != 1), ("--smallest", args.smallest),
                                        ("--trace", args.trace is not None), ("--plot", args.plot is not None))
               if given]
    if refused:
        raise ArgumentError(f"--stage plans one GPU's step of one micro-batch, part by part: {', '.join(refused)} "
                            f"{'is' if len(refused) == 1 else 'are'} not taken with it; leave "
                            f"{'it' if len(refused) == 1 else 'them'} out")
    keys = {key: getattr(args, key) for _, key in STAGE_FLAGS if getattr(args, key) is not None}
    if args.stage == "dpo" and isinstance(keys.get("loss_type"), str):     # TRL's names, checked as a run checks them
        from ..posttrain.dpo_losses import loss_types
        keys["loss_type"] = list(loss_types(keys["loss_type"].split(",")))
    from ..planner.from_config import hardware_profile
    hardware = hardware_profile(args.hardware, host=args.host, host_cores=args.host_cores)
    if args.hbm_budget is None:     # the card's memory, as compile() takes a GPU's (settings.DEVICE_SHARE)
        from ..settings import DEVICE_SHARE
        args.hbm_budget = DEVICE_SHARE * hardware.device_bytes / 2**30
    host_budget, host_source = _host_budget(args)
    from ..ir.printer import fmt_bytes
    host_line = f"  host budget    {fmt_bytes(host_budget * 2**30)} checked: {host_source}"
    model = args.config
    if args.lora_rank is not None:      # the base frozen, LoRA adapters on it, as a run with lora holds it
        from ..planner.from_config import model_from_config
        from ..train.methods.lora import lora_for_plan
        said: list[str] = []
        model = lora_for_plan(model_from_config(args.config), args.lora_rank, args.lora_target, DTYPES[args.dtype],
                              said)
        for note in said:
            print(f"  note           {note}", flush=True)
    try:
        staged = plan_stage(model, args.hbm_budget, args.stage, batch=args.batch, seq=args.seq,
                            hardware=hardware, compute_dtype=DTYPES[args.dtype], host_budget=host_budget,
                            nvme_budget=args.nvme_budget, nvme_bandwidth=args.nvme_bandwidth,
                            images_per_row=args.images_per_row, image_size=args.image_size,
                            trained=getattr(args, "trained", None), inputs=getattr(args, "trained_inputs", None),
                            **_engine_settings(args), **keys)
    except (BudgetTooSmallError, HostMemoryError) as e:
        print(host_line)
        print(f"  verdict        does NOT fit: {e}")
        if args.json:
            print(json.dumps({"fits": False, "stage": args.stage, "error": str(e)}), file=args.json_out)
        return DOES_NOT_FIT
    print(staged.train.summary())
    print(host_line)
    print(staged.summary())
    if args.grad_accum > 1 and args.stage != "grpo":     # a run's accumulation: its steps are micro-batches
        from ..ir.printer import fmt_seconds
        print(f"  accumulation       grad_accum {args.grad_accum}: an optimizer step is {args.grad_accum} of these "
              f"steps, {fmt_seconds(args.grad_accum * staged.total_s)}")
    over = next((p for p in (staged.train, staged.forward) if p is not None and not p.fits_card), None)
    run_s = _run_line(args, _optimizer_step_s(staged, args.grad_accum)) if over is None else None
    if over is not None:
        print(f"  verdict        {_verdict(over, False, staged.train.budget_bytes)}")
    if args.json:
        run = {"run_steps": args.run_steps, "run_predicted_s": run_s} if run_s is not None else {}
        print(json.dumps({"fits": over is None, "budget_bytes": staged.train.budget_bytes, "grad_accum": args.grad_accum,
                          "card_bytes": staged.train.card_bytes, **staged.to_json(), **run}), file=args.json_out)
    return 0 if over is None else DOES_NOT_FIT


def _engine_settings(args: argparse.Namespace) -> dict:
    """What the run's engine plans each part with beside the shapes: --run's AdamW, whose gradients'
    norm is taken every step (clipped at max_grad_norm, or at inf for the log), and its accumulation;
    a plain --stage's are compile()'s defaults."""
    from ..settings import Settings
    out = dict(grad_accum=args.grad_accum, accumulation=args.accumulation or Settings.accumulation,
               updates=args.updates)
    if getattr(args, "max_grad_norm", None) is not None:
        from ..optim import AdamW
        out["optimizer"] = AdamW(max_grad_norm=args.max_grad_norm)
    return out


def _optimizer_step_s(staged, grad_accum: int) -> float:
    """An optimizer step of the planned stage: grad_accum of its steps; under grpo, grad_accum
    micro-batch passes of a rollout batch's num_iterations x steps_per_generation (its generation
    and forward passes shared among them)."""
    if staged.stage != "grpo":
        return max(1, grad_accum) * staged.total_s
    passes = staged.keys["num_iterations"] * staged.keys["steps_per_generation"]
    return max(1, grad_accum) * staged.total_s / passes


def _host_source(args: argparse.Namespace) -> str:
    """Where the host budget came from, as --json says it: "this machine", or "this process's memory
    limit" where a container's or a SLURM job's cgroup allows less than the machine's RAM."""
    if args.host_budget is None:
        from ..cost.host_memory import process_ram
        return "this machine" if process_ram()[1] is None else "this process's memory limit"
    return "run.yaml" if args.run_yaml is not None else "--host-budget"


def _host_budget(args: argparse.Namespace) -> tuple[float, str]:
    """GiB of host RAM the plan is checked against, and where that figure came from: --host-budget,
    or as compile() takes it, a share of this machine's RAM."""
    from ..cost.host_memory import HOST_SHARE, default_host_budget_bytes, physical_ram, process_ram
    from ..ir.printer import fmt_bytes
    node = " per node" if args.gpus > 1 or args.nodes > 1 else ""
    if args.host_budget is not None:
        return args.host_budget, getattr(args, "host_source", "given with --host-budget") + node
    return (default_host_budget_bytes() / 2**30,
            _ram_said(HOST_SHARE, process_ram(), physical_ram(), fmt_bytes) + node + "; "
            + ("host_budget=GiB after the run.yaml" if args.run_yaml is not None else "--host-budget GiB")
            + " to plan for another machine")


def _ram_said(share: float, usable: tuple[int, int | None], ram: int, fmt_bytes) -> str:
    """Where the default host budget came from, in words: the machine's RAM, or a lower memory
    limit of this process's cgroup (a container's, a SLURM job's)."""
    if usable[1] is None:
        return f"this machine's RAM ({share:.0%} of {fmt_bytes(ram)}, as compile() takes it)"
    return (f"this process's memory limit ({share:.0%} of the {fmt_bytes(usable[1])} its cgroup allows, of "
            f"{fmt_bytes(ram)} of RAM on the machine; as compile() takes it)")
