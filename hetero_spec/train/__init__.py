"""Draft distillation from exported target features (uses draft.model and features only)."""
