"""`corl report` and what a run hands it (issue 46): file names never come from the data (an example id of
`../../x` or `a/b`), category names with `$` are drawn as written, a lone surrogate is written as a replacement
character, a run given twice is reported once, the page holds each response once under a size cap, and model
output in samples.md is text, never markup. No browser: the files are read back as text."""

from __future__ import annotations

import re

from cohort_helpers import write_jsonl
from markdown_it import MarkdownIt
from PIL import Image

import vlm_corl.reporting.html as report_html
from vlm_corl.commands.report import main
from vlm_corl.reporting.html import render_html
from vlm_corl.reporting.markdown import render_report, render_samples
from vlm_corl.reporting.run_plots import load_run

HOSTILE = [
    "<answer>x</answer>",
    "<script>window.pwned = 1</script>",
    '<img src="https://example.com/beacon.png" onerror="window.pwned = 2">',
]


def _sample(step: int, example_id: str, picture=None, responses=("a", "b"), members=("qwen", "llama"), **fields):
    row = {"step": step, "example_id": example_id, "question": "what shape?", "image": picture, "gold": "circle"}
    row["members"] = {
        m: {"prompt": "what shape?", "responses": list(responses), "answers": ["x"] * len(responses), "vote": "x",
            "label": "x", "label_from": ["llama"], "rewards": [1.0] * len(responses),
            "advantages": [0.0] * len(responses)}
        for m in members
    }  # fmt: skip
    return row | fields


def _rows(metrics=()):
    """Metrics rows of two members over two steps: a reward and `metrics` (few plots to draw)."""
    return [{"step": s, "member": m, "reward_mean": 0.5, **dict(metrics)} for s in (1, 2) for m in ("qwen", "llama")]


def _run(tmp_path, samples=(), name="run", rows=None):
    """A run directory: its metrics `rows` (default `_rows()`) and `samples`."""
    run = tmp_path / name
    run.mkdir(parents=True)
    write_jsonl(run / "metrics.jsonl", rows or _rows())
    if samples:
        write_jsonl(run / "samples.jsonl", list(samples))
    return run


def _picture(path, colour):
    Image.new("RGB", (4, 4), colour).save(path)
    return str(path)


def _files(root):
    return {p for p in root.rglob("*") if p.is_file()}


def test_an_example_id_never_names_a_file_outside_out(tmp_path):
    picture = _picture(tmp_path / "in.png", "red")
    run = _run(tmp_path / "runs", [_sample(1, "../../x", picture)])
    out = tmp_path / "runs" / "out"
    before = _files(tmp_path)
    render_report(run, out)
    assert {p for p in _files(tmp_path) - before if out not in p.parents} == set()  # nothing written beside --out
    (copied,) = (out / "sample_images").iterdir()
    assert copied.read_bytes() == (tmp_path / "in.png").read_bytes()
    assert f"(sample_images/{copied.name})" in (out / "samples.md").read_text()


def test_ids_with_slashes_and_ids_that_read_alike_get_a_picture_each(tmp_path):
    ids = ["a/b", "a_b", "a b", "a\\b"]  # one slug, four examples
    samples = [_sample(1, i, _picture(tmp_path / f"{n}.png", (60 * n, 0, 0))) for n, i in enumerate(ids)]
    out = tmp_path / "out"
    render_samples(_run(tmp_path, samples), out)
    copied = sorted((out / "sample_images").iterdir())
    assert len(copied) == 4 and all(p.suffix == ".png" for p in copied)
    page = (out / "samples.md").read_text()
    for n in range(4):  # each example's own picture, linked from the page
        (match,) = [p for p in copied if p.read_bytes() == (tmp_path / f"{n}.png").read_bytes()]
        assert f"(sample_images/{match.name})" in page


def test_a_category_with_dollars_is_drawn_as_written(tmp_path):
    """matplotlib reads text between two `$` as maths: "$5 and $10" came out as italic "5 and", and
    "$\\frac{$" stopped the report with a parse error."""
    rows = _rows({"category/$5 and $10/agreement": 0.5, "category/$\\frac{$/agreement": 0.4})
    run = _run(tmp_path, rows=rows)
    out = tmp_path / "out"
    assert main([str(run), "--out", str(out)]) == 0
    assert (out / "categories.png").exists()
    svg_text = re.findall(r"<text[^>]*>([^<]*)</text>", (out / "report.html").read_text())
    assert "qwen: $5 and $10" in svg_text and "llama: $\\frac{$" in svg_text


