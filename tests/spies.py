"""Spies for tests that must show a fast path really ran (a silent fallback would pass them)."""

from __future__ import annotations


def record_fused_qk_calls(monkeypatch) -> list[bool]:
    """Wrap ``TritonPagedBackend.attend_fused_qk`` for the test: the returned list gets one entry
    per call, True where the fused kernel ran (the method did not return None)."""
    from laguna_dflash.engine.triton_attention import TritonPagedBackend

    calls: list[bool] = []
    attend_fused_qk = TritonPagedBackend.attend_fused_qk

    def counted(*args, **kwargs):
        out = attend_fused_qk(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(TritonPagedBackend, "attend_fused_qk", counted)
    return calls
