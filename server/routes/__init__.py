"""One router per resource: predictions, the model (info and admin), health and metrics."""
