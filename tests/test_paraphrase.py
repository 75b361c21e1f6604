"""Paraphrase caches: the strict response parser, every check of a wording against its question, the cache file,
applying a cache to examples, and the `data_tools.paraphrase` tool (resume, kept wordings, provenance)."""

import io
import json
from pathlib import Path

import pytest
from PIL import Image

from data_tools import paraphrase as tool
from vlm_corl import cli
from vlm_corl.config import MemberConfig
from vlm_corl.data.paraphrases import (
    CacheError,
    CacheRecord,
    ParaphraseRejected,
    answer_options,
    apply_paraphrases,
    check_paraphrase,
    parse_response,
    read_cache,
    select_paraphrases,
)
from vlm_corl.data.records import Example
from vlm_corl.members.member import load_member
from vlm_corl.members.rollout import Response, RolloutGroup, SamplingParams
from vlm_corl.models.zoo import build_zoo

SOURCE = "If $f(x) = \\frac{3x-2}{x-2}$, what is the value of $f(-2) +f(-1)+f(0)$? Express it as a common fraction."
GOOD = "Let $f(x) = \\frac{3x-2}{x-2}$. Find $f(-2) +f(-1)+f(0)$, written as a common fraction."
OPTIONS = (
    "Find the curve defined by the equation\n\\[r^2 \\cos 2 \\theta = 4.\\](A) Line\n(B) Circle\n(C) Parabola"
    "\n\nEnter the letter of the correct option."
)
DIAGRAM = 'What is $DE$? [asy]\npair D,E;\nD = (0,7);\nlabel("$7$",D,W);\n[/asy]'


def reason(fn, *args, **kwargs) -> str | None:
    try:
        fn(*args, **kwargs)
    except ParaphraseRejected as e:
        return e.reason
    return None


# ---- parsing ------------------------------------------------------------------------------------------------


def test_parse_accepts_exactly_one_block_after_an_optional_think():
    assert parse_response("<paraphrase> A wording. </paraphrase>") == "A wording."
    assert parse_response("\n<think>hmm <paraphrase>?</think>\n<paraphrase>A\nB</paraphrase>\n") == "A\nB"


@pytest.mark.parametrize(
    "text, truncated, expected",
    [
        ("Just a question?", False, "no_block"),
        ("<paraphrase>Half a question", False, "unclosed_block"),
        ("<paraphrase>Half a question", True, "truncated"),
        ("<think>still thinking", True, "truncated"),
        ("<paraphrase>a</paraphrase><paraphrase>b</paraphrase>", False, "multiple_blocks"),
        ("<paraphrase>a<paraphrase>b</paraphrase>", False, "multiple_blocks"),
        ("Sure! <paraphrase>a</paraphrase>", False, "text_outside_block"),
        ("<paraphrase>a</paraphrase> Hope this helps.", False, "text_outside_block"),
        ("</paraphrase>a<paraphrase>", False, "text_outside_block"),
    ],
)
def test_parse_names_each_malformed_response(text, truncated, expected):
    assert reason(parse_response, text, truncated) == expected


# ---- checks ---------------------------------------------------------------------------------------------------


def test_a_faithful_rewording_passes():
    assert reason(check_paraphrase, GOOD, SOURCE) is None


@pytest.mark.parametrize(
    "candidate, expected",
    [
        ("", "empty"),
        ("   \n", "empty"),
        (SOURCE.upper().replace(" ", "  ").rstrip("."), "identical"),
        (GOOD.replace("3x-2", "3x-5"), "numbers_changed"),  # a number changed
        (GOOD.replace("+f(0)", ""), "numbers_changed"),  # a number dropped
        (GOOD + " Use 2 steps.", "numbers_changed"),  # a number added
        ("Find $f(-2)+f(-1)+f(0)$ for $f(x)=\\frac{3x-2}{x-2}$.", None),  # reordered prose, same numbers
        ("Find $f(-2)+f(-1)+f(0)$ for $f(x)=\\frac{3x-2}{x-2}$ " + "as a fraction, " * 30, "too_long"),
    ],
)
def test_each_check_has_its_reason(candidate, expected):
    assert reason(check_paraphrase, candidate, SOURCE) == expected


def test_too_short():
    assert reason(check_paraphrase, "Sum $f(-2),f(-1),f(0)$; $f=\\frac{3x-2}{x-2}$.", SOURCE) == "too_short"


