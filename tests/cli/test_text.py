"""What the command line prints: byte counts, one-line errors, tables, the bench's report."""

from __future__ import annotations

from foxhunt_stream.cli import bench
from foxhunt_stream.cli.text import describe_error, fmt_bytes, table
from foxhunt_stream.errors import FormatError


def test_fmt_bytes_uses_decimal_units():
    assert fmt_bytes(999) == "999 B"
    assert fmt_bytes(1_070_000_000) == "1.07 GB"
    assert fmt_bytes(16_060_000_000_000) == "16.06 TB"
    assert fmt_bytes(2.5e15) == "2500.00 TB"


def test_describe_error_is_one_line():
    assert describe_error(KeyError("'x' not found")) == "'x' not found"
    assert describe_error(OSError("disk\n  full")) == "disk full"
    assert describe_error(RuntimeError()) == "RuntimeError"
    assert describe_error(RuntimeError("boom")) == "RuntimeError: boom"
    e = FormatError("header-too-large", "length 9 exceeds 8", path="/m.safetensors", tensor="w")
    assert describe_error(e) == "/m.safetensors: tensor 'w': [header-too-large] length 9 exceeds 8"


def test_table_aligns_columns():
    lines = table([("name", "bytes"), ("a", "1,000"), ("long-name", "7")], right={1})
    assert lines == ["name       bytes", "a          1,000", "long-name      7"]


def _report() -> bench.Report:
    r = bench.Report(device="cpu", cache="warm", reps=3, threads=2,
                     checkpoint=dict(description="given", bytes=2_000_000_000, tensors=3, files=1),
                     versions={}, machine={}, date="2026-01-01", device_note="no GPU found")
    r.rows += [bench.Row("ceiling", "read", 2_000_000_000, [0.5]),
               bench.Row("ceiling", "write", 2_000_000_000, [1.0]),
               bench.Row("load", "foxhunt_stream load_file", 2_000_000_000, [1.0, 0.8, 0.6], ceiling="read"),
               bench.Row("save", "foxhunt_stream save_file", 2_000_000_000, [2.0], ceiling="write", note="no fsync")]
    r.notes.append("safetensors is not installed")
    return r


def test_report_table_letters_the_ceilings_and_names_each_rows_ceiling():
    lines = _report().table().splitlines()
    assert lines[0].startswith("foxhunt-stream ") and "bench: cpu (no GPU found), 2 threads" in lines[0]
    text = "\n".join(lines)
    assert "[a] read" in text and "[b] write" in text
    load = next(line for line in lines if "load_file" in line)
    assert "2.50" in load and "0.62 [a]" in load        # 2 GB / 0.8 s, against 4 GB/s
    save = next(line for line in lines if "save_file" in line)
    assert "0.50 [b]" in save and save.endswith("no fsync")
    assert lines[-1] == "note: safetensors is not installed"


def test_report_json_has_the_ratios():
    rows = _report().to_json()["rows"]
    assert rows[2]["ratio_to_ceiling"] == 2.5 / 4 and rows[0]["ratio_to_ceiling"] is None
