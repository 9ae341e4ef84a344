"""`kvchat bench ruler`: RULER's tasks generated from its data, scored with RULER's own
functions, and run through the engine with the real SmolLM2 model."""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter

import pytest

from kvchat.bench.ruler import data
from kvchat.bench.ruler.run import run_ruler_bench
from kvchat.bench.ruler.tasks import (
    RECIPES,
    Metric,
    RulerTask,
    make_sample,
    score,
    smallest_sample,
)
from kvchat.config import load_settings
from kvchat.core.model_files import resolve_model_path
from kvchat.core.tokenizer import load_tokenizer
from kvchat.tui.cli import build_parser, main


@pytest.fixture(scope="module")
def count():
    tokenizer = load_tokenizer(resolve_model_path("smollm2-135m"))
    return lambda text: len(tokenizer.encode_long(text))


@pytest.mark.parametrize("task", list(RulerTask))
def test_each_task_fills_its_budget_and_holds_what_its_answer_needs(task, count) -> None:
    sample = make_sample(task, 4096, 3800, count, seed="t")
    assert 3800 * 0.95 <= count(sample.document) <= 3800
    assert sample.question and sample.answer_prefix and sample.references
    assert sample == make_sample(task, 4096, 3800, count, seed="t")  # the seed decides
    smallest = smallest_sample(task, 4096, seed="t")
    assert (smallest.question, smallest.answer_prefix) == (sample.question, sample.answer_prefix)
    assert sample != make_sample(task, 4096, 3800, count, seed="u")
    document = sample.document
    if task.value.startswith("niah") or task is RulerTask.VT:
        for reference in sample.references:
            assert reference in document
    if task.value.startswith("niah"):
        # each evidence offset is where one asked value begins
        for offset, reference in zip(sample.evidence, sample.references, strict=True):
            assert document.startswith(reference, offset)
    if task is RulerTask.VT:  # the chain: the value, then each variable set from the one before
        chain = [document[o:].split(" The grass")[0].strip() for o in sample.evidence]
        names = sample.references
        assert chain[0].startswith(f"VAR {names[0]} = ") and chain[0].split()[-1].isdigit()
        assert chain[1:] == [f"VAR {b} = VAR {a}" for a, b in itertools.pairwise(names)]
    if task is RulerTask.CWE:  # the last list (after the one-shot example) counts 30 vs 3
        listed = Counter(re.findall(r"\d+\. (\S+)", document.rsplit("often.\n", 1)[1]))
        assert {w for w, n in listed.items() if n == 30} == set(sample.references)
        assert set(listed.values()) == {30, 3}
    if task is RulerTask.FWE:
        ranked = [w for w, _ in Counter(document.split(". ", 1)[1].split()).most_common(4)]
        assert ranked[0] == "..." and ranked[1:] == list(sample.references)
    if task in (RulerTask.QA_1, RulerTask.QA_2):
        assert document.count("Document ") >= 10
    if task is RulerTask.QA_2:  # the two paragraphs of the supporting facts
        assert len(sample.evidence) == 2
    if task is RulerTask.QA_1:  # SQuAD's answers are spans of its paragraph
        assert any(
            r.lower() in document[o : o + 2000].lower()
            for o in sample.evidence
            for r in sample.references
        )


def test_lengths_scale_to_128k_without_repeating_the_haystack(count) -> None:
    # 128K tokens of essays: every needle-free sentence of the document is there once.
    sample = make_sample(RulerTask.NIAH_SINGLE_2, 131072, 128000, count, seed="long")
    assert 128000 * 0.99 <= count(sample.document) <= 128000
    sentences = Counter(re.split(r"(?<=[.!?]) ", sample.document))
    repeated = [s for s, n in sentences.items() if n > 1 and len(s.split()) > 12]
    assert not repeated, repeated[:3]


