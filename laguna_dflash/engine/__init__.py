"""Engine: paged KV cache, attention backends, scheduler, runner, spec decoding, lifecycle."""
