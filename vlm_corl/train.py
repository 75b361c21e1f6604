"""`python -m vlm_corl.train` and `accelerate launch -m vlm_corl.train`: the launch name of `corl train`
(vlm_corl.commands.train), kept at the package root because launch scripts and accelerate configs name it."""

from vlm_corl.commands.train import exit_process, main

__all__ = ["exit_process", "main"]

if __name__ == "__main__":
    exit_process(main())
