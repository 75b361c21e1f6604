"""`python -m vlm_corl COMMAND ...` is `corl COMMAND ...` (vlm_corl/__main__.py runs vlm_corl.commands.main): the
same command table, the same command's output and exit status."""

from __future__ import annotations

from cohort_helpers import python_m

from vlm_corl.commands import usage


def test_python_m_vlm_corl_runs_corl(tmp_path):
    listed = python_m("vlm_corl", "--help")
    assert listed.returncode == 0 and listed.stdout.strip() == usage()
    bad = tmp_path / "bad.yaml"
    bad.write_text("members: []\nno_such_key: 1\n")
    checked = python_m("vlm_corl", "config", bad)  # a command's own exit 2 and its problems, as corl's
    assert checked.returncode == 2 and "no_such_key" in checked.stderr, checked.stderr
