"""`kvchat bench niah` with the real SmolLM2 model: the sparse cache beside dense attention."""

from __future__ import annotations

import json
import random

import pytest

from kvchat.bench.grid import needle_blocks
from kvchat.bench.needles import Task, TaskSpec, make_problem
from kvchat.bench.niah import run_niah_bench
from kvchat.config import load_settings
from kvchat.tui.cli import main


@pytest.mark.slow
def test_sparse_and_dense_cells() -> None:
    # A 512-token window, and every candidate block in the budget: each selecting layer must
    # hold the needle.
    lc = ["local_windows_len=512", "second_select_num=64"]
    settings = load_settings(overrides=[f"long_context.{item}" for item in lc]).settings
    lines: list[str] = []
    progress: list[tuple[int, int]] = []
    result = run_niah_bench(
        settings,
        TaskSpec(Task.MULTIKEY),
        [2048],
        [0.25],
        trials=1,
        compare_dense=[2048],
        log=lines.append,
        on_progress=lambda done, total: progress.append((done, total)),
    )
    assert json.loads(json.dumps(result)) == result  # JSON-ready as is
    assert result["benchmark"] == "niah"
    assert result["task"]["task"] == "multikey" and result["task"]["kind"] == "number"
    assert result["haystack"]["name"] == "news" and len(result["haystack"]["sha256"]) == 64
    (cell,) = result["cells"]
    assert cell["attention"] == "sparse"
    assert 1600 <= cell["document_tokens"] <= 2048  # the question and template take the rest
    assert cell["ok"] == all(value in cell["answer"] for value in cell["expected"])
    assert cell["score"] == float(cell["ok"])  # one value asked
    (needle,) = cell["needle_blocks"]
    assert 0 < needle < (2048 - 512) // 128  # before the window
    for key in ("question", "first_token", "answer"):
        assert cell[f"needle_recall_{key}"] == 1.0
    (dense,) = result["compare_dense"]["cells"]
    assert dense["attention"] == "dense" and dense["needle_blocks"] is None
    assert dense["needle_recall_question"] is None
    assert sum(line.startswith(("main ", "dense ")) for line in lines) == 2
    assert any(line.startswith(" overall") for line in lines)
    # two prefills a cell (the document, then the question), each announced with (0, n)
    assert [done for done, _ in progress].count(0) == 4


def test_a_needle_split_by_a_block_boundary_counts_the_block_of_its_value(engine_fp32) -> None:
    # The needle's first tokens end block 1 and its value lies in block 2: the answer copies
    # the value, so block 2 is the one whose selection counts as recall.
    tokenizer = engine_fp32.tokenizer
    block = engine_fp32.settings.long_context.block_size
    problem = make_problem(TaskSpec(Task.SINGLE), 0.5, random.Random(0))
    (sentence,), (value,) = problem.asked, problem.expected
    conversation = engine_fp32.new_session().conversation
    conversation.document_ids = tokenizer.encode_long("Sky")  # the template around a document
    prefix = conversation.document_prefix_length(tokenizer)
    words = 2 * block - prefix - 3
    while len(tokenizer.encode_long("Sky" + " blue" * words)) + prefix > 2 * block - 3:
        words -= 1
    document = "Sky" + " blue" * words + " " + sentence + " The end."
    start = document.index(sentence)
    value_at = start + sentence.rindex(value)
    assert needle_blocks(engine_fp32, document, [start]) == [1]
    assert needle_blocks(engine_fp32, document, problem.value_offsets(document)) == [2]
    assert problem.value_offsets(document) == [value_at]


@pytest.mark.slow
def test_the_question_pins_the_block_it_names() -> None:
    # A 512-token window leaves ~25 candidate blocks for 8 selected: the anchors alone miss
    # the needle's block in most layers (recall 0.1-0.5 at depths 0.2 and 0.6), the
    # question's vote puts it in every selection of the answer.
    lc = ["local_windows_len=512", "second_select_num=8", "pinned_blocks=2"]
    settings = load_settings(overrides=[f"long_context.{item}" for item in lc]).settings
    result = run_niah_bench(
        settings, TaskSpec(Task.SINGLE), [4096], [0.2], trials=1, log=lambda line: None
    )
    for cell in result["cells"]:
        assert cell["needle_recall_first_token"] == cell["needle_recall_answer"] == 1.0
        assert cell["needle_recall_question"] > 0.8  # the early layers vote before they know
        assert cell["ok"], cell["answer"]


def test_cli_refuses_a_bad_haystack(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "niah", "--lengths", "1k", "--haystack", str(tmp_path / "none.txt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1] == f"kvchat: error: {tmp_path / 'none.txt'}: no such file"


def test_cli_options() -> None:
    from kvchat.tui.cli import build_parser

    args = build_parser().parse_args(["bench", "niah", "--task", "multivalue", "--needle", "uuid"])
    assert args.task is Task.MULTIVALUE and args.needle.value == "uuid"
    assert args.haystack == "news" and args.depths is None and args.trials is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "niah", "--task", "haystack"])
