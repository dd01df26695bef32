"""Training: budgets and the training clock, the learning-rate schedule, the LightningModule, callbacks,
and run folders."""
