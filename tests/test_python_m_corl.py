"""`python -m vlm_corl COMMAND ...` is `corl COMMAND ...` (vlm_corl/__main__.py runs vlm_corl.commands.main): the
same command table, the same command's output and exit status."""

from __future__ import annotations

from cohort_helpers import python_m

from vlm_corl.commands import usage


def test_python_m_vlm_corl_runs_corl():
    listed = python_m("vlm_corl", "--help")
    assert listed.returncode == 0 and listed.stdout.strip() == usage()
    checked = python_m("vlm_corl", "config")  # the command's own usage mistake and exit 2, as corl's
    assert checked.returncode == 2 and "a config FILE is required" in checked.stderr, checked.stderr
    unknown = python_m("vlm_corl", "trian")
    assert unknown.returncode == 2 and "corl: unknown command 'trian'" in unknown.stderr
