"""How a failed Ray run is told: one line from Ray's errors (whole tracebacks of every worker), the rest in the log."""

from __future__ import annotations

import re

from app.config import TrainConfig
from app.ui import console


def interrupted(out) -> str:
    """The one line for a Ray run stopped by Ctrl-C (Ray Train's SIGINT handler aborts its controller and exits):
    how to continue it, from either surface."""
    return (f"interrupted: the run was stopped after its last checkpoint; continue it with python jobs/train.py "
            f"--output {out} --resume (app.fit(..., output={str(out)!r}, resume=True))")


def one_line(error: BaseException, config: TrainConfig) -> str:
    """The line for a ray.train.TrainingFailedError, with where the full traceback went."""
    # A ControllerError's own message is a header ("Training failed due to controller error:"): tell its cause.
    told = getattr(error, "controller_failure", None) or error
    line = start_failure(error, config) or \
        f"training failed: {frozen(error, config)}{summarize(told)}{restart_hint(error, config)}"
    return f"{line}{trace_note(error)}"


def frozen(error: BaseException, config: TrainConfig) -> str:
    """Which worker stopped answering, where the others' waits for it were ended (a stall): the rank TensorFlow's
    coordination service names (its missed heartbeats), else the ranks that raised nothing; "" when not a stall or
    not known."""
    failures = getattr(error, "worker_failures", None) or {}
    texts = [str(e) for e in failures.values()]
    if not any(marker in text for text in texts for marker in _STALLED):
        return ""
    named = sorted({int(m.group(1)) for text in texts if "stopped sending heartbeats" in text
                    for m in _TASK.finditer(text.split("stopped sending heartbeats", 1)[1][:400])})
    silent = named or [r for r in range(config.max_workers) if r not in failures]
    if not silent or len(silent) == config.max_workers:
        return ""
    ranks = ", ".join(map(str, silent))
    return f"worker rank {ranks} stopped answering (frozen, lost or cut off); "


def start_failure(error: BaseException, config: TrainConfig) -> str | None:
    """The line for a run whose worker group could not start (Ray's own message is a paragraph), or None."""
    import ray

    failure = getattr(error, "controller_failure", None)  # ray.train.ControllerError
    kind = type(failure).__name__
    retries = (f"after {config.restarts} restarts (--max-failures)" if config.restarts
               else "(--max-failures 0: not restarted)")
    if kind == "WorkerGroupStartupTimeoutError":
        per_worker = f"{{CPU: {config.cpus_per_worker:g}{', GPU: 1' if config.use_gpu else ''}}}"
        free = ray.available_resources() if ray.is_initialized() else {}
        return (
            f"the workers could not be placed within --worker-start-timeout-s ({config.worker_start_timeout_s:g} s) "
            f"{retries}: Ray was waiting for {config.min_workers} x {per_worker} ({config.placement_strategy}), and "
            f"the cluster has {free.get('CPU', 0):g} CPUs / {free.get('GPU', 0):g} GPUs free now: lower "
            "--num-workers or --cpus-per-worker, free the cluster, or raise --worker-start-timeout-s while nodes are added"
        )
    if kind == "WorkerGroupStartupFailedError":
        fix = "; rerun with --max-failures 2 to restart the group when this happens" if not config.restarts else ""
        return f"a worker was lost while Ray Train started the worker group {retries}: {summarize(failure)}{fix}"
    return None


def restart_hint(error: BaseException, config: TrainConfig) -> str:
    """For a worker lost mid-run with no restart budget: how to get one."""
    import ray

    # A worker lost in a training step (its failure), or while the controller spoke to the group (the controller's)
    lost = [*(getattr(error, "worker_failures", None) or {}).values(), getattr(error, "controller_failure", None)]
    if config.restarts or not any(isinstance(e, ray.exceptions.RayActorError) for e in lost):
        return ""
    return ("; a lost worker is not replaced with --max-failures 0: rerun with --max-failures 2 to restart from "
            "the last checkpoint")


def trace_note(error: BaseException) -> str:
    """Every worker's whole traceback to the run's log file; the console's line says where it is."""
    path = console.write_trace("the workers' errors in full:", str(error))
    return f" (full traceback in {path})" if path else ""


def summarize(error: BaseException) -> str:
    """The last exception line of each worker's error, deduplicated (Ray's message holds whole tracebacks)."""
    failures = getattr(error, "worker_failures", None) or {0: error}
    by_message: dict[str, list[int]] = {}
    for rank, exc in sorted(failures.items()):
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raised = [line for line in lines if _EXCEPTION_LINE.match(line)]
        message = raised[-1] if raised else (lines[0] if lines else type(exc).__name__)
        # Our own errors' lines say what happened themselves (a user's code raised: which, and what).
        message = _EXCEPTION_LINE.sub(lambda m: "" if m.group(1) in ("NonFiniteLoss", "UserCodeError")
                                      else f"{m.group(1)}: ", message)
        # TensorFlow's collective errors; "Deadline Exceeded" alone could be any RPC (an upload, say).
        stalled = next((line for marker in _STALLED for line in lines if marker in line), None)
        if stalled is not None:
            message = ("a peer stopped answering in the all-reduce (a frozen, lost or cut-off worker) and the "
                       f"wait was ended (--stall-timeout-s): {stalled}")
        by_message.setdefault(message, []).append(rank)
    return "; ".join(f"{msg} (rank {', '.join(map(str, ranks))})" for msg, ranks in by_message.items())


# What TensorFlow says when a collective's peer is gone or silent (the collective's own timeout,
# CommunicationOptions, or the coordination service's missed heartbeats), the clearest first.
_STALLED = ("Collective ops is aborted", "Collective ops timeout", "stopped sending heartbeats",
            "CollectiveReduce", "CollectiveGather", "CollectiveBcast")

# A TensorFlow task in TF_CONFIG's order, which is the workers' rank order (app.backends.tf_config)
_TASK = re.compile(r"/job:worker/replica:\d+/task:(\d+)")

# "package.module.SomeError: message" -> group(1) = "SomeError"
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*([A-Z]\w*(?:Error|Exception|Loss|Exit|Interrupt)): ")
