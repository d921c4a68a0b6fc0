"""selfspec training library: self-distillation data, drafter training recipes, typed configs."""
