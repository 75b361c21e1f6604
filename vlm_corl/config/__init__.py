"""Typed cohort configuration: a cohort YAML file -> nested dataclasses, validated at load.

Defaults live only in the dataclasses of `schema`; every field carries a one-line doc (printed by
`python -m vlm_corl.config --explain`) and, where it has one, a declarative constraint. Parsing (`parse`) is
generic: it walks the dataclass fields and their type hints (Optional, Literal, list[...], dict, nested
dataclasses), so adding a field needs no parsing code. Checks across fields live in `validate`.

    cfg = load_config("configs/cohorts/example_vlm.yaml", ["rollout.n=8", "members.0.view=paraphrase:1"])

CLI: `python -m vlm_corl.config FILE.yaml [dotted.key=value ...]` prints the resolved config, or the problems
(exit status 2).
"""

from vlm_corl.config.loading import (
    check_registered,
    config_from_dict,
    config_to_dict,
    dump_config,
    load_config,
    read_raw_config,
    save_config,
    validate,
)
from vlm_corl.config.parse import ConfigError, explain
from vlm_corl.config.schema import (
    PEER_MODES,
    AlgoConfig,
    CohortConfig,
    DataConfig,
    DatasetConfig,
    EvalConfig,
    LoggingConfig,
    MemberConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
    VllmConfig,
)

__all__ = [
    "read_raw_config",
    "AlgoConfig",
    "CohortConfig",
    "ConfigError",
    "DataConfig",
    "DatasetConfig",
    "EvalConfig",
    "LoggingConfig",
    "MemberConfig",
    "PEER_MODES",
    "RewardConfig",
    "RolloutConfig",
    "TrainConfig",
    "VllmConfig",
    "check_registered",
    "config_from_dict",
    "config_to_dict",
    "dump_config",
    "explain",
    "load_config",
    "save_config",
    "validate",
]
