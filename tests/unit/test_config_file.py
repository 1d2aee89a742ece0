"""The one reader of a ds_config path (infinity/config/file.py ``read_config_file``), used by the
API (``InfinityConfig.load``, ``infinity.initialize(config=path)``) and the CLI (``--config``):
what is not a regular UTF-8 text file, and nesting too deep, are one clear error naming the path."""
from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import pytest

from infinity import cli
from infinity.config import ConfigError, InfinityConfig
from infinity.config.file import MAX_CONFIG_DEPTH, parse_config_text
from infinity.train.run_config import read_config_file as cli_read_config_file

DEEP = 50_000


def _readers(path: Path):
    """The API's and the CLI's way to read ``path`` (the CLI's messages say --config)."""
    return [("api", lambda: InfinityConfig.load(path)), ("cli", lambda: cli_read_config_file(path))]


@pytest.mark.parametrize("text", ['{"a":' * DEEP + "1" + "}" * DEEP,
                                  '{"zero_optimization": ' + "[" * DEEP + "]" * DEEP + "}"],
                         ids=["objects", "lists"])
def test_a_config_nested_too_deep_is_refused_not_a_recursion_error(tmp_path, text) -> None:
    path = tmp_path / "deep.json"
    path.write_text(text)
    for how, read in _readers(path):
        with pytest.raises(ConfigError) as caught:
            read()
        message = str(caught.value)
        assert str(path) in message and f"nested more than {MAX_CONFIG_DEPTH} levels" in message, how
    # the base64 form goes through the same parser; a dict given to the API too
    deep: dict = {}
    inner = deep
    for _ in range(DEEP):
        inner["a"] = {}
        inner = inner["a"]
    with pytest.raises(ConfigError, match=f"the config: objects and lists are nested more than {MAX_CONFIG_DEPTH}"):
        InfinityConfig.from_dict(deep)
    looped: dict = {"zero_optimization": {}}
    looped["zero_optimization"]["x"] = looped
    with pytest.raises(ConfigError, match="nested more than"):
        InfinityConfig.from_dict(looped)


def test_nesting_up_to_the_limit_is_read(tmp_path) -> None:
    depth = MAX_CONFIG_DEPTH
    text = '{"a":' * (depth - 1) + "[]" + "}" * (depth - 1)
    assert parse_config_text(text, "x")["a"]
    with pytest.raises(ConfigError, match="line 1 column"):
        parse_config_text('{"a":' * depth + "[]" + "}" * depth, "x")


def test_cli_deep_config_is_one_line(tmp_path, capsys) -> None:
    path = tmp_path / "deep.json"
    path.write_text("[" * DEEP + "]" * DEEP)
    assert cli.main(["plan", "--model-size", "125M", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--config {path}: objects and lists are nested" in err


def test_a_config_that_is_not_utf8_names_the_path(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_bytes(b'{"train_batch_size": 8, "x": "\xff\xfe"}')
    for how, read in _readers(path):
        with pytest.raises(ConfigError) as caught:
            read()
        assert f"{path}: not a text file (not UTF-8" in str(caught.value), how
        assert ("--config" in str(caught.value)) == (how == "cli")


def test_a_fifo_is_refused_before_it_is_opened(tmp_path) -> None:
    """A FIFO blocked the API forever (its open waits for a writer). Here a writer thread waits
    to hand it a valid config: before the fix the API opened it and read the config; now it is
    refused unopened and the test itself opens it to let the writer go."""
    fifo = tmp_path / "ds.fifo"
    os.mkfifo(fifo)
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            with open(fifo, "w") as f:      # blocks until a reader opens the FIFO
                f.write(json.dumps({"train_micro_batch_size_per_gpu": 1}))
        except BaseException as exc:        # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        for how, read in _readers(fifo):
            with pytest.raises(ConfigError) as caught:
                read()
            assert f"{fifo} is a FIFO (named pipe), not a regular file" in str(caught.value), how
    finally:
        fd = os.open(fifo, os.O_RDWR)       # a reader: lets the writer's open return
        thread.join()
        os.close(fd)
    assert not errors


def test_a_device_or_socket_is_refused(tmp_path) -> None:
    for how, read in _readers(Path("/dev/null")):
        with pytest.raises(ConfigError, match="/dev/null is a character device, not a regular"):
            read()
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        for how, read in _readers(path):
            with pytest.raises(ConfigError, match=f"{path} is a socket, not a regular file"):
                read()


def test_a_missing_file_or_a_directory(tmp_path) -> None:
    for how, read in _readers(tmp_path / "missing.json"):
        with pytest.raises(FileNotFoundError, match="missing.json does not exist"):
            read()
    for how, read in _readers(tmp_path):
        with pytest.raises(FileNotFoundError, match=f"{tmp_path} is a directory"):
            read()
