"""What `nori up` says while it starts: the `curl` line it prints (a chat question where the
model folder has a default chat template, as the tokenizer reads it, else a plain completion),
and a model error surfacing while the kernels build."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from nori.cli.up_phases import curl_line, prepare_model_and_kernels


def _body(line: str) -> dict[str, object]:
    return json.loads(line.split(" -d '", 1)[1].rstrip("'"))


@pytest.mark.parametrize(
    ("files", "endpoint"),
    [
        ({"chat_template.jinja": "{{ messages }}"}, "chat/completions"),
        ({"tokenizer_config.json": {"chat_template": "{{ messages }}"}}, "chat/completions"),
        (
            {"tokenizer_config.json": {"chat_template": [{"name": "default", "template": "x"}]}},
            "chat/completions",
        ),
        # Named templates without a default: the tokenizer has no template to apply.
        (
            {"tokenizer_config.json": {"chat_template": [{"name": "tool", "template": "x"}]}},
            "completions",
        ),
        ({"tokenizer_config.json": {"chat_template": 3}}, "completions"),
        ({"tokenizer_config.json": {}}, "completions"),
        ({}, "completions"),
    ],
)
def test_the_request_follows_the_models_template(
    tmp_path: Path, files: dict[str, object], endpoint: str
) -> None:
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content)
        (tmp_path / name).write_text(text)
    line = curl_line("http://127.0.0.1:8000", "m", tmp_path, bearer=None)
    assert line.startswith(f"curl http://127.0.0.1:8000/v1/{endpoint} ")
    assert _body(line)["model"] == "m"
    assert "Authorization" not in line


def test_the_key_is_sent_as_the_shell_should_write_it(tmp_path: Path) -> None:
    line = curl_line("http://h:1", "m", None, bearer="$NORI_API_KEY")
    assert '-H "Authorization: Bearer $NORI_API_KEY"' in line
    assert _body(line)["prompt"] == "Once upon a time"


def test_a_model_error_is_raised_while_the_kernels_still_build(tmp_path: Path) -> None:
    """The conversion's error reaches the user at once; the build still ends whole."""
    release, ended = threading.Event(), threading.Event()

    def slow_build() -> None:
        release.wait(30)
        ended.set()

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"junk")
    with pytest.raises(ValueError, match="GGUF"):
        prepare_model_and_kernels(str(bad), None, slow_build)
    assert not ended.is_set()
    release.set()
    assert ended.wait(10)