def test_a_lone_surrogate_is_written_as_a_replacement_character(tmp_path):
    """JSON may hold "\\ud800", which no UTF-8 file can: the report stopped with UnicodeEncodeError."""
    rows = _rows({"category/odd\ud800/agreement": 0.5})
    sample = _sample(1, "ex\ud800", responses=("answer \ud800 here", "b"), question="what \udfff?")
    run = _run(tmp_path, [sample], rows=rows)
    out = tmp_path / "out"
    assert main([str(run), "--out", str(out)]) == 0
    for page in ("report.html", "report.md", "samples.md"):
        text = (out / page).read_bytes().decode("utf-8")  # strict: the files are valid UTF-8
        assert "\ufffd" in text or page == "report.md", page
    assert "answer \ufffd here" in (out / "report.html").read_text()
    assert "qwen: odd\ufffd" in (out / "report.html").read_text()


def _runs_table(page: str) -> list[str]:
    section = re.search(r'<section id="runs">(.*?)</section>', page).group(1)
    return re.findall(r"<tr><td>([^<]*)</td>", section)


def test_the_same_run_given_twice_is_reported_once_and_named(tmp_path, capsys):
    run = _run(tmp_path, [_sample(1, "ex1")])
    assert main([str(run), str(tmp_path / "." / "run" / ".." / "run")]) == 0
    assert _runs_table((run / "report.html").read_text()) == ["run"]
    page = (run / "report.html").read_text()
    assert page.count('<tr data-member="qwen"') == 2  # one row per response, not two
    err = capsys.readouterr().err
    assert "given twice" in err and str(tmp_path / "run") in err


def test_runs_that_share_their_last_two_names_keep_apart(tmp_path):
    """a/x/run and b/x/run were both labelled x/run: one run's lines replaced the other's."""
    one, two = _run(tmp_path / "a" / "x"), _run(tmp_path / "b" / "x")
    page = render_html([load_run(one), load_run(two)], tmp_path / "report.html").read_text()
    assert _runs_table(page) == ["a/x/run", "b/x/run"]


def test_the_page_holds_each_response_once_and_cuts_long_ones(tmp_path):
    """20 MB of responses made a 40 MB page: each was written as a sort key and again as the cell's text."""
    long = ["<" + chr(ord("a") + n) * 5_000_000 for n in range(4)]  # 20 MB, each with a character to escape
    short = "a short answer <b>"
    run = _run(tmp_path, [_sample(1, "ex1", responses=(*long[:2], short)), _sample(2, "ex2", responses=long[2:])])
    page = render_html([load_run(run)], tmp_path / "report.html").read_text()
    assert page.count("a short answer &lt;b&gt;") == 2  # one row each for qwen and llama
    assert len(page.encode()) < report_html.MAX_TABLE_BYTES + 1_000_000
    cut = 5_000_000 + 1 - report_html.MAX_TEXT_CHARS
    assert page.count(f"{cut:,} more characters") == 8  # 4 long responses x 2 members, each cut with a note
    assert "&lt;" + "a" * (report_html.MAX_TEXT_CHARS - 1) in page


def test_the_table_keeps_the_newest_rows_within_its_byte_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(report_html, "MAX_TABLE_BYTES", 60_000)
    samples = [_sample(s, f"ex{s}", responses=(f"step {s} " + "y" * 2_000,)) for s in range(1, 41)]
    page = render_html([load_run(_run(tmp_path, samples))], tmp_path / "report.html").read_text()
    table = re.search(r"<tbody>.*</tbody>", page, re.S).group(0)
    assert len(table.encode()) <= 60_000
    kept = [int(s) for s in re.findall(r'data-step="(\d+)"', table)]
    assert kept and kept[-1] == 40 and kept == sorted(kept) and len(kept) < 80  # the newest, in order
    assert f"The oldest {80 - len(kept)} rows are left out" in page


def test_each_picture_is_embedded_once_however_many_rows_show_it(tmp_path):
    picture = _picture(tmp_path / "in.png", "blue")
    run = _run(tmp_path, [_sample(s, "same", picture, responses=("a", "b", "c", "d")) for s in (1, 2)])
    page = render_html([load_run(run)], tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 1  # 16 rows show it


def test_samples_md_shows_model_markup_as_text(tmp_path):
    sample = _sample(1, "ex<1>", responses=HOSTILE, question='<img src=x onerror="alert(1)"> which `colour`?')
    sample["members"]["qwen"]["vote"] = "<b>bold</b>"
    out = tmp_path / "out"
    out.mkdir()
    render_samples(_run(tmp_path, [sample]), out)
    page = (out / "samples.md").read_text()
    rendered = MarkdownIt("commonmark").render(page)  # what GitHub or an editor's preview would show
    assert "<script" not in rendered and "<img" not in rendered and "<b>" not in rendered and "<answer>" not in rendered
    assert "&lt;script&gt;window.pwned = 1&lt;/script&gt;" in rendered
    assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt; which `colour`?" in rendered
    assert "&lt;b&gt;bold&lt;/b&gt;" in rendered and "ex&lt;1&gt;" in rendered
