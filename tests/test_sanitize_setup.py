"""The compute-sanitizer setup (``gpu_check.sh sanitize``): without torch's caching allocator a
CUDA graph capture skips its test instead of failing it (conftest.skip_graph_captures)."""

from __future__ import annotations

import pytest
import torch
from conftest import skip_graph_captures


@pytest.mark.parametrize("start", ["graph_context", "capture_begin"])
def test_a_capture_skips_the_test(monkeypatch: pytest.MonkeyPatch, start: str) -> None:
    enter, begin = torch.cuda.graph.__enter__, torch.cuda.CUDAGraph.capture_begin
    skip_graph_captures(monkeypatch)
    with pytest.raises(pytest.skip.Exception, match="caching allocator"):
        if start == "graph_context":
            torch.cuda.graph.__enter__(object())  # before its side stream is entered
        else:
            torch.cuda.CUDAGraph.capture_begin(object())
    monkeypatch.undo()
    assert torch.cuda.graph.__enter__ is enter and torch.cuda.CUDAGraph.capture_begin is begin