def test_options_must_stay_verbatim_and_in_order():
    assert answer_options(OPTIONS) == ["(A) Line", "(B) Circle", "(C) Parabola"]
    ok = (
        "Which curve has the equation \\[r^2 \\cos 2 \\theta = 4.\\]?\n(A) Line\n(B) Circle\n(C) Parabola\n\n"
        "Answer with the letter of the right option."
    )
    assert reason(check_paraphrase, ok, OPTIONS) is None
    reordered = ok.replace("(A) Line\n(B) Circle", "(B) Circle\n(A) Line")
    assert reason(check_paraphrase, reordered, OPTIONS) == "options_changed"
    reworded = ok.replace("(C) Parabola", "(C) A parabola")
    assert reason(check_paraphrase, reworded, OPTIONS) == "options_changed"


def test_options_on_lines_and_from_the_choice_list():
    lines = "Which angle is right?\nA. 30°\nB. 90°"
    assert answer_options(lines) == ["A. 30°", "B. 90°"]
    assert reason(check_paraphrase, "Pick the right angle:\nB. 90°\nA. 30°", lines) == "options_changed"
    inline = "Which colour is the sky: red or blue?"
    assert answer_options(inline, ("red", "blue")) == ["red", "blue"]
    assert reason(check_paraphrase, "Is the sky blue or red?", inline, ("red", "blue")) == "options_changed"
    assert reason(check_paraphrase, "Is the sky red or blue in colour?", inline, ("red", "blue")) is None
    assert answer_options("Points (A) and (B)?") == ["(A) and", "(B)?"]  # a known false positive: strict wins


def test_diagrams_must_stay_verbatim():
    assert reason(check_paraphrase, "Find the length $DE$. " + DIAGRAM[14:], DIAGRAM) is None
    changed = DIAGRAM[14:].replace(",D,W", ",D,E")
    assert reason(check_paraphrase, "Find the length $DE$. " + changed, DIAGRAM) == "diagram_changed"


def test_select_keeps_the_first_n_that_pass_and_counts_the_rest():
    responses = [
        ("<paraphrase>" + GOOD + "</paraphrase>", False),
        ("no tags", False),
        ("<paraphrase>" + GOOD.lower() + "</paraphrase>", False),  # same as the first, up to case
        (
            "<paraphrase>Evaluate $f(-2) +f(-1)+f(0)$ where $f(x) = \\frac{3x-2}{x-2}$, as a common fraction."
            "</paraphrase>",
            False,
        ),
        (
            "<paraphrase>Compute $f(-2)+f(-1)+f(0)$ with $f(x)=\\frac{3x-2}{x-2}$; "
            "give a common fraction.</paraphrase>",
            False,
        ),
        ("<paraphrase>cut", True),
    ]
    kept, dropped, surplus = select_paraphrases(responses, SOURCE, n=2)
    assert kept[0] == GOOD and kept[1].startswith("Evaluate")
    assert dropped == {"no_block": 1, "duplicate": 1, "truncated": 1}
    assert surplus == 1


# ---- the cache file and applying it -----------------------------------------------------------------------------


def record(id, question, paraphrases=()):
    return CacheRecord(
        id=id,
        source_question=question,
        paraphrases=tuple(paraphrases),
        rewriter="m",
        prompt="{question}",
        metadata={"mode": "wording"},
    )


def test_cache_round_trip(tmp_path):
    records = [record("a", "Q1?", ["P1?", "P2?"]), record("b", "Q2 $\\{x\\}$?", [])]
    path = tmp_path / "cache.jsonl"
    path.write_text("\n".join(r.to_json() for r in records) + "\n\n")
    assert read_cache(path) == {r.id: r for r in records}


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"id": "a", "source_question": "Q"', "cache.jsonl:2: not a JSON object"),
        ('["a"]', "cache.jsonl:2: expected a JSON object, got list"),
        ('{"id": "b", "source_question": "Q", "paraphrases": [], "rewriter": "m"}', "cache.jsonl:2: no 'prompt' field"),
        (
            '{"id": "b", "source_question": "Q", "paraphrases": "P", "rewriter": "m", "prompt": "p"}',
            "'paraphrases' must be a list",
        ),
        (
            '{"id": "b", "source_question": "Q", "paraphrases": [1], "rewriter": "m", "prompt": "p"}',
            "cache.jsonl:2: every entry of 'paraphrases' must be a string",
        ),
        (record("a", "Q").to_json(), "cache.jsonl:2: id 'a' already appears on line 1"),
    ],
)
def test_malformed_cache_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "cache.jsonl"
    path.write_text(record("a", "Q").to_json() + "\n" + line + "\n")
    with pytest.raises(CacheError, match=message.replace("[", r"\[").replace("(", r"\(")):
        read_cache(path)


