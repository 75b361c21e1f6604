"""Experiment trackers (`logging.report_to`): TensorBoard, Weights & Biases, trackio, MLflow, any subset.

Every tracker gets the same series as metrics.jsonl, one per member and metric (`<member>/<metric>`; evaluation
rows `<member>/eval/<benchmark>/<metric>`), at the run's step; the resolved config when it starts, the sampled
responses (`samples.jsonl`) as text or a table, and summary.json when the run ends. Only world rank 0 reports.
Each is an optional extra (`pip install co-rl[wandb]`, ...), except TensorBoard: a missing package is a config
error naming the extra, raised before any model loads (`check_trackers`). Each starts within
`logging.tracker_timeout_s` (a bad W&B key or an unreachable MLflow server would otherwise hold the run for minutes
of the client's own retries) or the run stops with an error naming it; trackers keep their own run handle rather
than a client's current run, so they work from the thread that started them.

Where they write: TensorBoard to RUN/tensorboard, one run per member (RUN/tensorboard/<member>, the same tag names
in each, so members overlay) and the config, samples and summary in RUN/tensorboard itself; W&B to RUN/wandb
(online, or offline with WANDB_MODE=offline: `wandb sync RUN/wandb/offline-run-*` uploads it later); MLflow to
MLFLOW_TRACKING_URI, else a file store in RUN/mlruns; trackio to its local store (TRACKIO_DIR, default
~/.cache/huggingface/trackio).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path

from vlm_corl.errors import UserError
from vlm_corl.training.monitor.samples import sample_markdown

# tracker -> (the module it needs, the extra that installs it)
PACKAGES = {"tensorboard": ("tensorboard", None), "wandb": ("wandb", "wandb"), "trackio": ("trackio", "trackio"),
            "mlflow": ("mlflow", "mlflow")}  # fmt: skip


def check_trackers(report_to: list[str]) -> None:
    """A tracker whose package is not installed is the user's to fix: UserError naming the extra."""
    for name in report_to:
        module, extra = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise UserError(
                f"logging.report_to: {name} needs the {module!r} package, which is not installed: "
                f"pip install 'co-rl[{extra}]' (or remove {name} from logging.report_to)"
            )


class Tracker:
    """What the run tells a tracker; each method a no-op unless the tracker has something to do with it. A
    tracker is made as `cls(run_dir, config, run_name, timeout_s=logging.tracker_timeout_s)`."""

    def scalars(self, values: Mapping[str, float], step: int) -> None: ...

    def samples(self, rows: list[dict], step: int) -> None: ...

    def finish(self, summary: dict | None) -> None:
        """End the tracker's run: with the run's summary, or None when the run raised (or started without it)."""


class TensorBoard(Tracker):
    """One TensorBoard run per member (RUN/tensorboard/<member>/), each with the same tag names (`reward_mean`,
    `eval/<benchmark>/accuracy`, ...), so members overlay in one chart; the config, the sampled responses and
    the summary go to the cohort's own run (RUN/tensorboard/)."""

    def __init__(self, run_dir: Path, config: dict, name: str, timeout_s: float = 30.0):
        from torch.utils.tensorboard import SummaryWriter  # imported here: it pulls in tensorboard

        self.root, self.make, self.members = run_dir / "tensorboard", SummaryWriter, {}
        self.writer = SummaryWriter(log_dir=str(self.root))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)

    def scalars(self, values, step):
        for tag, value in values.items():
            member, _, metric = tag.partition("/")  # series are <member>/<metric> (member ids hold no "/")
            if member not in self.members:
                self.members[member] = self.make(log_dir=str(self.root / member))
            self.members[member].add_scalar(metric, value, step)
        for writer in self.members.values():
            writer.flush()

    def samples(self, rows, step):
        for row in rows:
            self.writer.add_text(f"samples/{row['example_id']}", sample_markdown(row), step)
        self.writer.flush()

    def finish(self, summary):
        if summary is not None:
            self.writer.add_text("summary", "```\n" + json.dumps(summary, indent=2) + "\n```", summary.get("steps", 0))
        self.writer.close()
        for writer in self.members.values():
            writer.close()


class WandB(Tracker):
    def __init__(self, run_dir: Path, config: dict, name: str, timeout_s: float = 30.0):
        import wandb

        self.wandb = wandb
        # wandb's own deadline too (its default is 90 s): its service process retries until then, and the process
        # cannot exit before the service has, so a start given up on here would still hold the run's exit
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "co-rl"),
            name=name,
            dir=str(run_dir),
            config=config,
            settings=wandb.Settings(init_timeout=timeout_s),
        )

    def scalars(self, values, step):
        self.run.log(dict(values), step=step)

    def samples(self, rows, step):
        columns = ["example_id", "member", "question", "gold", "vote", "label", "label_from", "responses", "rewards"]
        table = self.wandb.Table(columns=columns)
        for row in rows:
            for mid, m in row["members"].items():
                table.add_data(
                    row["example_id"], mid, row["question"], row.get("gold"), m["vote"], m["label"],
                    ", ".join(m["label_from"]), "\n---\n".join(m["responses"]), json.dumps(m["rewards"]),
                )  # fmt: skip
        self.run.log({"samples": table}, step=step)

    def finish(self, summary):
        if summary is not None:
            self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str, dict))})
        self.run.finish(exit_code=0 if summary is not None else 1)  # no summary: the run raised


