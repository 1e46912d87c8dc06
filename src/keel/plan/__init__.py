"""The plan wing: a validated config and its AlgorithmSpec resolved, once, into what a run is
built from. One entry point, `keel.plan.run.resolve_run(cfg, spec) -> ResolvedRun`, whose parts
live one per module: the stage's plan (`stage.py`: `StagePlan`, its roles and the settings that
do not apply), the models (`models.py`: `ResolvedModels`, folders, tokenizer, device, dtypes),
what the workers are built from (`inputs.py`: `WorkerInputs`), and the batch numbers
(`keel.config.derived.BatchPlan`, the batch algebra the config is validated with). The modules
are imported by name: `keel.plan.stage` (what `keel config show` reads) loads no model library.
"""