def test_missing_cache_file(tmp_path):
    with pytest.raises(CacheError, match="cannot read paraphrase cache .*nope.jsonl"):
        read_cache(tmp_path / "nope.jsonl")


def test_apply_replaces_paraphrases_and_counts_missing_and_stale():
    examples = [
        Example("a", "Q1?", paraphrases=("own",)),
        Example("b", "Q2?", paraphrases=("own",)),
        Example("c", "Q3?"),
        Example("d", "Q4?"),
    ]
    cache = {
        "a": record("a", "Q1?", ["P1?", "P2?"]),
        "b": record("b", "Q2?", ["P3?"]),
        "d": record("d", "an older Q4?", ["P4?"]),
        "z": record("z", "Q?", ["P?"]),
    }
    out, report = apply_paraphrases(examples, cache)
    assert [ex.paraphrases for ex in out] == [("P1?", "P2?"), ("P3?",), (), ()]
    assert out[0].question_for("paraphrase:2") == "P2?" and out[0].question == "Q1?"
    assert (report.examples, report.applied, report.missing, report.stale, report.unused) == (4, 2, 1, 1, 1)
    assert report.samples == {"missing": ["c"], "stale": ["d"]}
    assert report.counts == {2: 1, 1: 1, 0: 2}
    assert (report.short_of(1), report.short_of(2)) == (2, 3)
    assert json.loads(json.dumps(report.as_dict()))["counts"] == {"0": 2, "1": 1, "2": 1}
    assert "1 missing, 1 stale" in report.summary()


# ---- the tool ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rewriter(tmp_path_factory) -> Path:
    return build_zoo(tmp_path_factory.mktemp("zoo"), families=["qwen3"])["qwen3"]


