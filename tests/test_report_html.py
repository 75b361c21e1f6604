"""report.html (issue 36) loaded in a real browser (headless Chromium over the DevTools protocol): its plots are
there, model output shows as text (never as markup or script), the completions filter works through the DOM,
runs overlay, and the page asks for nothing outside itself."""

from __future__ import annotations

import json
import os

import easy_vqa
import pytest
from browser import Browser, chromium_path
from cohort_helpers import write_jsonl
from test_report import synthetic_rows

from vlm_corl.commands.report import main

if chromium_path() is None:
    if os.environ.get("VLM_CORL_REQUIRE_BROWSER"):
        raise RuntimeError("Chromium is required here (VLM_CORL_REQUIRE_BROWSER): apt-get install chromium")
    pytest.skip("no Chromium (the Debian package chromium; .ci/run installs it)", allow_module_level=True)

HOSTILE = [
    "<answer>x</answer>",
    "<script>window.pwned = 1</script>",
    '<img src="https://example.com/beacon.png" onerror="window.pwned = 2">',
]


def _run(tmp_path, name: str, members=("qwen", "llama")):
    run = tmp_path / name
    run.mkdir()
    rows = synthetic_rows(steps=12, slots=members)
    for row in rows:  # the pairwise vote agreement and a category, as a real run logs them
        row.update({f"vote_agreement/{m}": 0.5 + 0.03 * row["step"] for m in members if m != row["member"]})
        row["category/shape/agreement"] = 0.9 - 0.05 * row["step"]
    write_jsonl(run / "metrics.jsonl", rows)
    write_jsonl(run / "eval.jsonl", [{"step": s, "member": m, "benchmark": "easyvqa", "accuracy": 0.5 + 0.01 * s,
                                      "accuracy_shape": 0.4} for s in (0, 6, 12) for m in members])  # fmt: skip
    picture = easy_vqa.get_train_image_paths()[0]
    samples = []
    for step in (1, 12):
        samples.append(
            {
                "step": step, "example_id": f"ex{step}", "question": "what shape is in the image?", "image": picture,
                "category": "shape", "gold": "circle",
                "members": {
                    m: {"prompt": "what shape is in the image?\nFirst think <think> </think>", "responses": HOSTILE,
                        "answers": ["x", None, "circle"], "vote": "x", "label": "circle", "label_from": ["llama"],
                        "rewards": [0.0, 0.0, 1.0], "advantages": [-0.5, -0.5, 1.0]}
                    for m in members
                },
            }
        )  # fmt: skip
    write_jsonl(run / "samples.jsonl", samples)
    warning = {"slot": "qwen", "step": 9, "category": "shape", "rule": "diversity_agreement"}
    warning |= {"early_steps": [1, 4], "late_steps": [6, 9], "answer_entropy_early": 1.0}
    warning |= {"answer_entropy_late": 0.3, "agreement_early": 0.4, "agreement_late": 0.9}
    summary = {"reward_mode": "ring", "steps": 12, "data": {"kept": 64, "skipped": {"empty_question": 1}}}
    summary["collapse_warnings"] = [warning]
    (run / "summary.json").write_text(json.dumps(summary))
    return run


@pytest.fixture(scope="module")
def browser():
    with Browser() as b:
        yield b


def test_the_page_shows_plots_text_as_text_a_working_filter_and_asks_for_nothing(tmp_path, browser):
    run = _run(tmp_path, "ring")
    assert main([str(run)]) == 0
    page = run / "report.html"
    browser.requests.clear()
    browser.load(page)
    sections = browser.evaluate("Array.from(document.querySelectorAll('section')).map(s => s.id)")
    assert sections == ["runs", "curves", "evaluation", "categories", "agreement", "completions"]
    plots = browser.evaluate("Object.fromEntries(Array.from(document.querySelectorAll('section')).map("
                             "s => [s.id, s.querySelectorAll('svg path').length]))")  # fmt: skip
    assert all(plots[s] > 20 for s in ("curves", "evaluation", "categories", "agreement")), plots
    # model output is text: the cells read back exactly, no element was made of it, no script ran
    cells = browser.evaluate("Array.from(document.querySelectorAll('.response')).map(d => d.textContent)")
    assert cells[:3] == HOSTILE and len(cells) == 12  # 2 steps x 2 members x 3 responses
    assert (
        browser.evaluate(
            "document.querySelectorAll('#completions-table script, #completions-table img[src^=http]').length"
        )
        == 0
    )
    assert browser.evaluate("typeof window.pwned") == "undefined"
    # the question's picture, in the page once (a CSS class) and drawn in each of its 12 rows
    drawn = browser.evaluate("Array.from(document.querySelectorAll('#completions-table .pic')).map(d => "
                             "getComputedStyle(d).backgroundImage.slice(0, 26) + ' ' + d.offsetWidth)")  # fmt: skip
    assert drawn == ['url("data:image/png;base64 64'] * 12
    assert "in category shape at step 9" in browser.evaluate("document.getElementById('categories').textContent")
    matrix = browser.evaluate("Array.from(document.querySelectorAll('.matrix td')).map(td => td.textContent)")
    assert matrix == ["1.00", "0.86", "0.86", "1.00"]
    # the filter, through the DOM: by member, by step, both, and back
    visible = "document.querySelectorAll('#completions-table tbody tr:not([hidden])').length"
    assert browser.evaluate(visible) == 12
    assert browser.evaluate("setFilter('member', 'llama')") == 6 and browser.evaluate(visible) == 6
    assert browser.evaluate("setFilter('step', '12')") == 3
    assert browser.evaluate("Array.from(document.querySelectorAll('#completions-table tbody tr:not([hidden])'))"
                            ".every(tr => tr.dataset.member === 'llama' && tr.dataset.step === '12')")  # fmt: skip
    assert browser.evaluate("setFilter('member', ''), setFilter('step', '')") == 12
    # sorting by reward (click its header twice: descending)
    browser.evaluate("document.querySelector('th[data-col=\"7\"]').click()")
    browser.evaluate("document.querySelector('th[data-col=\"7\"]').click()")
    rewards = browser.evaluate("Array.from(document.querySelectorAll('#completions-table tbody tr')).map("
                               "tr => parseFloat(tr.cells[7].dataset.v))")  # fmt: skip
    assert rewards == sorted(rewards, reverse=True)
    # the address filters too (a link to a filtered view)
    browser.load(page, fragment="member=qwen&step=1")
    assert browser.evaluate(visible) == 3
    # nothing left the page: the file itself and its inline data
    assert [u for u in browser.requests if not u.startswith(("file://", "data:"))] == []
    browser.screenshot(tmp_path / "report.png")
    assert (tmp_path / "report.png").stat().st_size > 20_000


