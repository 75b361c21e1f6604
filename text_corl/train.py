"""Entry point for text cohorts: `python -m text_corl.train --config FILE.yaml [dotted.key=value …]`.

The same cohort loop as `vlm_corl.train`; text families, loaders and prompt styles come from `text_corl`
(found by the core through entry points). Text cohorts usually set `rollout.n: 8` (the paper's text K).
"""

from vlm_corl.commands.train import exit_process, main

if __name__ == "__main__":
    exit_process(main(prog="python -m text_corl.train"))