def write_data(path: Path, n: int) -> Path:
    rows = [{"id": f"q{i}", "question": f"What is {i} plus {i + 1}?", "answer": str(2 * i + 1)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_tool(capsys, *args) -> dict:
    assert tool.main([str(a) for a in args]) == 0
    return json.loads(capsys.readouterr().out)


def test_tool_resumes_without_redoing_finished_rows(tmp_path, rewriter, capsys):
    data, out = write_data(tmp_path / "data.jsonl", 5), tmp_path / "cache.jsonl"
    common = ["--data", data, "--model", rewriter, "--out", out, "--n", 1, "--max-new-tokens", 6, "--batch-size", 2]
    first = run_tool(capsys, *common, "--limit", 3)
    assert (first["examples"], first["already_done"], first["this_run"]["rewritten"]) == (3, 0, 3)
    assert first["this_run"]["responses"] == 6  # 2 samples (2 x n) per question
    # A random model writes no valid block: every response is dropped, by reason, and each example gets its line.
    assert sum(first["dropped"].values()) == 6 and first["kept"] == 0 and first["examples_short"] == 3
    lines = out.read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["q0", "q1", "q2"]

    again = run_tool(capsys, *common, "--limit", 3)
    assert (again["already_done"], again["this_run"], again["dropped"]) == (3, {}, first["dropped"])
    assert out.read_text().splitlines() == lines

    out.write_text(out.read_text() + lines[0][:25])  # a crash in the middle of writing a line
    more = run_tool(capsys, *common)
    assert (more["examples"], more["already_done"], more["this_run"]["rewritten"]) == (5, 3, 2)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["q0", "q1", "q2", "q3", "q4"]
    assert rows[3]["source_question"] == "What is 3 plus 4?" and rows[3]["rewriter"] == str(rewriter)
    assert rows[3]["prompt"] == tool.PROMPT and rows[3]["sampling"]["samples"] == 2
    assert "images" not in rows[3]


def test_tool_refuses_to_mix_prompts(tmp_path, rewriter, capsys):
    data, out = write_data(tmp_path / "data.jsonl", 1), tmp_path / "cache.jsonl"
    out.write_text(CacheRecord("q0", "What is 0 plus 1?", (), str(rewriter), tool.PROMPT).to_json() + "\n")
    assert cli.run(tool.main, ["--data", str(data), "--model", str(rewriter), "--out", str(out), "--scenario"]) == 2
    assert "written with another prompt (mode None: check --scenario)" in capsys.readouterr().err


class CannedEngine:
    """A rollout engine double: replies to each example id with fixed response texts."""

    def __init__(self, replies: dict[str, list[str]]):
        self.replies = replies
        self.prompts = []

    def generate(self, prompts, params):
        self.prompts += prompts
        return [RolloutGroup(p, [Response([], text, "stop") for text in self.replies[p.example_id]]) for p in prompts]


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (255, 0, 0)).save(buf, "PNG")
    return buf.getvalue()


def _settings(max_prompt_tokens: int) -> tool.Rewriting:
    """The tool's settings of the tests below: the tiny rewriter, two samples a question, batches of 2."""
    return tool.Rewriting(
        rewriter="tiny",
        template=tool.PROMPT,
        mode="wording",
        n=1,
        params=SamplingParams(n=2),
        batch_size=2,
        max_prompt_tokens=max_prompt_tokens,
    )


def test_kept_wordings_reach_the_examples(tmp_path, rewriter):
    examples = [
        Example("m1", SOURCE),
        Example("m2", OPTIONS),
        Example("v1", "What colour is the 2nd shape?", images=(png(),)),
    ]
    engine = CannedEngine(
        {
            "m1": ["<paraphrase>" + GOOD + "</paraphrase>", "<paraphrase>" + SOURCE + "</paraphrase>"],
            "m2": ["<paraphrase>" + OPTIONS.replace("(B) Circle\n", "") + "</paraphrase>", "nothing"],
            "v1": ["<think>ok</think><paraphrase>Which colour does the 2nd shape have?</paraphrase>"],
        }
    )
    member = load_member(MemberConfig(id="rewriter", model=str(rewriter), trainable=False))
    out = tmp_path / "cache.jsonl"
    counts = tool.rewrite(
        examples,
        member,
        engine,
        out,
        _settings(max_prompt_tokens=4096),
    )
    assert counts["kept"] == 2 and counts["dropped"] == {"identical": 1, "options_changed": 1, "no_block": 1}
    assert counts["paraphrases_per_example"] == {"0": 1, "1": 2}
    # The rewriter sees the question in its own chat template; a text model sees no image.
    assert [p.example_id for p in engine.prompts] == ["m1", "m2", "v1"]
    assert SOURCE in engine.prompts[0].text and "<|im_start|>" in engine.prompts[0].text
    assert engine.prompts[2].images == []

    updated, report = apply_paraphrases(examples, read_cache(out))
    assert updated[0].question_for("paraphrase:1") == GOOD
    assert updated[2].question_for("paraphrase:1") == "Which colour does the 2nd shape have?"
    assert updated[2].images == examples[2].images
    assert report.short_of(1) == 1 and report.missing == 0


def test_too_long_prompts_are_skipped_without_a_line(tmp_path, rewriter):
    member = load_member(MemberConfig(id="rewriter", model=str(rewriter), trainable=False))
    out = tmp_path / "cache.jsonl"
    counts = tool.rewrite(
        [Example("a", SOURCE)],
        member,
        CannedEngine({}),
        out,
        _settings(max_prompt_tokens=10),
    )
    assert counts["prompt_too_long"] == 1 and counts["rewritten"] == 0 and out.read_text() == ""


def test_resume_deletes_only_its_own_torn_last_line(tmp_path, capsys):
    """A crash while appending leaves the start of a record: removed. A whole record that only lacks its newline
    (a file edited by hand) is kept and ended; a last line that is no record of ours is never deleted."""
    record = CacheRecord("q0", "What is 1 plus 1?", ("What is one plus one?",), "rw", tool.PROMPT).to_json()
    out = tmp_path / "cache.jsonl"
    out.write_text(record + "\n" + record.replace("q0", "q1"))  # a whole record without its newline
    assert tool.resume(out, "rw", tool.PROMPT) == {"q0", "q1"}
    assert out.read_text().endswith("\n") and len(out.read_text().splitlines()) == 2
    out.write_text(record + "\n" + record.replace("q0", "q2")[:30])  # a torn append
    assert tool.resume(out, "rw", tool.PROMPT) == {"q0"}
    assert "removing a torn last line" in capsys.readouterr().err and out.read_text() == record + "\n"
    foreign = record + "\n" + "some notes of the user"
    out.write_text(foreign)
    with pytest.raises(CacheError, match="its last line is not a paraphrase record .* nothing was removed"):
        tool.resume(out, "rw", tool.PROMPT)
    assert out.read_text() == foreign