class Trackio(Tracker):
    def __init__(self, run_dir: Path, config: dict, name: str, timeout_s: float = 30.0):
        import trackio

        # the run itself, not trackio's current run: that is a context variable of the thread that started it
        self.run = trackio.init(
            project=os.environ.get("TRACKIO_PROJECT", "co-rl"), name=name, config=config, embed=False
        )

    def scalars(self, values, step):
        self.run.log(dict(values), step=step)

    def finish(self, summary):
        self.run.finish()


class MLflow(Tracker):
    def __init__(self, run_dir: Path, config: dict, name: str, timeout_s: float = 30.0):
        import mlflow

        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # the run's own file store: no server or database to set up (MLflow 3 keeps it behind this flag)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "co-rl"))
        # every call names the run: MLflow's active run belongs to the thread that started it
        self.run_id = mlflow.start_run(run_name=name).info.run_id
        mlflow.log_dict(config, "config.json", run_id=self.run_id)

    def scalars(self, values, step):
        # MLflow metric names allow letters, digits and _ - . / and space
        self.mlflow.log_metrics({k.replace(":", "_"): v for k, v in values.items()}, step=step, run_id=self.run_id)

    def samples(self, rows, step):
        self.mlflow.log_dict(rows, f"samples/step-{step}.json", run_id=self.run_id)

    def finish(self, summary):
        if summary is not None:
            self.mlflow.log_dict(summary, "summary.json", run_id=self.run_id)
        self.mlflow.MlflowClient().set_terminated(self.run_id, "FINISHED" if summary is not None else "FAILED")


TRACKERS: dict[str, type[Tracker]] = {"tensorboard": TensorBoard, "wandb": WandB, "trackio": Trackio, "mlflow": MLflow}


HINTS = {
    "wandb": "log in (wandb login) or set WANDB_MODE=offline",
    "mlflow": "check MLFLOW_TRACKING_URI",
    "trackio": "check TRACKIO_DIR",
    "tensorboard": "check that the run directory can be written",
}


def start_trackers(
    report_to: list[str], run_dir: Path, config: dict, name: str, timeout_s: float = 30.0
) -> list[Tracker]:
    """The run's trackers, started (world rank 0 only), each given the resolved config; one that cannot start,
    or does not within `timeout_s` seconds (logging.tracker_timeout_s), is a UserError naming it. A tracker that
    fails later is dropped with a warning: it never stops training."""
    check_trackers(report_to)
    started = []
    for t in dict.fromkeys(report_to):
        try:
            started.append(Guarded(t, start_within(t, Path(run_dir), config, name, timeout_s)))
        except Exception as err:  # noqa: BLE001 - each tracker's client raises its own kinds
            for tracker in started:
                tracker.finish(None)
            if isinstance(err, StartTimeout):
                raise UserError(
                    f"logging.report_to: {t} did not start within {timeout_s:g} s (logging.tracker_timeout_s); "
                    f"{HINTS[t]}, raise logging.tracker_timeout_s, or remove {t} from logging.report_to"
                ) from err
            raise UserError(
                f"logging.report_to: {t} could not start ({type(err).__name__}: {str(err).strip()[:300]}); "
                f"{HINTS[t]}, or remove {t} from logging.report_to"
            ) from err
    return started


class StartTimeout(Exception):
    """A tracker's start outlasted logging.tracker_timeout_s."""


def start_within(name: str, run_dir: Path, config: dict, run_name: str, timeout_s: float) -> Tracker:
    """TRACKERS[name] started in a daemon thread, waited for at most `timeout_s` seconds: its client's own retries
    (minutes for a bad W&B key or an unreachable MLflow server) cannot hold the run. Raises what the start raised,
    or StartTimeout; a start that completes after its deadline has its tracker finished at once (nothing uses it).
    The thread is a daemon so that a start blocked for good never keeps the process alive."""
    lock, box = threading.Lock(), {}

    def start() -> None:
        try:
            tracker = TRACKERS[name](run_dir, config, run_name, timeout_s=timeout_s)
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread, which raises it
            box["error"] = err
            return
        with lock:
            late = box.get("abandoned", False)
            box["tracker"] = tracker
        if late:  # the run stopped without it: close what was opened (an MLflow run would stay "running")
            try:
                tracker.finish(None)
            except Exception:  # noqa: BLE001 - nobody is left to tell
                pass

    thread = threading.Thread(target=start, name=f"start-{name}", daemon=True)
    thread.start()
    thread.join(min(timeout_s, threading.TIMEOUT_MAX))
    with lock:
        if "tracker" not in box and "error" not in box:
            box["abandoned"] = True
            raise StartTimeout(f"{name} did not start within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["tracker"]


class Guarded(Tracker):
    """A tracker whose failures after it started are logged once and end its reporting, not the run."""

    def __init__(self, name: str, tracker: Tracker):
        self.name, self.tracker, self.failed = name, tracker, False

    def _call(self, method: str, *args) -> None:
        if self.failed:
            return
        try:
            getattr(self.tracker, method)(*args)
        except Exception as err:  # noqa: BLE001 - see the class docstring
            self.failed = True
            logging.getLogger("vlm_corl").warning(
                "logging.report_to: %s failed (%s: %s); it reports nothing more in this run (metrics.jsonl is "
                "complete)",
                self.name,
                type(err).__name__,
                err,
            )

    def scalars(self, values, step):
        self._call("scalars", values, step)

    def samples(self, rows, step):
        self._call("samples", rows, step)

    def finish(self, summary):
        self._call("finish", summary)