def test_several_runs_overlay_on_one_page(tmp_path, browser):
    one, two = _run(tmp_path, "ring"), _run(tmp_path, "peers", members=("a", "b", "c"))
    assert main([str(one), str(two)]) == 0
    browser.load(one / "report.html")
    runs = browser.evaluate("Array.from(document.querySelectorAll('#runs td:first-child')).map(td => td.textContent)")
    assert runs == ["ring", "peers"]
    legend = browser.evaluate("document.getElementById('curves').textContent")
    assert "ring: qwen" in legend and "peers: c" in legend
    members = browser.evaluate("Array.from(document.getElementById('member-filter').options).map(o => o.value)")
    assert members == ["", "peers: a", "peers: b", "peers: c", "ring: llama", "ring: qwen"]
    assert len(browser.evaluate("Array.from(document.querySelectorAll('.matrix'))")) == 2


def _no_votes_run(tmp_path):
    """Three steps of a run whose reward mode votes nothing (agreement None in every row, no two members ever
    both vote), with the update's numbers but no KL (algo.kl_beta 0), and easy-vqa's `yes/no` category."""
    run = tmp_path / "self_certainty"
    run.mkdir()
    stats = {"yes/no": {"questions": 1, "agreement": [0.0, 0], "answer_acc": [1.0, 2], "answers": {"yes": 2}}}
    rows = [
        {"step": s, "member": m, "reward_mean": 0.1 * s, "agreement": None, "entropy": 1.0 - 0.1 * s, "kl": None,
         "clip_frac": 0.01 * s, "clip_frac_low": 0.004 * s, "clip_frac_high": 0.006 * s, "answer_acc": 0.5,
         f"vote_agreement/{o}": None, "category_stats": stats, "category/yes_no/answer_acc": 0.5 + 0.1 * s}
        for s in (1, 2, 3) for m, o in (("qwen", "llama"), ("llama", "qwen"))
    ]  # fmt: skip
    write_jsonl(run / "metrics.jsonl", rows)
    (run / "summary.json").write_text(json.dumps({"reward_mode": "self_certainty", "steps": 3}))
    return run


def test_update_curves_whole_steps_whole_titles_and_a_word_for_each_missing_plot(tmp_path, browser):
    """Issue 56: clip fraction and entropy beside reward, KL left out with why; a run without votes says why it
    draws no agreement; step ticks are whole numbers; the per-category title stays inside its figure."""
    run = _no_votes_run(tmp_path)
    assert main([str(run)]) == 0
    browser.load(run / "report.html")
    curves = browser.evaluate("Array.from(document.querySelectorAll('#curves svg text')).map(t => t.textContent)")
    for title in ("Reward", "Policy entropy (nats / response token)", "Clip fraction", "Clip fraction, low side"):
        assert title in curves, title
    assert "KL to the reference" not in curves and "Agreement with the pseudo-label" not in curves
    said = browser.evaluate("document.getElementById('not-drawn').textContent")
    assert "KL to the reference (logged only when algo.kl_beta > 0)" in said
    assert "Agreement with the pseudo-label (no row has a pseudo-label" in said
    votes = browser.evaluate("document.querySelector('#agreement .no-votes').textContent")
    assert votes == "Vote agreement over time: not drawn, no two members both voted on a question."
    ticks = browser.evaluate("Array.from(document.querySelectorAll('g[id^=xtick_] text')).map(t => t.textContent)")
    assert ticks and all(t.isdigit() for t in ticks), ticks  # steps 1, 2, 3: never 1.25
    assert "qwen: yes/no" in browser.evaluate("document.getElementById('categories').textContent")
    outside = browser.evaluate(
        "Array.from(document.querySelectorAll('#categories svg')).flatMap(svg => {"
        " const box = svg.getBoundingClientRect();"
        " return Array.from(svg.querySelectorAll('text')).map(t => t.getBoundingClientRect())"
        "  .filter(r => r.left < box.left - 1 || r.right > box.right + 1).map(r => [r.left, r.right, box.width]); })"
    )
    assert outside == []  # the title "...: per category (running windows; ...)" was cut at both edges
    browser.screenshot(tmp_path / "no_votes.png", full_page=True)
