"""`corl`: every command of the trainer under one name; this package holds one module a command (config's,
the experiment's and the data tools' live with their packages). `corl COMMAND [ARGS ...]` runs exactly what
`python -m MODULE [ARGS ...]` runs (the same flags, output and exit codes: 0 done, 2 a user mistake, 3 stopped
by a guard, 130 interrupted); `corl --help` lists the commands, `corl COMMAND --help` one command's flags. Under
a launcher: `accelerate launch -m vlm_corl.train ...` or `torchrun ... $(which corl) train ...`. The commands'
module names before they moved here (`python -m vlm_corl.plan`, ...) still run: vlm_corl/__init__.py."""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

from vlm_corl import cli

# command -> (the module it runs, what it does), in the order `corl --help` lists them
COMMANDS = {
    "train": ("vlm_corl.commands.train", "train a cohort from its YAML file (vision or text members)"),
    "eval": ("vlm_corl.commands.eval", "score models or a run's checkpoints on benchmarks"),
    "preflight": (
        "vlm_corl.commands.preflight",
        "minutes on your node: will the run work (versions, members, memory, disk)",
    ),
    "plan": (
        "vlm_corl.commands.plan",
        "know before launch whether a cohort fits on your GPUs (--suggest: a layout that does)",
    ),
    "report": ("vlm_corl.commands.report", "plots, tables and the members' sampled answers of a run"),
    "export": ("vlm_corl.commands.export", "a run's members as Hugging Face models (--merge: LoRA adapters merged)"),
    "config": ("vlm_corl.config", "check a cohort file and print it resolved (--explain: every field)"),
    "demo": ("vlm_corl.commands.demo", "the tiny CPU demo: a cohort learns easy-vqa from its peers"),
    "zoo": ("vlm_corl.commands.zoo", "tiny random models of every family, for tests and trials"),
    "warmstart": ("vlm_corl.commands.warmstart", "a short supervised warm start (the demo's base models)"),
    "probe": ("vlm_corl.commands.probe", "how well candidate members would teach each other, before training"),
    "prepare": ("data_tools.prepare", "convert a dataset release into the project's records"),
    "validate": ("data_tools.validate", "report the problems of a record dataset"),
    "paraphrase": ("data_tools.paraphrase", "write a paraphrase cache (the members' views)"),
    "experiment": ("vlm_corl.experiments.easyvqa", "the label-free learning experiment on easy-vqa"),
    "experiment-try": ("vlm_corl.experiments.easyvqa_try", "one method of the experiment, scored on validation"),
}


def usage() -> str:
    lines = ["usage: corl COMMAND [ARGS ...]   (corl COMMAND --help: its flags)", "", "commands:"]
    for name, (module, what) in COMMANDS.items():
        lines.append(f"  {name:15s} {what}  [python -m {module}]")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        try:
            print(usage(), flush=True)
        except BrokenPipeError:  # `corl --help | head`: the reader has gone, which is fine
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"corl: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    sys.argv = [f"corl {command}", *rest]
    cli.invoked_as = f"corl {command}"
    try:
        runpy.run_module(COMMANDS[command][0], run_name="__main__", alter_sys=True)
    except SystemExit as done:
        code = done.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    finally:
        cli.invoked_as = None
    return 0