def test_past_the_essays_the_haystack_goes_on_with_hotpotqa_not_again() -> None:
    from kvchat.bench.ruler.tasks import _haystack_words

    essays = data.essay_words()
    words = _haystack_words(len(essays) + 5000)
    assert len(words) == len(essays) + 5000
    assert tuple(words[: len(essays)]) == essays
    hotpot = " ".join(data.hotpotqa().documents[:200]).split()
    assert words[len(essays) :] == hotpot[:5000]


def test_scores_are_rulers_own() -> None:
    # RULER's metric functions, from its installed package, against kvchat's.
    from long_context_eval.eval.synthetic.constants import (
        string_match_all_per_sample,
        string_match_part_per_sample,
    )

    cases = [
        ("The numbers are 1234567 and 7654321.", ("1234567", "7654321")),
        ("Only 1234567\x07 here", ("1234567", "7654321")),
        ("  the Temperate Zone ", ("temperate zone", "tropics")),
        ("nothing", ("a", "b", "c")),
    ]
    for answer, refs in cases:
        clean = re.sub(r"[\x00-\x1f]", "\n", answer.strip()).strip()
        assert (
            100 * score(Metric.ALL, answer, refs)
            == string_match_all_per_sample([clean], [list(refs)])[0]
        )
        assert (
            100 * score(Metric.PART, answer, refs)
            == string_match_part_per_sample([clean], [list(refs)])[0]
        )
    assert {r.metric for t, r in RECIPES.items() if t.value.startswith("qa")} == {Metric.PART}


def test_missing_data_is_one_line_naming_the_install_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    data.require()  # installed by make
    monkeypatch.setattr(data, "_WORDS_PACKAGE", "kvchat_no_such_package")
    assert main(["bench", "ruler", "--lengths", "1k"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("kvchat: error: RULER's data is not installed")
    assert line.endswith(data.RULER_INSTALL)


@pytest.mark.slow
def test_a_run_scores_its_samples_and_reads_the_evidence_with_a_full_budget() -> None:
    # A 512-token window and a budget over every candidate block: each selecting layer must
    # read the blocks of the four needles' values that lie outside the window.
    lc = ["local_windows_len=512", "second_select_num=64"]
    settings = load_settings(overrides=[f"long_context.{item}" for item in lc]).settings
    lines: list[str] = []
    task = RulerTask.NIAH_MULTIVALUE
    result = run_ruler_bench(
        settings, [task], [2048], samples=1, compare_dense=[2048], log=lines.append
    )
    assert json.loads(json.dumps(result)) == result
    assert result["benchmark"] == "ruler" and result["tasks"] == [task.value]
    (row,) = result["main"]["samples"]
    recipe = RECIPES[task]
    assert row["task"] == task.value and row["attention"] == "sparse"
    assert 1800 <= row["prompt_tokens"] <= 2048 - recipe.max_new_tokens
    assert row["score"] == score(recipe.metric, row["answer"], tuple(row["references"]))
    assert row["evidence_recall_question"] == row["evidence_recall_answer"] == 1.0
    assert len(row["evidence_blocks"]) == 4
    table = result["main"]["scores"]["2048"]
    assert table == {task.value: 100 * row["score"], "average": 100 * row["score"]}
    (dense,) = result["compare_dense"]["samples"]
    assert dense["attention"] == "dense" and dense["evidence_blocks"] is None
    assert dense["references"] == row["references"]  # the same sample
    assert any("dense" in line and "average" in line for line in lines)


def test_cli_task_names(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(["bench", "ruler", "--tasks", "niah,vt,qa_2"])
    assert args.tasks == [*(t for t in RulerTask if t.value.startswith("niah_")), RulerTask.VT,
                          RulerTask.QA_2]  # fmt: skip
    assert parser.parse_args(["bench", "ruler", "--tasks", "all"]).tasks == list(RulerTask)
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "ruler", "--tasks", "needles"])
    assert exit_.value.code == 2
    assert "unknown RULER task 'needles'" in capsys.readouterr().err
