"""Shared fixtures: the offline tiny-model zoo and two warm-started base models (built once per test session), and
the recording stand-in for `vllm` (tests/fake_vllm.py)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
from cohort_helpers import shipped_families
from fake_vllm import fake_vllm  # noqa: F401 (a fixture: the recording stand-in for vllm)

from vlm_corl.config import MemberConfig
from vlm_corl.data.loaders import load_examples
from vlm_corl.members.member import load_member
from vlm_corl.models.warmstart import Schedule, warm_start
from vlm_corl.models.zoo import build_zoo, member_dir

# The picture-check cache (vlm_corl.data.image_checks) of this session's processes, theirs alone: never the user's
# ~/.cache, where a run of the suite would leave its entries and find those of another.
os.environ.setdefault("VLM_CORL_DATA_CACHE", tempfile.mkdtemp(prefix="vlm_corl_data_cache_"))

# One torch thread: on a shared 2-core machine two threads collapse 20-30x as soon as another process is busy.
torch.set_num_threads(1)

# The shipped families, read before a test may register a stand-in family that cannot be built.
ZOO_FAMILIES = shipped_families()


# The default suite's longest tests (each 30 s to 3 min on 2 cores), started first: `make test`'s two workers then end
# together instead of one waiting on a long test collected late (longest first, as a scheduler of uneven jobs
# should). Only the order changes; a name no longer found is ignored.
LONGEST_FIRST = (
    "tests/test_bench_device.py::test_gpu_check_runs_in_its_cpu_fallback_mode",
    "tests/test_cli.py::test_zoo_warmstart_probe_and_report_through_python_m",
    "tests/test_train.py::test_resume_after_sigkill_is_bit_identical",
    "tests/test_async_checkpoint.py::test_a_kill_during_a_background_write_resumes_from_the_previous_checkpoint",
    "tests/test_cli.py::test_demo_through_python_m_at_its_smallest",
    "tests/test_scale_out.py::test_an_api_script_under_torchrun_gives_the_rows_of_one_process",
    "tests/test_cli.py::test_every_command_through_python_m_ends_a_mistake_with_exit_2",
    "tests/test_bench_device.py::test_soak_bench_at_its_smallest_size_does_not_grow",
    "tests/test_async_checkpoint.py::test_two_processes_write_in_the_background_what_one_writes_at_the_step",
    "tests/test_scale_out.py::test_scale_benchmark_runs_at_its_smallest_size",
    "tests/test_numerics.py::test_deepspeed_members_skip_a_nonfinite_step_alike",
    "tests/test_planner.py::test_plan_check_bench_measures_states_within_tolerance",
    "tests/test_scale_out.py::test_a_killed_rank_stops_the_job_naming_its_member_and_the_run_resumes",
    "tests/test_numerics.py::test_a_member_that_keeps_diverging_stops_the_run_with_exit_3",
    "tests/test_mm_benchmarks.py::test_mathvista_through_python_m_vlm_corl_eval",
    "tests/test_user_errors.py::test_ctrl_c_exits_130_naming_the_checkpoint_to_resume_from",
    "tests/test_zero3_stream.py::test_a_partitioned_member_streams_what_a_full_copy_holds",
    "tests/test_trackers.py::test_wandb_offline_and_tensorboard_hold_both_members_series_and_samples_are_written",
)


def pytest_collection_modifyitems(items: list) -> None:
    """The tests of LONGEST_FIRST at the front, in its order; every other test keeps its place (a stable sort)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("[")[0], len(rank)))


@pytest.fixture(scope="session")
def tiny_zoo(tmp_path_factory) -> dict:
    """{family: path} of every family's tiny member (seed 0), built once (~5 s) into a session temp dir, or read
    from VLM_CORL_TINY_ZOO (`corl zoo --size tiny` run where every processor can be built: the GPU stack's lane)."""
    prebuilt = os.environ.get("VLM_CORL_TINY_ZOO")
    if prebuilt:
        zoo = {family: member_dir(prebuilt, family) for family in ZOO_FAMILIES}
        missing = [family for family, path in zoo.items() if not (path / "config.json").is_file()]
        assert not missing, f"VLM_CORL_TINY_ZOO={prebuilt} lacks {missing}: build it with corl zoo --size tiny"
        return zoo
    return build_zoo(tmp_path_factory.mktemp("zoo"), families=list(ZOO_FAMILIES), size="tiny", seed=0)


@pytest.fixture(scope="session")
def base_models(tiny_zoo, tmp_path_factory) -> dict[str, Path]:
    """Tiny Qwen2-VL and Mllama members warm-started on 500 labelled easy-vqa questions, so they answer in
    their format and agree sometimes: label-free rewards are then non-zero."""
    out = tmp_path_factory.mktemp("base")
    examples = load_examples("easyvqa", split="train", limit=500).examples
    paths = {}
    for family in ("qwen2_vl", "mllama"):
        torch.manual_seed(0)
        member = load_member(MemberConfig(id=family, model=str(tiny_zoo[family])))
        warm_start(member, examples, Schedule(steps=60, batch_size=16, lr=3e-3, seed=0))
        member.save(out / family)
        paths[family] = out / family
    return paths
