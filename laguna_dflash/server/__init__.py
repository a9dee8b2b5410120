"""OpenAI-compatible HTTP server (``laguna-dflash serve``).

Modules: ``args`` (flags, resolved config), ``async_engine`` (the engine thread), ``serving``,
``completions``, ``chat``, ``tokenization`` (routes' logic), ``detokenizer`` (incremental text,
stop strings), ``sampling`` (request -> SamplingParams), ``metrics`` / ``stats_log``
(Prometheus text, periodic log lines), ``app`` (FastAPI), ``launcher`` (build and run).
Importing this package does not import FastAPI; ``launcher`` and ``app`` do.
"""
