"""The batch directory and input checks: pure file logic, no services."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from nori.batch.durable_writes import AppendLog
from nori.batch.input_file import check_input
from nori.batch.store import BatchStore, LineResult


def _line(custom_id: object, url: str = "/v1/completions", **body: object) -> str:
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": url, "body": {"prompt": "x", **body}}
    )


def test_malformed_lines_fail_alone_with_their_line_numbers(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(
        "\n".join(
            [
                _line("a"),
                "{not json",
                _line("b", url="/v1/embeddings"),
                _line(""),
                _line("c", stream=True),
                json.dumps({"custom_id": "d", "method": "GET", "url": "/v1/completions"}),
                "",
                _line("e"),
            ]
        )
        + "\n"
    )
    checked = check_input(source, "/v1/completions")
    assert [(v.line, v.custom_id) for v in checked.lines] == [(1, "a"), (8, "e")]
    assert [e["line"] for e in checked.line_errors] == [2, 3, 4, 5, 6]
    assert [e["custom_id"] for e in checked.line_errors] == [None, "b", None, "c", "d"]
    assert all(e["message"].startswith(f"line {e['line']}: ") for e in checked.line_errors)
    assert checked.total == 7 and not checked.batch_errors
    # The byte ranges point at the lines themselves.
    data = source.read_bytes()
    assert (
        json.loads(
            data[checked.lines[1].offset : checked.lines[1].offset + checked.lines[1].length]
        )["custom_id"]
        == "e"
    )


def test_a_duplicate_custom_id_fails_the_batch_naming_both_lines(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(_line("a") + "\n" + _line("b") + "\n" + _line("a") + "\n")
    checked = check_input(source, "/v1/completions")
    assert [e["code"] for e in checked.batch_errors] == ["duplicate_custom_id"]
    assert checked.batch_errors[0]["line"] == 3
    assert "line 1" in checked.batch_errors[0]["message"]


def test_an_empty_file_and_too_many_lines_fail_the_batch(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert [e["code"] for e in check_input(empty, "/v1/completions").batch_errors] == ["empty_file"]
    many = tmp_path / "many.jsonl"
    many.write_text("".join(_line(f"r{i}") + "\n" for i in range(4)))
    assert [e["code"] for e in check_input(many, "/v1/completions", 3).batch_errors] == [
        "too_many_lines"
    ]


def test_any_supported_endpoint_per_line_without_a_batch_endpoint(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(
        _line("a") + "\n" + _line("b", url="/v1/chat/completions") + "\n" + _line("c", url="/x")
    )
    checked = check_input(source, None)
    assert [v.custom_id for v in checked.lines] == ["a", "b"]
    assert [e["line"] for e in checked.line_errors] == [3]


def test_results_keep_each_lines_first_record_and_skip_a_torn_one(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    batch_id = store.create_batch(
        {
            "input_file_id": "file-" + "0" * 24,
            "endpoint": "/v1/completions",
            "completion_window": "24h",
            "created_at": 1,
            "expires_at": 2,
        }
    )
    first = store.result_log(batch_id, "runner-a")
    second = store.result_log(batch_id, "runner-b")
    first.write_bytes(
        LineResult(1, True, {"custom_id": "a", "n": 1}).to_json()
        + b"\n"
        + LineResult(2, False, {"custom_id": "b"}).to_json()
        + b"\n"
        + b'{"line": 3, "ok": tr'
    )
    # runner-b redid line 1 (runner-a was killed before acknowledging it) and did line 3.
    second.write_bytes(
        LineResult(1, True, {"custom_id": "a", "n": 2}).to_json()
        + b"\n"
        + LineResult(3, True, {"custom_id": "c"}).to_json()
        + b"\n"
    )
    results = store.read_results(batch_id)
    assert sorted(results) == [1, 2, 3]
    assert results[1].record["n"] == 1
    assert results[2].ok is False


def test_an_append_log_ends_a_torn_record_before_writing_on(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": ')

    async def write() -> None:
        log = AppendLog(path)
        await asyncio.gather(*(log.append(json.dumps({"i": i}).encode()) for i in range(5)))
        log.close()

    asyncio.run(write())
    lines = path.read_bytes().split(b"\n")
    assert lines[0] == b'{"a": 1}' and lines[1] == b'{"b": '
    assert [json.loads(x)["i"] for x in lines[2:] if x] == [0, 1, 2, 3, 4]


def test_the_batch_object_follows_the_directory(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    meta = store.create_file("in.jsonl", "batch", iter([_line("a").encode() + b"\n"]))
    assert store.file_meta(meta["id"])["bytes"] == len(_line("a")) + 1
    batch_id = store.create_batch(
        {
            "input_file_id": meta["id"],
            "endpoint": "/v1/completions",
            "completion_window": "24h",
            "metadata": {"k": "v"},
            "created_at": 10,
            "expires_at": 20,
        }
    )
    assert store.batch_object(batch_id)["status"] == "validating"
    checked = check_input(store.file_path(meta["id"]), "/v1/completions")
    store.write_validated(batch_id, checked.total, checked.lines, checked.line_errors)
    assert store.batch_object(batch_id)["status"] == "in_progress"
    assert store.active_batch_ids() == [batch_id]
    store.cancel(batch_id)
    cancelling = store.batch_object(batch_id)
    assert cancelling["status"] == "cancelling" and cancelling["cancelling_at"] is not None
    store.write_final(
        batch_id,
        {
            "status": "cancelled",
            "cancelled_at": 30,
            "request_counts": {"total": 1, "completed": 0, "failed": 0},
        },
    )
    final = store.batch_object(batch_id)
    assert final["status"] == "cancelled" and final["cancelled_at"] == 30
    assert final["request_counts"] == {"total": 1, "completed": 0, "failed": 0}
    assert final["metadata"] == {"k": "v"}
    assert store.active_batch_ids() == []
    store.delete_file(meta["id"])
    assert store.list_files() == []
