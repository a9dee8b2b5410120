"""Model families (Laguna, Qwen3 targets; DFlash drafters) and the checkpoint loader."""
