"""Job logs: an engine's log folder bundled into the one declared log file of its rule."""

from __future__ import annotations

from dflash_pipeline.core.joblog import bundle_logs


def test_every_engine_file_lands_in_the_declared_log_under_its_name(tmp_path):
    folder = tmp_path / "evaluate-engine"
    folder.mkdir()
    (folder / "vllm-speculative.log").write_text("INFO started\nERROR out of memory")
    (folder / "metrics-after-00.txt").write_bytes(b"vllm:spec_decode_num_drafts 12\n\xff")
    out = tmp_path / "logs" / "evaluate-engine.log"
    bundle_logs(folder, out, "no engine")
    text = out.read_text()
    assert text.index("===== metrics-after-00.txt =====") < text.index("===== vllm-speculative.log =====")
    assert "vllm:spec_decode_num_drafts 12" in text and "ERROR out of memory\n" in text
    assert "\ufffd" in text  # a stray byte is replaced, never an error


def test_no_engine_folder_writes_the_reason(tmp_path):
    out = tmp_path / "evaluate-engine.log"
    bundle_logs(tmp_path / "missing", out, "no serving engine was launched (evaluate.engine: transformers)")
    assert out.read_text() == "no serving engine was launched (evaluate.engine: transformers)\n"
