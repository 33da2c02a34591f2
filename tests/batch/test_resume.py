"""What a resumed job keeps, without a model: the output and its journal read back (`resume.load_records`), the
lines that run again (`resume.plan`), the writer's restart, and the settings kept beside the output."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from jaxllama.batch import records
from jaxllama.batch.jobs import read_line
from jaxllama.batch.resume import Planner, load_records
from jaxllama.batch.settings import SettingsChanged, check_settings, job_settings, record_settings
from jaxllama.batch.writer import OrderedWriter, journal_path
from jaxllama.engine.request import SamplingParams
from jaxllama.errors import InvalidParameter

LINES = [read_line(json.dumps({"id": f"r{i}", "prompt": "x"}), i) for i in range(1, 6)]


def plan(lines, done, retry_errors) -> SimpleNamespace:
    """The planner's decisions for a job held whole: kept (line number -> record), todo ([(line, duplicate)]) and
    its counts."""
    planner = Planner(done, retry_errors)
    planner.scan(lines)
    found = SimpleNamespace(kept={}, todo=[], retried=planner.retried, kept_errors=planner.kept_errors)
    for line in lines:
        record, duplicate = planner.decide(line)
        if record is not None:
            found.kept[line.number] = record
        else:
            found.todo.append((line, duplicate))
    found.others = planner.others()
    return found


def answer(i: int) -> dict:
    return {"id": f"r{i}", "text": f"answer {i}"}


def ids(path) -> list:
    return [records.record_id(json.loads(x)) for x in path.read_text().splitlines()]


def test_records_finished_out_of_order_are_kept_by_the_journal_and_folded_in_order(tmp_path):
    out = tmp_path / "out.jsonl"
    writer = OrderedWriter(out, [1, 2, 3, 4, 5])
    for i in (4, 1, 5):  # longest first: lines finish far out of order
        writer.put(i, answer(i))
    # killed here: no close; the output holds line 1, the journal all three
    assert ids(out) == ["r1"] and ids(journal_path(out)) == ["r4", "r1", "r5"]
    with open(out, "a") as f:
        f.write('{"id": "r2", "te')  # a line cut by the kill

    done = load_records(out)
    assert sorted(done) == ["r1", "r4", "r5"]
    found = plan(LINES, done, retry_errors=True)
    assert [line.id for line, _ in found.todo] == ["r2", "r3"]
    with OrderedWriter(out, [1, 2, 3, 4, 5], found.kept) as writer:
        assert ids(out) == ["r1"] and ids(journal_path(out)) == ["r1", "r4", "r5"]  # rewritten: each once in each
        writer.put(3, answer(3))
        writer.put(2, answer(2))
    assert ids(out) == ["r1", "r2", "r3", "r4", "r5"] and not journal_path(out).exists()


def test_output_lines_that_are_not_records_are_ignored(tmp_path):
    out = tmp_path / "out.jsonl"
    junk = ["[1, 2]", '"r2"', "3", "null", "[" * 100_000, '{"id": ["a"]}', '{"id": "r1", "text": "x"}']
    out.write_bytes("\n".join(junk).encode() + b"\n\xff\xfe\n")
    assert list(load_records(out)) == ["r1"]


def test_error_records_run_again_unless_retries_are_off():
    failed = records.failure(LINES[1], InvalidParameter("top_p=2: must be in (0, 1]", "top_p"))
    done = {"r1": answer(1), "r2": failed, "r9": answer(9)}
    found = plan(LINES, done, retry_errors=True)
    assert [line.id for line, _ in found.todo] == ["r2", "r3", "r4", "r5"]
    assert (found.retried, found.kept_errors, found.others) == (1, 0, [answer(9)])  # r9: kept, at the end
    found = plan(LINES, done, retry_errors=False)
    assert [line.id for line, _ in found.todo] == ["r3", "r4", "r5"] and found.kept_errors == 1
    # an answer beats an error record for the same id, wherever it is
    assert records.is_error(failed) and not records.is_error(answer(2))
    openai = read_line(json.dumps({"custom_id": "b", "url": "/v1/embeddings", "body": {}}), 1)
    assert records.is_error(records.failure(openai, InvalidParameter("x")))


def test_a_duplicate_id_fails_again_and_never_takes_the_first_lines_answer(tmp_path):
    lines = [*LINES[:2], read_line(json.dumps({"id": "r1", "prompt": "y"}), 3)]
    found = plan(lines, {"r1": answer(1)}, retry_errors=True)
    assert list(found.kept) == [1]
    assert [(line.number, type(error).__name__) for line, error in found.todo] == [(2, "NoneType"), (3, "DuplicateId")]


def test_a_resume_with_other_settings_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    settings = job_settings(str(tmp_path), SamplingParams(temperature=0), ["\n"], None, quantize=None)
    record_settings(out, settings)
    check_settings(out, settings)  # no output yet: a new job
    out.write_text(json.dumps(answer(1)) + "\n")
    check_settings(out, job_settings(str(tmp_path), SamplingParams(temperature=0), ["\n"], None, quantize=None))
    other = job_settings(str(tmp_path), SamplingParams(temperature=0.5), ["\n"], "be brief", quantize=None)
    with pytest.raises(
        SettingsChanged, match=r"system_prompt: None then, 'be brief' now; temperature: 0 then, 0.5 now\).*--overwrite"
    ):
        check_settings(out, other)


@pytest.mark.parametrize("recorded", ["[1, 2]", '"abc"', "[" * 5000 + "]" * 5000, "{not json"])
def test_a_settings_file_that_holds_no_settings_is_named_and_refused(tmp_path, recorded):
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps(answer(1)) + "\n")
    settings = job_settings(str(tmp_path), SamplingParams(temperature=0), [], None, quantize=None)
    record_settings(out, settings)
    path = next(tmp_path.glob("*.settings.json"))
    path.write_text(recorded)
    with pytest.raises(SettingsChanged, match=rf"{path}: not the settings of a job.*--overwrite"):
        check_settings(out, settings)


def test_a_job_read_a_window_at_a_time_keeps_its_order_duplicates_and_earlier_records(tmp_path, monkeypatch):
    from jaxllama.batch import runner
    from jaxllama.batch.runner import Answered, JobOptions, answer_job

    monkeypatch.setattr(runner, "WINDOW_LINES", 3)  # windows of 3 lines: ids and records decided across them
    job = tmp_path / "job.jsonl"
    objs = [{"id": f"r{i}", "prompt": "x"} for i in range(10)]
    objs.insert(7, {"id": "r2", "prompt": "again"})  # line 8 repeats line 3's id, two windows later
    job.write_text("\n".join(json.dumps(o) for o in objs[:5]) + "\n\n" + "\n".join(json.dumps(o) for o in objs[5:]))
    out = tmp_path / "out.jsonl"
    failed = records.failure(LINES[0], InvalidParameter("x"))
    earlier = [answer(1), {**failed, "id": "r8"}, answer(5), {"id": "r99", "text": "of no line"}]
    out.write_text("".join(json.dumps(r) + "\n" for r in earlier))
    asked = []

    def answer_all(lines, tally):
        for line in lines:  # taken one at a time; answered last first, as longest-first scheduling would
            asked.append(line)
        for line in reversed(asked):
            tally.add(Answered(line.number, {"id": line.id, "text": "new"}, True))

    stats = answer_job(job, out, JobOptions(quiet=True), answer_all)
    written = [json.loads(x) for x in out.read_text().splitlines()]
    assert [records.record_id(r) for r in written] == [o["id"] for o in objs] + ["r99"]
    assert [line.number for line in asked] == [1, 3, 4, 5, 8, 10, 11, 12]  # 6 blank, 2 and 7 kept, 9 a duplicate
    assert written[1] == answer(1) and written[5] == answer(5) and written[-1] == earlier[-1]
    assert written[7]["error"]["code"] == "duplicate_id" and written[9]["text"] == "new"  # r8's error run again
    assert (stats.requests, stats.skipped, stats.retried, stats.ok, stats.failed) == (11, 2, 1, 8, 1)
    assert not journal_path(out).exists()
