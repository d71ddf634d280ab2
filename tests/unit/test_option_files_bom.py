"""A file an option names may start with a UTF-8 byte order mark (what Windows editors write):
it is dropped. It made the first key of a --keys-file, the first id of a --tokens file, a
fleet file's JSON and a token file's secret read as bad ('\\ufeff3f2a...')."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from kvctl.cli.options import read_secret_file
from kvctl.errors import InvalidArgument
from kvctl.paths import read_text_file

BOM = b"\xef\xbb\xbf"
KEY = "3f2a9c0d1e4b5a697887766554433221"
runner = CliRunner()


def test_a_bom_is_dropped_and_a_bad_byte_is_placed_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "f.txt"
    path.write_bytes(BOM + b"abc\r\n")
    assert read_text_file(path) == "abc\r\n"
    path.write_bytes(BOM + b"ab\xff")
    with pytest.raises(InvalidArgument, match=r"byte 0xff at offset 5\)"):
        read_text_file(path)
    path.write_bytes(b"ab\xff")
    with pytest.raises(InvalidArgument, match=r"byte 0xff at offset 2\)"):
        read_text_file(path)


def test_a_token_file_with_a_bom_gives_the_token_alone(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_bytes(BOM + b"s3cret-token\r\n")
    assert read_secret_file(path) == "s3cret-token"


def test_keys_and_tokens_files_with_a_bom_read_as_without(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_bytes(BOM + f"{KEY}\r\n".encode())
    db = f"sqlite:///{tmp_path / 'none.db'}"
    out = runner.invoke(app, ["lookup", "--all", "--keys-file", str(keys), "--db", db])
    said = " ".join(out.output.split())
    assert out.exit_code == 2 and "no fleet database" in said, said  # past the keys, at the db

    tokens = " ".join(str(i) for i in range(600))
    plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
    plain.write_text(tokens, encoding="utf-8")
    marked.write_bytes(BOM + tokens.encode())
    want = runner.invoke(app, ["keys", "--tokens", str(plain), "--json"])
    got = runner.invoke(app, ["keys", "--tokens", str(marked), "--json"])
    assert want.exit_code == 0, want.output
    assert (got.exit_code, got.stdout) == (0, want.stdout), got.output
    piped = runner.invoke(app, ["keys", "--tokens", "-", "--json"], input=BOM + tokens.encode())
    assert (piped.exit_code, piped.stdout) == (0, want.stdout), piped.output
