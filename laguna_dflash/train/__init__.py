"""Training: demo target pretraining and DFlash drafter distillation."""
