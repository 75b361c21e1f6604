"""Entry point: `python -m vlm_corl.train --config FILE.yaml [dotted.key=value …]`.

Also runs as `accelerate launch -m vlm_corl.train …`. A configuration problem exits with status 2 and a
short message naming the field; a run stopped by the collapse guard (train.on_collapse) or the numerical guard
(train.max_nonfinite_steps) with status 3; training
itself runs `vlm_corl.training.loop.run_cohort`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Sequence

from vlm_corl import cli
from vlm_corl.config import ConfigError
from vlm_corl.errors import Interrupted, UserError, debug_requested


def main(argv: Sequence[str] | None = None, prog: str = "python -m vlm_corl.train") -> int:
    parser = cli.parser(prog, __doc__)
    parser.add_argument("--config", required=True, help="cohort YAML file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.n=4 members.0.view=paraphrase:1")
    args = cli.parse(parser, argv)  # also quiets transformers' per-file load/save bars, which drown the steps
    # torch and transformers load only now: `--help` and argument mistakes answer at once
    from vlm_corl.api import CohortTrainer
    from vlm_corl.distributed.world import PlacementError
    from vlm_corl.training.run.guard import CollapseStopped
    from vlm_corl.training.run.numerics import NonFiniteStopped, RolloutMismatchStopped

    try:
        trainer = CohortTrainer(args.config, overrides=args.overrides)  # the cheap checks; heavy imports after
    except ConfigError as err:
        print(_named(args.config, err), file=sys.stderr)
        return 2
    from vlm_corl.training.loop import RankFailure  # heavy imports after the cheap checks

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    try:
        summary = trainer.train()
    except UserError as err:  # found once the data, the models or the launch are known
        if debug_requested(args.debug):
            raise
        print(
            _named(args.config, err) if isinstance(err, (ConfigError, PlacementError)) else f"error: {err}",
            file=sys.stderr,
        )
        return 2
    except Interrupted as err:  # Ctrl-C
        print(err, file=sys.stderr)
        return 130
    except RankFailure as err:  # another rank died or hung: where every rank was, and how to resume
        print(f"error: {err}", file=sys.stderr)
        return 1
    except (CollapseStopped, NonFiniteStopped, RolloutMismatchStopped) as err:
        # the collapse guard (train.on_collapse=stop|rollback), the numerical or the rollout guard: who, where,
        # and what was kept
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"stopped: {err}", file=sys.stderr)
        return err.exit_status
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(summary, indent=2))
        print(f"run directory: {summary['run_dir']}")
    return 0


def _named(config: str, err: Exception) -> str:
    """The error prefixed with the config file's name, unless its message already starts from it."""
    text = str(err)
    return text if text.removeprefix("invalid config: ").startswith(str(config)) else f"{config}: {text}"


def exit_process(code: int) -> None:
    """Exit; a multi-process worker skips the interpreter's teardown after flushing everything.

    Seen once in ~20 four-process DeepSpeed ZeRO-3 runs on CPU: a worker that had finished (checkpoint,
    metrics and summary written) aborted in a C++ destructor at exit ("terminate called without an active
    exception"), turning a complete run into a failed job. All our files are closed by then."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    exit_process(main())
