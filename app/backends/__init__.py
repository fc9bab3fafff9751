"""The backends' drivers (app.backend chooses one): Ray Train with MultiWorkerMirroredStrategy, parameter
servers on Ray actors, and the local process. Each has ``run(config, started_at)`` and ``dry_run_lines(config)``."""
